"""Run training steps on CPU, and compare two runs bit for bit.

The graph is imported into a session with two logical CPUs: the model on ``/device:CPU:1`` (the
stand-in for the GPU), nodes explicitly placed on a CPU (the swap nodes) on ``/device:CPU:0``.
Both runs use the same graph seed, the same random feeds for every placeholder and one
inter-op thread, and a random op the graph left unseeded gets a seed from its name in both
(:func:`seeded`), so any difference in loss or variables is a real difference. Used by the
identity proof (:mod:`lmscli.prove.verify`), the in-process measurement
(:mod:`lmscli.prove.measure`) and the stand-in GPU (:mod:`lmscli.prove.standin`).
"""

from __future__ import annotations

import heapq
import re
import zlib
from dataclasses import dataclass

import numpy as np

from lmscli.errors import InputError, LmsError
from lmscli.graph.graphview import PLACEHOLDER_OPS, parse_input
from lmscli.emit.rewriter import is_lms_node
from lmscli.tfimport import tensorflow

GPU_STANDIN = "/device:CPU:1"
HOST = "/device:CPU:0"
SCHEMA_VERSION = 1

# Swap kernels of Grappler's memory optimizer: GPU-only (not even registered in the CPU build).
# For a run they become Identity; for a measurement a copy in the right direction.
GPU_COPY_OPS = {"_CopyFromGpuToHost": "out", "_CopyFromHostToGpu": "in"}
COPY_OP = "DeepCopy"  # allocates its output and copies the bytes: bit-identical, and it really copies
_COPYABLE = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
             "uint32", "uint64", "bool", "complex64", "complex128")


@dataclass(frozen=True)
class StepRun:
    losses: tuple  # one array per step (the fetched loss, if the graph has one)
    variables: dict  # name -> final value
    placements: dict  # node name -> device it ran on (for the lms/ nodes)
    outputs: tuple = ()  # per step, the values of the fetched ops' outputs (graphs without variables)


@dataclass(frozen=True)
class CpuGraph:
    """A copy of a graph made runnable on the two logical CPUs."""

    meta_graph: object
    mapped: tuple[str, ...] = ()  # nodes whose GPU-only op became Identity
    swap_outs: tuple[str, ...] = ()  # host nodes reading a stand-in tensor
    swap_ins: tuple[str, ...] = ()  # host nodes feeding stand-in consumers
    copies: tuple[str, ...] = ()  # swap nodes replaced by a copying op (measurement copies only)
    notes: tuple[str, ...] = ()


def _on_host(device: str) -> bool:
    device = device.lower()
    return "cpu" in device and "gpu" not in device


def _dtype_name(node) -> str | None:
    tensorflow()
    from tensorflow.python.framework import dtypes

    if "T" not in node.attr:
        return None
    try:
        return dtypes.as_dtype(node.attr["T"].type).name
    except TypeError:
        return None


def map_gpu_ops(meta_graph):
    """A copy of ``meta_graph`` with Grappler's GPU-only swap kernels replaced by Identity (same device),
    and the names of the nodes changed."""
    meta = type(meta_graph)()
    meta.CopyFrom(meta_graph)
    mapped = []
    for node in meta.graph_def.node:
        if node.op in GPU_COPY_OPS:
            _retype(node, "Identity")
            mapped.append(node.name)
    return meta, tuple(mapped)


def on_one_device(meta_graph):
    """A copy of ``meta_graph`` whose GPU-placed nodes all run on the first GPU (their device
    cleared), as the stand-in runs every GPU's ops in its one process; CPU-placed nodes stay."""
    from lmscli.graph.graphview import gpu_key

    meta = type(meta_graph)()
    meta.CopyFrom(meta_graph)
    for node in meta.graph_def.node:
        if node.device and gpu_key(node.device) is not None:
            node.device = ""
    return meta


def _retype(node, op: str) -> None:
    keep = {k: node.attr[k] for k in ("T", "_output_shapes") if k in node.attr}
    node.op = op
    node.ClearField("attr")
    for key, value in keep.items():
        node.attr[key].CopyFrom(value)


