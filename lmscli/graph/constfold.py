"""The tensors TensorFlow's runtime turns into constants after Grappler has run.

When a session builds the executors of a step, it optimizes each device's part of the graph once
more (the classic graph optimizer, on by default): every tensor computed from constants alone
that an op outside that computation reads is evaluated once, on the CPU, and becomes a ``Const``
of that device. Its buffer is then held for as long as the graph is loaded, like a variable's;
the ops that made it still run each step and free their own outputs at once, as nothing reads
them any more. Grappler leaves such computations alone when they make a large tensor from small
ones (a ``Tile``), so this is what turns the gradient of a mean into resident memory: on a 3D
U-Net the two 1 MiB tensors below sat under its variables in the stand-in allocator's memory
map, where the model had them live for a few ops::

    before
    Const -> Reshape -> Tile -> truediv (Mul) -> sub_grad/Neg -> mul_grad/Mul <- labels
                                   `-> Log1p_grad/mul
    after
    Const -> Reshape -> Tile -> truediv (read by nothing)    truediv/_cf (Const) -> Log1p_grad/mul
                                                                        `-> sub_grad/Neg (read by nothing)
                                                             sub_grad/Neg/_cf (Const) -> mul_grad/Mul

What counts (as TensorFlow's ``common_runtime/constant_folding.cc`` decides): a ``Const`` with no
inputs at all is constant; an op is, when it is stateless, not control flow, a send, a receive or
a placeholder, has a CPU kernel, no output known to exceed :data:`MAX_CONSTANT_BYTES`, and reads
only constants of its own device through its data inputs (control inputs do not matter); shape
reads of fully known shapes always are. A constant op's output read by a non-constant op (or
another device) becomes a ``Const`` when it is at most :data:`MAX_CONSTANT_BYTES` and not a
handle or string.
"""

from __future__ import annotations

from lmscli.graph.graphview import CONSTANT_OPS, CONTROL_FLOW_OPS, PLACEHOLDER_OPS, SHAPE_OPS, GraphView
from lmscli.graph.opdefs import CpuKernels, StatefulOps

MAX_CONSTANT_BYTES = 10 << 20  # the runtime makes no larger constant (its ConstantFoldingOptions default)
_NEVER = CONTROL_FLOW_OPS | PLACEHOLDER_OPS | frozenset({
    "_Send", "_Recv", "_HostSend", "_HostRecv", "_Arg", "_Retval", "FakeParam", "GetSessionHandle",
    "GetSessionHandleV2", "GetSessionTensor", "DeleteSessionTensor"})


def runtime_constants(view: GraphView, stateful=None, cpu_kernel=None, gone: frozenset = frozenset()
                      ) -> frozenset[tuple[int, int]]:
    """``(node, output)`` of every tensor of ``view`` the runtime's constant folding makes a
    ``Const`` (see the module docstring). ``stateful`` and ``cpu_kernel`` (op type -> bool)
    default to TensorFlow's registry. ``gone``: nodes the step does not run (what Grappler prunes
    from the graph as written): they neither fold nor read."""
    stateful = stateful or StatefulOps()
    cpu_kernel = cpu_kernel or CpuKernels()
    calls = {f.signature.name for f in view.library}
    constant = [False] * view.size
    for i in view.order:
        op, data = view.ops[i], view.data_inputs[i]
        if i in gone:
            continue
        if op in CONSTANT_OPS:
            constant[i] = not data and not view.control_inputs[i] and _value_type(view, i)
        elif op in SHAPE_OPS:
            constant[i] = bool(data) and all(_known_shape(view, src, out) for src, out in data)
        elif data and op not in _NEVER and op not in calls and not any(
                (info.num_bytes or 0) > MAX_CONSTANT_BYTES for info in view.outputs(i)):
            constant[i] = (all(constant[src] and view.gpus[src] == view.gpus[i] for src, _ in data)
                           and not stateful(op) and cpu_kernel(op))
    out = set()
    for i in range(view.size):
        if not constant[i] or view.ops[i] in CONSTANT_OPS:
            continue
        infos = view.outputs(i)
        for dst, _port, output in view.consumers[i]:
            if dst in gone or (constant[dst] and view.gpus[dst] == view.gpus[i]):
                continue
            info = infos[output] if output < len(infos) else None
            if info is not None and info.itemsize and info.num_bytes is not None and info.num_bytes <= MAX_CONSTANT_BYTES:
                out.add((i, output))
    return frozenset(out)


def _value_type(view: GraphView, i: int) -> bool:
    infos = view.outputs(i)
    return not infos or infos[0].dtype != "resource"


def _known_shape(view: GraphView, src: int, output: int) -> bool:
    infos = view.outputs(src)
    info = infos[output] if output < len(infos) else None
    return info is not None and info.shape is not None and all(d is not None for d in info.shape)


# repeated() compares Consts up to this size by value; a larger one is its own (counted apart, so
# never less than the runtime holds), and its value is not serialized each time a schedule is built.
KEYED_CONSTANT_BYTES = 4 << 10


def repeated(view: GraphView, folded) -> frozenset[tuple[int, int]]:
    """The runtime constants of ``folded`` (those of one step: Grappler prunes the others) that
    repeat an earlier one: the same op with the same attributes on the same device, reading the
    same values (:data:`KEYED_CONSTANT_BYTES`). Grappler's common-subexpression pass
    keeps one of each such set before the runtime folds it, so one buffer is resident, not one per
    copy (QA r47: ``tf.gradients`` of two segment reductions makes four identical 8 MiB
    ``zeros_like`` Fills; the graph as written was counted 36 MiB of constants and a lower bound
    above the peak of the graph TensorFlow runs)::

        Fill(zeros_like_1/shape, 0)   Fill(zeros_like_2/shape, 0)   (equal shapes)
          --> one Fill, one 8 MiB constant
    """
    keys: dict = {}
    # A key is a small integer naming its (op, device, attributes, input keys): nested, the keys
    # were trees whose hashing walked every path of the graph (QA r50: a net of swish activations,
    # each read twice, took twice as long per layer; `lms analyze` ran out of time at 30 layers).
    # Made without recursion: the inputs of a shape op go back to the step's first op.
    ids: dict = {}
    visiting = object()

    def key(first: int):
        stack = [first]
        while stack:
            i = stack[-1]
            if i not in keys:
                if view.ops[i] in CONSTANT_OPS and any((info.num_bytes or 0) > KEYED_CONSTANT_BYTES
                                                       for info in view.outputs(i)):
                    keys[i] = ids.setdefault(("node", i), len(ids))
                else:
                    keys[i] = visiting  # (its inputs first)
                    stack.extend(src for src, _out in view.data_inputs[i] if src not in keys)
                    continue
            elif keys[i] is visiting:  # its inputs have keys now (None through a cycle, as a loop's)
                inputs = tuple((keys[src], out) for src, out in view.data_inputs[i])
                node = view.node_defs[i]
                attrs = tuple(sorted((name, value.SerializeToString(deterministic=True))
                                     for name, value in node.attr.items() if not name.startswith("_")))
                keys[i] = None if any(k is None or k is visiting for k, _out in inputs) else ids.setdefault(
                    (view.ops[i], view.gpus[i], attrs, inputs), len(ids))
            stack.pop()
        return keys[first]

    seen: set = set()
    out = set()
    for i, output in sorted(folded):
        k = key(i)
        if k is None:
            continue
        if (k, output) in seen:
            out.add((i, output))
        seen.add((k, output))
    return frozenset(out)
