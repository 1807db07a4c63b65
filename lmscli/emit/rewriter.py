"""The emit pass: a new MetaGraphDef with the plan's swap-out and swap-in operations.

For a tensor ``t`` produced by ``P`` with a near consumer ``A`` and far consumers ``B``, ``C``::

    before                         after
    P --t--> A                     P --t--> A
    P --t--> B                     P --t--> P-lms-swapout-0 (Identity, host)
    P --t--> C                                  |
                                                v
                                   P-lms-swapin-0-0 (Identity, host) <- - - ^trigger
                                                |
                                                +--> B, C

The swap-out copies ``t`` to the host as soon as ``P`` finishes; the GPU copy is freed when ``A``
is done. The swap-in holds the host copy; the host-to-device copy happens when the trigger has
run, just before ``B`` needs it. Waiters (``- - -`` control edges from the swap-out) stop ops from
allocating before a swap-out has finished. Serialized levels chain ops with control edges.

In plans made for the stand-in (``stand_in``) the swap-out reads ``t`` through an Identity on
``P``'s device, ``P-lms-send-0``, which forwards ``t``'s buffer::

    P --t--> P-lms-send-0 (Identity, GPU) --> P-lms-swapout-0 (Identity, host)

An output that another process reads (the stand-in's swap-out to its host process) must be
allocated so that the network can send from it, so a kernel that would write it over its input
(a ReLU over its bias add) allocated a buffer of its own while the input was still held: 4.5 MiB
more at each swapped ReLU of a CNN, which needed 18 MiB after a plan for 12 and 15 with the
Identity. A GPU copying to its own process's memory reuses the buffer anyway, and there the
Identity changed how Grappler's scheduler orders the optimized graph with oneDNN on (ResNet-50's
swap plans at 75% and 80% of its peak were judged over budget): GPU plans go without it.

A swap-in with a landing op ``L`` (stand-in plans) is read on the GPU through an Identity that
``L`` waits for, so the tensor lands before ``L`` allocates, in every run::

    P-lms-swapin-0-0 (host) --> P-lms-landed-0-0 (Identity, GPU) --+--> B, C
                                                                   + - - -> ^L

A recomputation of ``t = R(Q(x))`` whose far consumer ``B`` runs late clones the chain::

    before                         after
    x --> Q --> R --t--> A         x --> Q --> R --t--> A
                  --t--> B         x --> x-lms-recompute-gate-0-0 --> Q-lms-recompute-0 --> R-lms-recompute-0 --> B
                                               ^ - - - trigger

The clones copy the originals' op and attributes (not ``_class``) and wait for the trigger, the
latest op before ``B`` that ``B`` depends on, so they run just before ``B`` and ``t``'s buffer
is free in between. They wait through an Identity *gate* on their first input (``x`` above
reaches ``Q``'s clone through ``x-lms-recompute-gate-0-0``, which has the control edge): Grappler's
remapper fuses no op with a control edge, and the clones must fuse as the originals do. Ops that
update a variable the clones read wait for a ``done`` Identity of the last clone.

Clones may read a swap-in, or the clones of another recomputation (``via``: a dense block's
concatenation made again from the clone of the one before it, itself made again)::

    before                           after
    x --> A --a--> B --b--> C        x --> A --a--> B --b--> C
            --a--> GA                x --> gate --> A-lms-recompute-0 --a'--> GA
                   --b--> GB                        a' --> gate --> B-lms-recompute-0 --b'--> GB

A gradient stack kept on the host (:mod:`lmscli.plan.hoststacks`) is moved, not copied: its
``StackV2`` and the pushes, pops and closes using its handle (a TensorList accumulator: every op
the list passes through) get the host device and lose their ``_class`` colocation, so TensorFlow
copies each pushed value out and each popped value back::

    before                                   after
    rnn/loop/Tanh --> .../StackPushV2        rnn/loop/Tanh --> .../StackPushV2 (host)
    .../f_acc (StackV2, GPU)                 .../f_acc (StackV2, host)
    .../StackPopV2 --> TanhGrad              .../StackPopV2 (host) --> TanhGrad

An accumulator no op reads has its pushes turned into Identities of the list
(:func:`drop_pushes`), under their own names: nothing is kept, nothing is copied.

Added nodes are named after the node they stand beside (:func:`beside`: ``P-lms-...``), carry
``_grappler_do_not_remove`` (swap nodes) and never a ``_class`` colocation attribute. The result
is validated (unique names, no dangling inputs, no cycles).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmscli.errors import GraphError, PlanError
from lmscli.graph.graphview import PLACEHOLDER_OPS, UNWAITING_OPS, GraphView, gpu_key, parse_input
from lmscli.plan.document import Plan
from lmscli.timing import timed

SCOPE = "lms/"  # where lms 0.x put its nodes (still recognised: has_lms_nodes, is_lms_node)
MARK = "-lms-"  # an added node is named after the node it stands beside: P-lms-swapin-0-0
RECOMPUTE = MARK + "recompute-"
LANDED = MARK + "landed-"  # the Identity a swap-in is read through on the GPU (a landing op waits for it)
DEFAULT_HOST_DEVICE = "/device:CPU:0"


@dataclass(frozen=True)
class RewriteReport:
    swap_outs: int
    swap_ins: int
    swap_out_bytes: int
    swap_in_bytes: int
    control_edges: int
    added_nodes: tuple[str, ...]
    recomputes: int = 0  # groups of consumers reading clones
    recompute_bytes: int = 0
    clones: int = 0  # cloned ops (the rest of the recomputation's nodes are Identity gates)
    host_stacks: int = 0  # gradient stacks moved to the host
    host_stack_bytes: int = 0
    landed: int = 0  # swap-ins read on the GPU through an Identity placed like the producer
    sent: int = 0  # swap-outs reading the tensor through an Identity placed like the producer
    serial_loops: int = 0  # while loops set to run one iteration at a time
    dropped_lists: int = 0  # accumulators no op reads, their pushes taken out
    dropped_bytes: int = 0

    def summary(self) -> str:
        from lmscli.units import format_size

        line = (f"Added {len(self.added_nodes)} operations to the model ({self.swap_outs} swap-out "
                f"operations ({format_size(self.swap_out_bytes)}) and {self.swap_ins} swap-in operations "
                f"({format_size(self.swap_in_bytes)})" + (", each read on the GPU through an Identity"
                                                          if self.landed and self.landed == self.swap_ins else "")
                + (", each swap-out sending through one" if self.sent and self.sent == self.swap_outs else ""))
        if self.recomputes:
            others = len(self.added_nodes) - self.swap_outs - self.swap_ins - self.landed - self.sent - self.clones
            line += (f", {self.clones} cloned operations and {others} Identity nodes recomputing "
                     f"{format_size(self.recompute_bytes)} in {self.recomputes} place(s)")
        line += ")"
        if self.host_stacks:
            line += (f"; moved {self.host_stacks} gradient stack(s) of while loops to the host "
                     f"({format_size(self.host_stack_bytes)} per step)")
        if self.dropped_lists:
            line += (f"; took out the pushes of {self.dropped_lists} loop accumulator(s) no op reads "
                     f"({format_size(self.dropped_bytes)} in all no longer held to their loops' ends)")
        if self.serial_loops:
            line += f"; {self.serial_loops} while loop(s) set to run one iteration at a time"
        return line


def is_lms_node(name: str) -> bool:
    """Whether ``name`` is a node lms added (swap, landing, recompute clone, gate)."""
    return MARK in name or name.startswith(SCOPE)


def has_lms_nodes(graph_def) -> bool:
    return any(is_lms_node(node.name) for node in graph_def.node)


def beside(name: str, kind: str) -> str:
    """The name of a node lms adds for node ``name``: ``name`` + ``-lms-`` + ``kind``. It sorts
    right after ``name`` among the other input names (only a name ``name-`` followed by something
    before ``lms`` would come between, which TensorFlow's own naming never makes), and that
    matters: Grappler sorts the inputs of commutative ops by name, and its constant push-down
    then picks an operand by position, so a swap-in named
    ``lms/swapin/...`` (sorting after ``gradients/...``) regrouped a product's factors and changed
    its last bits (QA: the softmax gradient of every attention block was left unswapped)::

        Mul(sub, enc0/Softmax) * c     -> sub * (c * enc0/Softmax)                (original)
        Mul(sub, lms/swapin/...) * c   -> lms/swapin/... * (c * sub)              (differs)
        Mul(sub, enc0/Softmax-lms-swapin-0-0) * c -> sub * (c * enc0/Softmax-...) (same)
    """
    return f"{name}{MARK}{kind}"


def host_for(producer_device: str, host_device: str) -> str:
    """The host a swap node of a tensor made on ``producer_device`` goes to: ``host_device``, on
    the producer's job and task when the graph spans several (``/job:worker/task:1`` + ``/device:CPU:0``)."""
    if host_device.startswith("/job:") or host_device.startswith("/task:"):
        return host_device
    gpu = gpu_key(producer_device) or ""
    prefix = gpu.split("/device:", 1)[0]
    return prefix + host_device


def _tensor_ref(node: str, output: int) -> str:
    return node if output == 0 else f"{node}:{output}"


@timed("emit")
def rewrite(meta_graph, plan: Plan, host_device: str = DEFAULT_HOST_DEVICE, force: bool = False,
            view: GraphView | None = None):
    """Return ``(new_meta_graph, RewriteReport)``; ``meta_graph`` is not modified.

    ``view`` (of the same graph, with shapes) saves re-importing the graph to learn dtypes."""
    from lmscli.tfimport import tensorflow

    tensorflow()
    from tensorflow.core.framework import attr_value_pb2

    if has_lms_nodes(meta_graph.graph_def) and not force:
        raise GraphError("the graph already contains lms swap nodes (it was rewritten before); "
                         "pass --force to rewrite it again")
    out = type(meta_graph)()
    out.CopyFrom(meta_graph)
    graph = out.graph_def
    nodes = {node.name: node for node in graph.node}
    dtypes = _view_dtypes(view) if view is not None else _output_dtypes(graph)
    added: list[str] = []
    control_edges = 0
    taken = set(nodes)

    def unique(name: str) -> str:
        base, n = name, 1
        while name in taken:
            name = f"{base}_{n}"
            n += 1
        taken.add(name)
        return name

    def add_identity(name: str, source: str, dtype, device: str):
        node = graph.node.add(name=name, op="Identity", device=device)
        node.input.append(source)
        node.attr["T"].type = dtype
        node.attr["_grappler_do_not_remove"].CopyFrom(attr_value_pb2.AttrValue(b=True))
        added.append(name)
        return node

    def add_control(target: str, source: str):
        nonlocal control_edges
        node = nodes.get(target)
        if node is None:
            raise PlanError(f"the plan names op {target!r}, which is not in the graph")
        if node.op in UNWAITING_OPS:
            why = ("it is fed, so the edge would be lost" if node.op in PLACEHOLDER_OPS else
                   "its initialisation, and every read of it, would then wait for the step's ops")
            raise PlanError(f"the plan makes {target!r} ({node.op}) wait for {source!r}: {why}")
        ref = "^" + source
        if ref not in node.input:
            node.input.append(ref)
            control_edges += 1

    out_bytes = in_bytes = n_in = n_landed = n_sent = 0
    swapins: dict[tuple[str, int, int], str] = {}  # (producer, output, group) -> swap-in node
    for swap in plan.swaps:
        producer, output, _ = parse_input(swap.tensor)
        if producer not in nodes:
            raise PlanError(f"the plan swaps {swap.tensor!r}, but the graph has no node {producer!r}")
        dtype = dtypes.get((producer, output))
        if dtype is None:
            raise PlanError(f"cannot tell the dtype of {swap.tensor!r}")
        swapout = unique(beside(producer, f"swapout-{output}"))
        host = host_for(nodes[producer].device, host_device)
        source = _tensor_ref(producer, output)
        if plan.read_on_gpu and plan.stand_in:  # (see the module docstring: the kernel keeps writing over its input)
            send = unique(beside(producer, f"send-{output}"))
            add_identity(send, source, dtype, nodes[producer].device)
            source = send
            n_sent += 1
        add_identity(swapout, source, dtype, host)
        out_bytes += swap.bytes
        refs = {_tensor_ref(producer, output), f"{producer}:{output}"}
        for g, group in enumerate(swap.swap_ins):
            swapin = unique(beside(producer, f"swapin-{output}-{g}"))
            swapins[(producer, output, g)] = swapin
            node = add_identity(swapin, swapout, dtype, host)
            if group.trigger not in nodes:
                raise PlanError(f"the plan's trigger {group.trigger!r} is not in the graph")
            node.input.append("^" + group.trigger)
            control_edges += 1
            n_in += 1
            in_bytes += swap.bytes
            # Consumers read the tensor on the GPU through an Identity placed like its producer:
            # Grappler's constant push-down leaves alone products whose factors sit on another
            # device than the product, so a consumer reading the host swap-in directly got a
            # differently grouped (and rounded) product (QA: the GELU gradient of an encoder).
            if plan.read_on_gpu or group.landing:
                landed = unique(beside(producer, f"landed-{output}-{g}"))
                add_identity(landed, swapin, dtype, nodes[producer].device)
                n_landed += 1
                if group.landing:  # the landing op waits for it: the tensor lands before it allocates
                    add_control(group.landing, landed)
                swapins[(producer, output, g)] = swapin = landed
            _rewire(nodes, group.consumers, refs, swapin, swap.tensor)
        waiters = list(swap.near) if swap.sync_out else []
        waiters += [w for w in swap.waiters if w not in waiters]
        for waiter in waiters:
            add_control(waiter, swapout)
    n_re = re_bytes = n_clones = 0
    gates: list[str] = []  # each waits for its trigger by a control edge
    landed_names = set(swapins.values())
    swapin_nodes = {node.name: node for node in graph.node if node.name in landed_names}

    def _swapin_dtype(name: str):
        node = swapin_nodes.get(name)
        return node.attr["T"].type if node is not None else None

    remade: dict[tuple[str, int, int], tuple[str, int]] = {}  # (producer, output, group) -> its clone's output
    readers = _data_readers(graph)  # before the clones: what each recomputed tensor and cloned op had
    cloned: dict[str, str] = {}  # clone -> original
    for rec in _sources_first(plan.recomputes):
        producer, output, _ = parse_input(rec.tensor)
        missing = [op for op in rec.ops + (producer,) if op not in nodes]
        if missing:
            raise PlanError(f"the plan recomputes {rec.tensor!r} with {missing[0]!r}, which is not in the graph")
        if rec.ops[-1] != producer:
            raise PlanError(f"the plan recomputes {rec.tensor!r} with ops that do not end in its producer")
        refs = {_tensor_ref(producer, output), f"{producer}:{output}"}
        for g, group in enumerate(rec.groups):
            if group.trigger not in nodes:
                raise PlanError(f"the plan's trigger {group.trigger!r} is not in the graph")
            def gate(src: str, port: int, near: str, g=g, trigger=group.trigger, producer=producer) -> str:
                dtype = dtypes.get((src, port)) or _swapin_dtype(src)
                if dtype is None:
                    raise PlanError(f"cannot tell the dtype of {src}:{port}")
                device = nodes[src].device if src in nodes else nodes[producer].device
                node = add_identity(unique(beside(near, f"recompute-gate-{port}-{g}")), _tensor_ref(src, port), dtype,
                                    device)
                node.input.append("^" + trigger)
                gates.append(node.name)
                return node.name

            read_from = {}  # sources the clones read from a swap-in or another recomputation's clones
            for tensor, k in rec.via:
                src, src_out, _ = parse_input(tensor)
                if (src, src_out, k) in swapins:
                    read_from[(src, src_out)] = (swapins[(src, src_out, k)], 0)
                elif (src, src_out, k) in remade:
                    read_from[(src, src_out)] = remade[(src, src_out, k)]
                else:
                    raise PlanError(f"the plan recomputes {rec.tensor!r} from swap-in or recomputation {k} of "
                                    f"{tensor!r}, which the plan does not make")

            def source(src: str, port: int, read_from=read_from) -> tuple[str, int]:
                return read_from.get((src, port), (src, port))

            clones = _clone_chain(graph, nodes, rec.ops, f"recompute-{g}", unique, gate, source)
            cloned.update((clone, original) for original, clone in clones.items())
            remade[(producer, output, g)] = (clones[producer], output)
            dtypes[(clones[producer], output)] = dtypes.get((producer, output))
            added.extend(clones.values())
            n_clones += len(clones)
            n_re += 1
            re_bytes += rec.bytes
            made = _tensor_ref(clones[producer], output)
            if rec.waiters:  # variable updates wait until the clones have read the variable
                dtype = dtypes.get((producer, output))
                done = add_identity(unique(beside(producer, f"recompute-done-{output}-{g}")),
                                    _tensor_ref(clones[producer], output), dtype,
                                    nodes[producer].device)
                for waiter in rec.waiters:
                    add_control(waiter, done.name)
            _rewire(nodes, group.consumers, refs, made, rec.tensor)
    _keep_fan_out(graph, nodes, {parse_input(rec.tensor)[:2] for rec in plan.recomputes}, cloned, readers,
                  add_identity, unique, dtypes)
    control_edges += len(gates)
    for chain in plan.serialize:
        for before, after in zip(chain, chain[1:]):
            add_control(after, before)
    for stack in plan.on_host:
        _to_host(nodes, stack, host_device)
    for stack in plan.dropped:
        drop_pushes(nodes, stack)
    serial = _serialize_loops(graph, plan.serial_loops)
    try:
        after = GraphView(graph)
    except GraphError as exc:
        raise GraphError(f"the rewritten graph is invalid: {exc}") from None
    if any(after.frames) or any(after.cond_depth):
        _check_branches(view if view is not None else GraphView(meta_graph.graph_def), after)
        _check_loop_entries(after)
    report = RewriteReport(len(plan.swaps), n_in, out_bytes, in_bytes, control_edges, tuple(added), n_re, re_bytes,
                           n_clones, len(plan.on_host), sum(h.bytes for h in plan.on_host), n_landed,
                           serial_loops=serial, sent=n_sent, dropped_lists=len(plan.dropped),
                           dropped_bytes=sum(h.bytes for h in plan.dropped))
    return out, report


def emit(prepared, plan: Plan, host_device: str = DEFAULT_HOST_DEVICE, force: bool = False):
    """Emit ``plan`` into a copy of a prepared step's graph (:class:`lmscli.analysis.Prepared`):
    ``(meta_graph, RewriteReport)``; refuses a plan made for another graph."""
    from lmscli.analysis import with_graph_def
    from lmscli.plan.document import graph_fingerprint

    if plan.graph_sha256 and plan.graph_sha256 != graph_fingerprint(prepared.graph_def):
        raise PlanError("the plan was made for a different graph (fingerprint mismatch); "
                        "re-run lms tune on this graph, or check --batch-size")
    meta = with_graph_def(prepared.model.meta_graph, prepared.graph_def)
    return rewrite(meta, plan, host_device=host_device, force=force, view=prepared.view)


def _check_branches(before: GraphView, after: GraphView) -> None:
    """Every op of the graph runs in the same v1 cond branches and while-loop frame as before: a
    control edge from an op that may not run (it sits in a branch the step does not take) would
    silently stop its target, and one across a loop frame fails at run time::

        pred -> Switch -:1-> A (true branch)     A - - -> X (outside the cond): X now runs only
                                                 when pred is true -- refused
    """
    tags_before, tags_after = before.branch_tags(), after.branch_tags()
    for i, name in enumerate(before.names):
        k = after.index.get(name)
        if k is None:
            continue
        if tags_after[k] != tags_before[i]:
            raise PlanError(f"the plan adds a control edge that would make {name!r} run in other cond branches "
                            "than it does (from an op in a branch to one outside it, or in another branch)")
        if after.frames[k] != before.frames[i]:
            raise PlanError(f"the plan moves {name!r} into another while-loop frame")


def _check_loop_entries(after: GraphView) -> None:
    """No node lms added that feeds a while loop's ``Enter`` waits for that loop. Its iterations
    wait for the value, only ``parallel_iterations`` of them may be under way, and so the loop
    never ends: the step hangs (QA: a hand-edited plan triggered the swap-in of a decoder loop's
    attention memory by the projection after that loop)::

        x --> swap-out --> swap-in --> Enter --> loop body ... Exit --> proj
                              ^- - - - - - - - - - - - - - - - - - - - -'   refused
    """
    for k in range(after.size):
        if not is_lms_node(after.names[k]):
            continue
        frames = {after.frames[dst] for dst, _port, _out in after.consumers[k] if after.ops[dst] in ("Enter", "RefEnter")}
        if not frames:
            continue
        for a in sorted(after.ancestors([k])):
            if any(after.frames[a] == f or after.frames[a].startswith(f + "/") for f in frames):
                raise PlanError(f"the plan brings a value back into while loop {after.frames[a]!r} after an op that "
                                f"waits for that loop ({after.names[a]!r}): the loop would wait for it, and the step "
                                "would never end; trigger it by an op that runs before the loop")


def _to_host(nodes: dict, stack, host_device: str) -> None:
    """Place a gradient stack and the ops using its handle on the host (no ``_class``); a
    TensorList accumulator with every op its value passes through."""
    from lmscli.plan.hoststacks import HANDLE_USERS, LIST_MAKERS, LIST_USERS, PASS_THROUGH, STACK_OPS

    names = (stack.stack, *stack.ops)
    maker = nodes.get(stack.stack)
    movable = (LIST_MAKERS | LIST_USERS | PASS_THROUGH if maker is not None and maker.op in LIST_MAKERS
               else STACK_OPS | HANDLE_USERS)
    for name in names:
        node = nodes.get(name)
        if node is None:
            raise PlanError(f"the plan keeps stack {stack.stack!r} on the host, but the graph has no node {name!r}")
        if node.op not in movable:
            raise PlanError(f"the plan moves {name!r} to the host with stack {stack.stack!r}, but it is a "
                            f"{node.op}, not an op of that stack")
    host = host_for(nodes[stack.stack].device, host_device)
    for name in names:
        node = nodes[name]
        node.device = host
        if "_class" in node.attr:
            del node.attr["_class"]


def drop_pushes(nodes: dict, stack) -> None:
    """Take out the pushes of a TensorList accumulator no op reads
    (:func:`lmscli.plan.hoststacks.droppable`): each becomes an Identity of the list it was given,
    under its own name (every edge from it stays valid), so the list stays empty and the value it
    pushed is freed when its other readers have run::

        before                                        after
        list, h_t ──> TensorListPushBack "p" ──>      list ──> Identity "p" ──> (the same readers)
    """
    from tensorflow.core.framework import types_pb2

    from lmscli.plan.hoststacks import LIST_MAKERS, LIST_USERS, PASS_THROUGH

    maker = nodes.get(stack.stack)
    if maker is None or maker.op not in LIST_MAKERS:
        raise PlanError(f"the plan drops the pushes of {stack.stack!r}, which is not a TensorList this graph makes")
    for name in stack.ops:
        node = nodes.get(name)
        if node is None:
            raise PlanError(f"the plan drops the pushes of {stack.stack!r}, but the graph has no node {name!r}")
        if node.op not in LIST_USERS | PASS_THROUGH or node.op == "TensorListPopBack":
            raise PlanError(f"the plan drops the pushes of {stack.stack!r}, but {name!r} (a {node.op}) reads it")
        if node.op != "TensorListPushBack":
            continue
        data = [i for i in node.input if not i.startswith("^")]
        control = [i for i in node.input if i.startswith("^")]
        device = node.device
        node.Clear()
        node.name, node.op, node.device = name, "Identity", device
        node.input.extend([data[0], *control])
        node.attr["T"].type = types_pb2.DT_VARIANT


def _serialize_loops(graph, frames) -> int:
    """Run each while loop named in ``frames`` (its ``Enter`` ops' ``frame_name``) one iteration
    at a time; returns how many loops changed. The executor reads ``parallel_iterations`` from the
    ``Enter`` that makes the frame; every ``Enter`` of the loop carries it, so all are set.
    Iterations compute the same values either way::

        Enter(x; frame_name="rnn/while/", parallel_iterations=32)
          -->  Enter(x; frame_name="rnn/while/", parallel_iterations=1)
    """
    wanted = set(frames)
    seen: set[str] = set()
    changed: set[str] = set()
    for node in graph.node:
        if node.op not in ("Enter", "RefEnter"):
            continue
        frame = node.attr["frame_name"].s.decode("utf-8", "replace") if "frame_name" in node.attr else ""
        if frame not in wanted:
            continue
        seen.add(frame)
        if node.attr["parallel_iterations"].i != 1:
            node.attr["parallel_iterations"].i = 1
            changed.add(frame)
    missing = sorted(wanted - seen)
    if missing:
        raise PlanError(f"the plan runs while loop {missing[0]!r} one iteration at a time, but the graph has no "
                        "Enter of that frame")
    return len(changed)


def _rewire(nodes: dict, consumers, refs: set, new: str, tensor: str) -> None:
    """Make each of ``consumers`` read ``new`` wherever it read ``tensor`` (spelled as in ``refs``)."""
    for consumer in consumers:
        target = nodes.get(consumer)
        if target is None:
            raise PlanError(f"the plan rewires {consumer!r}, which is not in the graph")
        hits = 0
        for k, text in enumerate(target.input):
            if text in refs:
                target.input[k] = new
                hits += 1
        if hits == 0:
            raise PlanError(f"{consumer!r} does not read {tensor!r}; the plan does not match the graph")


def _data_readers(graph) -> dict:
    """How many data inputs of the graph's nodes read each tensor ``(node, output)``."""
    count: dict = {}
    for node in graph.node:
        for text in node.input:
            if not text.startswith("^"):
                src, output, _ = parse_input(text)
                count[(src, output)] = count.get((src, output), 0) + 1
    return count


KEEP_FAN_OUT = 2  # readers a recomputed tensor, and each clone's output, keeps as far as the original had them


def _keep_fan_out(graph, nodes: dict, made: set, cloned: dict, before: dict, add_identity, unique, dtypes) -> None:
    """Identities that nothing reads (*keepers*, ``P-lms-recompute-keep-0``) for each recomputed tensor
    (``made``) and each output of a clone (``cloned``: clone -> original) that has fewer readers
    than the original tensor had (``before``), up to :data:`KEEP_FAN_OUT`. Grappler rewrites some
    ops only when an input has one reader (constant push-down regroups ``erfc * (x * 0.5)`` as
    ``x * (erfc * 0.5)``, the arithmetic optimizer sums a chain of adds in one AddN, the remapper
    fuses a bias add into its activation), which rounds differently: neither the original op,
    whose far readers now read a clone, nor a clone read only by the next clone, may have one
    reader where the original had more. Keepers are marked for Grappler to keep, and being read
    by nothing, are pruned from the step a Session runs: they cost nothing::

        before                         after
        x = mul(b, 0.5) --> mul_2      x = mul(b, 0.5) --> mul_2
                        --> grad                       --> x-lms-recompute-keep-0 (nothing reads it)
                                       x' (clone) --> grad
    """
    after = _data_readers(graph)
    wanted = {t: before.get(t, 0) for t in made}
    clones_of: dict = {}
    for clone, original in cloned.items():
        clones_of.setdefault(original, []).append(clone)
    for (src, output), count in before.items():
        for clone in clones_of.get(src, ()):
            wanted[(clone, output)] = count
    for (node, output), count in sorted(wanted.items()):
        original = cloned.get(node, node)
        have = after.get((node, output), 0)
        dtype = dtypes.get((original, output))
        while have < min(count, KEEP_FAN_OUT) and dtype is not None:
            add_identity(unique(beside(node, f"recompute-keep-{output}")), _tensor_ref(node, output), dtype,
                         nodes[original].device)
            have += 1


def _sources_first(recomputes) -> list:
    """``recomputes`` with each one whose clones read another's clones (``via``) after that one
    (a plan lms makes lists them so already; a plan edited by hand may not)."""
    by_tensor = {r.tensor: r for r in recomputes}
    done: set = set()
    out: list = []

    def visit(rec, path: frozenset) -> None:
        if rec.tensor in done:
            return
        if rec.tensor in path:
            raise PlanError(f"the plan recomputes {rec.tensor!r} from its own clones (through 'via')")
        for tensor, _k in rec.via:
            if tensor in by_tensor:
                visit(by_tensor[tensor], path | {rec.tensor})
        done.add(rec.tensor)
        out.append(rec)

    for rec in recomputes:
        visit(rec, frozenset())
    return out


def _clone_chain(graph, nodes: dict, ops, kind: str, unique, gate, source) -> dict[str, str]:
    """Add clones of ``ops`` (inputs first) reading each other where the originals do and
    everything else where the originals read it (or where ``source`` says it is now, a swap-in);
    original name -> clone name. A clone reading no
    other clone reads its first input through ``gate(input, port, original)`` (an Identity waiting for the
    trigger), so the chain waits for the trigger without a control edge of its own: Grappler's
    remapper does not fuse ops with control edges, and the clones must fuse as the originals do."""
    clones: dict[str, str] = {}
    for name in ops:
        original = nodes[name]
        clone = graph.node.add()
        clone.CopyFrom(original)
        clone.name = unique(beside(name, kind))
        if "_class" in clone.attr:
            del clone.attr["_class"]
        del clone.input[:]
        data = [parse_input(text) for text in original.input if not text.startswith("^")]
        gated = not any(src in clones for src, _output, _control in data)
        for k, (src, output, _control) in enumerate(data):
            if src in clones:
                clone.input.append(_tensor_ref(clones[src], output))
            elif gated and k == 0:
                clone.input.append(gate(*source(src, output), src))
            else:
                clone.input.append(_tensor_ref(*source(src, output)))
        clone.input.extend(text for text in original.input if text.startswith("^"))  # what the original waited for
        clones[name] = clone.name
    return clones


def _view_dtypes(view: GraphView) -> dict:
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    cache: dict = {}
    out = {}
    for i, name in enumerate(view.names):
        for k, info in enumerate(view.outputs(i)):
            if info.dtype not in cache:
                cache[info.dtype] = tf.as_dtype(info.dtype).as_datatype_enum
            out[(name, k)] = cache[info.dtype]
    return out


def _output_dtypes(graph_def) -> dict:
    """(node, output) -> DataType enum, from TensorFlow's op registry (via a graph import)."""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    return {(op.name, k): t.dtype.base_dtype.as_datatype_enum
            for op in graph.get_operations() for k, t in enumerate(op.outputs)}