def place_on_cpu(meta_graph, copies: bool = False) -> CpuGraph:
    """Place every node on the stand-in, nodes explicitly on a CPU on the host, and map GPU-only ops.

    With ``copies=True`` (measurement copies only) swap nodes become a copying op: a swap-out (a host
    node reading a stand-in tensor) copies on the host, a swap-in (a host node feeding stand-in
    consumers) copies onto the stand-in, as the host-to-device transfer of a real GPU would. On CPU
    an Identity between the logical devices shares its buffer, so without copies nothing is saved.
    """
    meta = type(meta_graph)()
    meta.CopyFrom(meta_graph)
    nodes = meta.graph_def.node
    roles: dict[str, str] = {}
    for node in nodes:
        if node.op in GPU_COPY_OPS:
            roles[node.name] = GPU_COPY_OPS[node.op]
        node.device = HOST if _on_host(node.device) else GPU_STANDIN
    device = {node.name: node.device for node in nodes}
    consumers: dict[str, list[str]] = {}
    for node in nodes:
        for text in node.input:
            name, _, control = parse_input(text)
            if not control:
                consumers.setdefault(name, []).append(node.name)
    for node in nodes:
        if node.op != "Identity" or node.device != HOST or node.name in roles:
            continue
        if _dtype_name(node) in ("string", "resource", "variant"):
            continue  # not a tensor anyone swaps: a SavedModel's save/Identity of the checkpoint path
        data = [parse_input(t)[0] for t in node.input if not t.startswith("^")]
        if data and device.get(data[0]) == GPU_STANDIN:
            roles[node.name] = "out"
        elif any(device.get(c) == GPU_STANDIN for c in consumers.get(node.name, ())):
            roles[node.name] = "in"
    mapped, copied, notes = [], [], []
    for node in nodes:
        role = roles.get(node.name)
        if node.op in GPU_COPY_OPS:
            _retype(node, "Identity")
            mapped.append(node.name)
        if not copies or role is None:
            continue
        dtype = _dtype_name(node)
        if dtype not in _COPYABLE:
            notes.append(f"{node.name}: {dtype or 'unknown'} tensors are not copied; measured as shared")
            continue
        _retype(node, COPY_OP)
        node.device = HOST if role == "out" else GPU_STANDIN
        copied.append(node.name)
    _check_cpu_kernels(meta.graph_def)
    return CpuGraph(meta, tuple(mapped), tuple(n for n, r in roles.items() if r == "out"),
                    tuple(n for n, r in roles.items() if r == "in"), tuple(copied), tuple(notes))


def _check_cpu_kernels(graph_def) -> None:
    """Refuse, with one line, graphs whose ops cannot run on this CPU build of TensorFlow."""
    tensorflow()
    from tensorflow.python.framework import kernels, op_def_registry

    functions = {f.signature.name for f in graph_def.library.function}
    seen: dict[str, str] = {}
    for node in graph_def.node:
        seen.setdefault(node.op, node.name)
    unregistered, no_kernel = [], []
    for op, example in sorted(seen.items()):
        if op in functions:
            continue
        if op_def_registry.get(op) is None:
            unregistered.append(f"{op} (e.g. {example})")
            continue
        devices = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
        if not devices & {"CPU", "DEFAULT"}:
            no_kernel.append(f"{op} (e.g. {example})")
    if unregistered:
        raise LmsError(f"cannot run the graph on CPU: op type {', '.join(unregistered)} is not registered in this "
                       "TensorFlow build; verify with the TensorFlow (and custom op libraries) that made the graph")
    if no_kernel:
        raise LmsError(f"cannot run the graph on CPU: no CPU kernel for {', '.join(no_kernel)}; "
                       "lms verify needs a graph that runs on CPU")


def session_config(optimize: bool = True):
    """Two logical CPUs, one inter-op and one intra-op thread, no soft placement."""
    tensorflow()
    from tensorflow.core.protobuf import config_pb2

    config = config_pb2.ConfigProto(device_count={"CPU": 2}, inter_op_parallelism_threads=1,
                                    intra_op_parallelism_threads=1, allow_soft_placement=False)
    if not optimize:
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


def _feed_value(name: str, shape, dtype, batch_size: int, step: int, bound: int | None = None):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{step}".encode()))
    dims = [batch_size if d is None else d for d in shape]
    if dtype.is_bool:
        return rng.integers(0, 2, size=dims).astype(bool)
    if dtype.is_integer:
        return rng.integers(0, bound or 2, size=dims).astype(dtype.as_numpy_dtype)
    return rng.standard_normal(size=dims).astype(dtype.as_numpy_dtype)


# Ops through which an integer feed reaches its reader unchanged in value.
_PASSING = frozenset({"Identity", "Reshape", "ExpandDims", "Squeeze", "StridedSlice", "Slice", "Cast", "Enter",
                      "Switch", "Merge", "Transpose", "ConcatV2", "Pack", "Tile", "Snapshot", "StopGradient"})


def _static(tensor) -> int | None:
    """A scalar tensor's value when it is a constant (a depth, a segment count, an axis)."""
    from tensorflow.python.framework import tensor_util

    try:
        value = tensor_util.constant_value(tensor)
    except Exception:  # noqa: BLE001 - no static value is all it can mean
        return None
    return int(value) if value is not None and np.ndim(value) == 0 else None


def _index_bound(op, port: int) -> int | None:
    """The exclusive upper bound on the values input ``port`` of ``op`` may hold, when it is an
    index into something of static size: a gather's indices, a sparse label, a one-hot index, a
    segment id."""
    inputs = op.inputs
    if op.type in ("GatherV2", "Gather") and port == 1:
        axis = _static(inputs[2]) if op.type == "GatherV2" else 0
        shape = inputs[0].shape
        if axis is not None and shape.rank is not None:
            return shape[axis]
    elif op.type == "ResourceGather" and port == 1:
        handle = inputs[0].op
        if handle.type == "VarHandleOp":
            dims = handle.get_attr("shape").dim
            return dims[op.get_attr("batch_dims")].size if dims else None
    elif op.type == "SparseSoftmaxCrossEntropyWithLogits" and port == 1:
        return inputs[0].shape[-1] if inputs[0].shape.rank else None
    elif op.type == "OneHot" and port == 0:
        return _static(inputs[1])
    elif op.type.startswith("UnsortedSegment") and port == 1:
        return _static(inputs[2])
    return None


def integer_bounds(placeholder) -> int | None:
    """The values an integer placeholder is fed: ``[0, bound)`` where ``bound`` is the smallest size
    it indexes (through ops that pass its values on), else None (fed 0 and 1). QA r47: every id
    was 0 or 1, so an embedding's sparse gradients were measured at two rows instead of the
    batch's, with no word."""
    bounds, seen, todo = [], set(), [placeholder.outputs[0]]
    while todo:
        tensor = todo.pop()
        for consumer in tensor.consumers():
            for port, t in enumerate(consumer.inputs):
                if t is not tensor or (consumer.name, port) in seen:
                    continue
                seen.add((consumer.name, port))
                bound = _index_bound(consumer, port)
                if bound is not None and bound > 0:
                    bounds.append(int(bound))
                elif consumer.type in _PASSING:
                    todo.extend(consumer.outputs[:1])
    return min(bounds) if bounds else None


def rewrite_batch_size(original, rewritten, batch_size: int | None) -> int | None:
    """The batch size to feed both graphs of a proof. A rewrite made with ``--batch-size N`` has
    its placeholders' unknown dimensions set to N; fed another size, the original would compute
    something else and a proof would report a difference that is not there. Without a
    ``batch_size``, that N (None when the rewrite set none); a different ``batch_size`` is an
    InputError. ``original`` and ``rewritten`` are MetaGraphDefs."""
    from lmscli.graph.shapes import batch_sizes_set

    fixed = batch_sizes_set(original.graph_def, rewritten.graph_def)
    if len(fixed) > 1:
        raise InputError(f"the rewrite sets the original's unknown dimensions to several sizes ({sorted(fixed)}); "
                         "give --batch-size")
    if not fixed:
        return batch_size
    (size,) = fixed
    if batch_size is not None and batch_size != size:
        raise InputError(f"the rewrite was made for batch size {size} (its placeholders say so), not "
                         f"{batch_size}: give --batch-size {size}, or leave it out")
    return size


def feeds(placeholders, batch_size: int, step: int, feed_values: dict | None = None) -> dict:
    """The same random values for a placeholder name and step in every graph (an integer one in
    the range it indexes, :func:`integer_bounds`); a placeholder named in ``feed_values`` (the
    user's ``--feed NAME=VALUE``) is filled with that value instead (:func:`lmscli.graph.fed.filled`)."""
    from lmscli.graph.fed import filled

    feed_values = feed_values or {}
    check_feeds(placeholders, feed_values)
    feed = {}
    for op in placeholders:
        t = op.outputs[0]
        if op.name in feed_values:
            feed[t] = filled(op.name, feed_values[op.name], t.shape, t.dtype, batch_size)
            continue
        if op.type != "Placeholder" or t.shape.rank is None or not t.dtype.is_numpy_compatible or t.dtype.name == "string":
            continue  # (a SavedModel's checkpoint path, for one, is no input of the step)
        bound = integer_bounds(op) if t.dtype.is_integer else None
        feed[t] = _feed_value(op.name, t.shape.as_list(), t.dtype, batch_size, step, bound)
    return feed


def check_feeds(placeholders, feed_values: dict | None) -> None:
    """``feed_values`` (``--feed``) name placeholders of the imported graph, with values their types
    hold; else an input error (before any run; no value is made)."""
    from lmscli.graph.fed import check

    check(feed_values or {}, {op.name: op.outputs[0].dtype for op in placeholders})


def unbounded_integers(placeholders, given=()) -> list[str]:
    """The integer placeholders fed 0 and 1 for want of a size they index (a sequence length, a
    count) and not ``given`` a value (``--feed``): a loop they bound runs at most once, and a
    figure measured with them is that step's."""
    return sorted(op.name for op in placeholders if op.type == "Placeholder" and op.outputs[0].dtype.is_integer
                  and op.name not in given
                  and op.outputs[0].shape.rank is not None and integer_bounds(op) is None)


@dataclass
class Imported:
    """A placed graph imported into a fresh ``tf.Graph`` with graph seed 0."""

    graph: object
    init: object
    variables: list  # tf.Variables, and value tensors of the variables no collection names
    targets: list
    loss: object
    placeholders: list  # Placeholder ops, and PlaceholderWithDefault ops (fed only a --feed value)
    init_feed: dict = None  # values for the variables without an initializer (fed to ``init``)
    variable_names: tuple = ()  # per entry of ``variables``: the variable's name ("w:0")


INIT_SCOPE = "lms_verify"  # the ops import_graph adds to give such variables values


def _bare_variables(tf, graph, known) -> list:
    """Resource variables (``VarHandleOp``) no variable collection names, e.g. a TensorFlow 2
    SavedModel's, whose values live in its checkpoint: ``(name, assign op, value placeholder,
    value tensor)``, each op on the variable's device."""
    out = []
    for op in graph.get_operations():
        if op.type != "VarHandleOp" or op.name in known:
            continue
        shape = tf.TensorShape(op.get_attr("shape"))
        dtype = tf.as_dtype(op.get_attr("dtype"))
        if not shape.is_fully_defined() or not dtype.is_numpy_compatible:
            continue
        with graph.device(op.device), graph.name_scope(f"{INIT_SCOPE}/{op.name}/"):
            value = tf.compat.v1.placeholder(dtype, shape, name="value")
            assign = tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value)
            read = tf.raw_ops.ReadVariableOp(resource=op.outputs[0], dtype=dtype, name="read")
        out.append((op.name + ":0", assign, value, read))
    return out


def start_value(name: str, shape, dtype) -> np.ndarray:
    """The same values for a variable name in every graph: uniform in +-1/sqrt(fan-in) (positive
    for a batch norm's variance), zero for integers."""
    if dtype.is_integer or dtype.is_bool:
        return np.zeros(shape, dtype=dtype.as_numpy_dtype)
    rng = np.random.default_rng(zlib.crc32(f"variable/{name}".encode()))
    fan_in = int(np.prod(shape[:-1])) if len(shape) >= 2 else 100
    values = rng.uniform(-1.0, 1.0, size=shape) / np.sqrt(max(fan_in, 1))
    if "variance" in name.lower():
        values = np.abs(values) + 1e-3
    return values.astype(dtype.as_numpy_dtype)


def seeded(meta):
    """``meta``, or a copy of it in which each random op the graph left unseeded (``seed`` and
    ``seed2`` both 0: TensorFlow seeds it anew in every session) has seeds made from its name.
    The original and its rewrite then draw the same numbers: without it an unseeded graph's
    initial weights differed from run to run, and `lms verify` found a graph different from
    itself (QA r47)."""
    def unseeded(node) -> bool:  # (not a function's attribute placeholder, "$seed")
        return all(key in node.attr and node.attr[key].WhichOneof("value") in ("i", None) and node.attr[key].i == 0
                   for key in ("seed", "seed2"))

    def nodes(m):
        yield from m.graph_def.node
        for function in m.graph_def.library.function:
            yield from function.node_def

    if not any(unseeded(node) for node in nodes(meta)):
        return meta
    out = type(meta)()
    out.CopyFrom(meta)
    for node in nodes(out):
        if unseeded(node):
            digest = zlib.crc32(f"seed/{node.name}".encode())
            node.attr["seed"].i, node.attr["seed2"].i = 1 + digest % 65521, 1 + digest // 65521 % 65521
    return out


def import_graph(meta, fetches, loss: str | None = None) -> Imported:
    tf = tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        tf.compat.v1.train.import_meta_graph(seeded(meta), clear_devices=False)
        variables = sorted(tf.compat.v1.global_variables(), key=lambda v: v.name)
        known = {v.op.name for v in variables} | {getattr(v, "handle", v).op.name for v in variables}
        bare = _bare_variables(tf, graph, known)
        init = tf.group(tf.compat.v1.global_variables_initializer(), *(assign for _, assign, _, _ in bare))
        init_feed = {value: start_value(name, value.shape.as_list(), value.dtype) for name, _, value, _ in bare}
        names = tuple(v.name for v in variables) + tuple(name for name, _, _, _ in bare)
        variables = variables + [read for _, _, _, read in bare]
        try:
            targets = [graph.get_operation_by_name(f) for f in fetches]
        except (KeyError, ValueError) as exc:
            raise InputError(f"a fetch is not in the graph: {exc}") from None
        loss_tensor = None
        if loss:
            try:
                loss_tensor = graph.get_tensor_by_name(loss)
            except (KeyError, ValueError):
                loss_tensor = None
        # (a PlaceholderWithDefault is fed only a value the user gives: --feed)
        placeholders = [op for op in graph.get_operations()
                        if op.type in PLACEHOLDER_OPS and not op.name.startswith(INIT_SCOPE + "/")]
        step = targets + [t.op for t in variables] + ([loss_tensor.op] if loss_tensor is not None else [])
        _one_at_a_time(init, step)
    return Imported(graph, init, variables, targets, loss_tensor, placeholders, init_feed, names)


def _one_at_a_time(init, step) -> None:
    """Make the initialisation run its ops one after another in one fixed order (a topological
    order, ties by name), by control edges between consecutive ops that only the initialisation
    runs. The allocator then lays the variables out the same way in every run: the executor's
    own order among them varies, and with it the holes the step's tensors must fit into (on the
    stand-in, plans near their limit fitted in some runs and not in others for that alone).

    Before::  init <- a_init, b_init  (either first)
    After::   init <- a_init, b_init; b_init <- ^a_init"""
    shared = ancestors(step)
    # (Placeholders are fed: a fed node does not run, and an edge to or from it would be lost.)
    own = [op for op in ancestors([init]) if op not in shared and op.type != "Placeholder"]
    mine = set(own)
    waiting = {op: sum(1 for dep in _deps(op) if dep in mine) for op in own}
    ready = sorted(op.name for op, n in waiting.items() if n == 0)  # a sorted list is a heap
    by_name = {op.name: op for op in own}
    users: dict = {}
    for op in own:
        for dep in _deps(op):
            if dep in mine:
                users.setdefault(dep, []).append(op)
    previous = None
    while ready:
        op = by_name[heapq.heappop(ready)]
        if previous is not None and previous not in op.control_inputs:
            op._add_control_input(previous)
        previous = op
        for user in users.get(op, ()):
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user.name)


def _deps(op):
    return [t.op for t in op.inputs] + list(op.control_inputs)


def ancestors(ops) -> set:
    """The ops ``ops`` need (themselves included), through data and control inputs."""
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(_deps(op))
    return seen


BOILERPLATE = ("Graph execution error", "Detected at node", "Node:", "From /job:", "[[", "Original stack trace", "File ")


def error_line(exc: Exception) -> str:
    """TensorFlow's own reason from a (remote) error's text, with the op it names."""
    text = str(exc)
    lines = [re.sub(r"^[A-Z_]+: ", "", line.strip()) for line in text.splitlines()]  # INVALID_ARGUMENT: ...
    reason = next((line for line in lines if any(c.isalnum() for c in line) and not line.startswith(BOILERPLATE)),
                  type(exc).__name__)
    node = oom_node(text)
    return f"{reason} (op {node})" if node and node not in reason else reason


def oom_node(text: str) -> str | None:
    match = re.search(r"requested by op (\S+)", text) or re.search(r"\{\{node ([^}]+)\}\}", text)
    return match.group(1) if match else None


def failed_run(exc: Exception) -> LmsError:
    return LmsError(f"the graph failed to run on CPU: {error_line(exc)}")


STEP_TIMEOUT_S = 600  # a step of `lms verify` (on CPU, in this process) that runs longer is stopped


def run_steps(meta_graph, fetches, steps: int = 1, batch_size: int = 2, loss: str | None = "loss:0",
              copies: bool = False, optimize: bool = True, feed_values: dict | None = None) -> StepRun:
    """Import ``meta_graph`` and run ``steps`` training steps of ``fetches`` on CPU.

    ``copies=True`` runs the measurement copy (swap nodes as real copies), to check it computes
    the same as the graph; ``optimize=False`` runs it as written (Grappler off); ``feed_values``:
    the user's values for placeholders (:func:`feeds`)."""
    tf = tensorflow()
    # (a step that waits for itself would hang the command: QA, a graph whose swap-in waited for the loop it fed)
    options = tf.compat.v1.RunOptions(timeout_in_ms=STEP_TIMEOUT_S * 1000)
    try:
        meta = place_on_cpu(meta_graph, copies=copies).meta_graph
        g = import_graph(meta, fetches, loss)
        with tf.compat.v1.Session(graph=g.graph, config=session_config(optimize)) as sess:
            sess.run(g.init, feed_dict=g.init_feed, options=options)
            losses, outputs = [], []
            # A graph without variables (a frozen inference graph) changes no state: what it
            # computes is what its fetched ops output, so those are compared.
            produced = [] if g.variables else [t for op in g.targets for t in op.outputs if t.dtype.is_numpy_compatible]
            for step in range(steps):
                fetch = {"train": g.targets, "outputs": produced}
                if g.loss is not None:
                    fetch["loss"] = g.loss
                out = sess.run(fetch, feed_dict=feeds(g.placeholders, batch_size, step, feed_values), options=options)
                if g.loss is not None:
                    losses.append(np.asarray(out["loss"]))
                if produced:
                    outputs.append({t.name: np.asarray(v) for t, v in zip(produced, out["outputs"])})
            values = dict(zip(g.variable_names, sess.run(g.variables, options=options)))
        placements = {op.name: op.device for op in g.graph.get_operations() if is_lms_node(op.name)}
    except LmsError:
        raise
    except tf.errors.DeadlineExceededError:
        raise LmsError(f"a training step did not end within {STEP_TIMEOUT_S} s on CPU: the graph may wait for "
                       "itself (an op waiting for a while loop that waits for it)") from None
    except Exception as exc:
        raise failed_run(exc) from None
    return StepRun(tuple(losses), values, placements, tuple(outputs))


def same_variables(original, rewritten) -> None:
    """A rewrite trains the original's variables, no more, no fewer: else the two graphs are not
    an original and its rewrite, and comparing their results would say nothing (QA r45: two
    unrelated nets were "different results", exit 4)."""
    from lmscli.graph.graphview import VARIABLE_OPS

    def variables(model) -> set:
        return {node.name for node in model.graph_def.node if node.op in VARIABLE_OPS}

    def only(names: list, where: str) -> str:
        return f"{len(names)} only in {where} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"

    a, b = variables(original), variables(rewritten)
    if a != b:
        where = "; ".join(only(names, side) for names, side in ((sorted(a - b), "the original"),
                                                                (sorted(b - a), "the rewritten graph")) if names)
        raise InputError(f"{rewritten.path} is not a rewrite of {original.path}: their variables differ ({where}); "
                         "give an original and the graph lms rewrote from it")


@dataclass(frozen=True)
class Difference:
    """What differs first between two runs."""

    loss_step: int | None  # first step whose loss differs
    variable: str | None  # first variable (by name) whose final value differs
    max_abs_diff: float | None  # of that variable
    message: str


def compare(a: StepRun, b: StepRun) -> Difference | None:
    """None when both runs are bit-identical; else the first differing loss and variable."""
    if len(a.losses) != len(b.losses):
        return Difference(None, None, None, "different number of losses")
    if sorted(a.variables) != sorted(b.variables):
        only = sorted(set(a.variables) ^ set(b.variables))
        return Difference(None, None, None, f"different variables ({', '.join(only[:3])})")
    loss_step = next((i for i, (x, y) in enumerate(zip(a.losses, b.losses)) if x.tobytes() != y.tobytes()), None)
    for step, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        for name in sorted(x):
            if name not in y or x[name].shape != y[name].shape or x[name].tobytes() != y[name].tobytes():
                return Difference(None, None, None, f"output {name} at step {step}")
    variable = max_diff = scale = None
    for name in sorted(a.variables):
        x, y = a.variables[name], b.variables[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            variable = name
            break
        if x.tobytes() != y.tobytes():
            variable = name
            if x.dtype.kind in "fciub":
                max_diff = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                scale = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0
            break
    if loss_step is None and variable is None:
        return None
    parts = []
    if loss_step is not None:
        parts.append(f"loss at step {loss_step}: {a.losses[loss_step]!r} != {b.losses[loss_step]!r}")
    if variable is not None:
        text = f"variable {variable}"
        if max_diff is not None:
            # (beside the variable's own scale: last-bit noise and a different result read alike otherwise; QA round 30)
            text += f" (max |difference| {max_diff:.3g}, largest |value| {scale:.3g})"
        parts.append(text)
    return Difference(loss_step, variable, max_diff, "; ".join(parts))


def first_difference(a: StepRun, b: StepRun) -> str | None:
    """None when both runs are bit-identical; else what differs first."""
    diff = compare(a, b)
    return None if diff is None else diff.message


def step_fetches(meta_graph, fetches, loss: str | None = None) -> tuple[str, ...]:
    """The ops a step on the stand-in runs: ``fetches``, and the op of the loss it fetches too
    (``loss`` or :func:`default_loss`, to compare results), which a model of that step must
    schedule as well. Fetching only a train op, Grappler prunes the loss's own forward ops; a 3D
    U-Net's per-voxel loss holds three 1 MiB tensors through the backward pass's start, and its
    need was predicted 4 MiB under the stand-in's 105."""
    from lmscli.graph.graphview import parse_input

    loss = loss or default_loss(meta_graph)
    node = parse_input(loss)[0] if loss else None
    if not node or node in fetches or node not in {n.name for n in meta_graph.graph_def.node}:
        return tuple(fetches)
    return tuple(fetches) + (node,)


def default_loss(meta_graph) -> str | None:
    """``loss:0`` if the graph has it, else the first tensor of the ``losses`` collection, else a
    signature's ``loss`` output."""
    names = {node.name for node in meta_graph.graph_def.node}
    if "loss" in names:
        return "loss:0"
    collection = meta_graph.collection_def.get("losses") if "losses" in meta_graph.collection_def else None
    if collection is not None and collection.node_list.value:
        return collection.node_list.value[0]
    for key in sorted(meta_graph.signature_def):  # a TensorFlow 2 training signature's "loss" output
        outputs = meta_graph.signature_def[key].outputs
        if "loss" in outputs and outputs["loss"].name.partition(":")[0] in names:
            return outputs["loss"].name
    return None
