"""TensorFlow's own memory estimate: Grappler's VirtualCluster on a virtual GPU.

An independent judge for our simulator and our plans. Nodes with no device are placed on the
virtual GPU; nodes explicitly on a CPU (our swap-outs) stay on the host. Grappler does not count
variable storage, so callers add resident bytes themselves.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from lmscli import forked
from lmscli.errors import LmsError
from lmscli.tfimport import tensorflow
from lmscli.timing import timed

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


@dataclass(frozen=True)
class GrapplerEstimate:
    gpu_peak_bytes: int  # tensors only (no variable storage); the largest over the GPUs
    host_peak_bytes: int
    live_at_peak: tuple[tuple[str, int, int], ...]  # (node, output, bytes), largest first
    gpu_peaks: dict = field(default_factory=dict)  # GPU (graphview.gpu_key) -> tensor peak bytes


def _cluster(gpu_mem: int, num_gpus: int = 1):
    tensorflow()
    from tensorflow.core.protobuf import device_properties_pb2
    from tensorflow.python.grappler import cluster as gcluster

    gpu = device_properties_pb2.DeviceProperties(
        type="GPU", vendor="NVIDIA", model="virtual", frequency=1530, num_cores=80,
        memory_size=int(gpu_mem), bandwidth=900_000_000,  # KB/s l1_cache_size=128 * 1024, l2_cache_size=6 << 20,
        environment={"architecture": "7.0", "cuda": "11000", "cudnn": "8000"},
    )
    cpu = device_properties_pb2.DeviceProperties(
        type="CPU", frequency=2000, num_cores=2, memory_size=1 << 40, bandwidth=50_000_000,
    )
    gpus = [device_properties_pb2.NamedDevice(name=_virtual_gpu(k), properties=gpu) for k in range(num_gpus)]
    return gcluster.Cluster(
        disable_detailed_stats=False, disable_timeline=False,
        devices=gpus + [device_properties_pb2.NamedDevice(name=CPU, properties=cpu)],
    )


def _virtual_gpu(k: int) -> str:
    return GPU[: -1] + str(k)


def placed_metagraph(meta_graph, fetches):
    """A copy of ``meta_graph`` placed on the virtual cluster, with a ``train_op`` collection, and
    the GPUs it uses: ``(meta, gpus)``. Each GPU the graph names (unplaced nodes are on the first
    one, as TensorFlow's placer does) becomes a virtual GPU; ``gpus[k]`` is virtual GPU ``k``'s
    name in the graph (:func:`lmscli.graph.graphview.gpu_key`); nodes on a CPU go to the host."""
    tensorflow()
    from tensorflow.core.protobuf import meta_graph_pb2

    from lmscli.graph.graphview import gpu_key

    meta = meta_graph_pb2.MetaGraphDef()
    meta.CopyFrom(meta_graph)
    keys = [gpu_key(node.device) for node in meta.graph_def.node]
    gpus = sorted({k for k in keys if k is not None})
    virtual = {key: _virtual_gpu(k) for k, key in enumerate(gpus)}
    for node, key in zip(meta.graph_def.node, keys):
        node.device = CPU if key is None else virtual[key]
    _only(meta, fetches)
    return meta, tuple(gpus)


def _only(meta, fetches) -> None:
    """Grappler's item fetches ``fetches`` alone: its ``train_op`` collection, and no saver (a
    SavedModel's save and restore ops would be fetched too, and be missing from a pruned graph)."""
    meta.collection_def["train_op"].Clear()
    meta.collection_def["train_op"].node_list.value.extend(fetches)
    meta.ClearField("saver_def")


@timed("Grappler's estimate")
def estimate_peak(meta_graph, fetches, gpu_mem: int = 1 << 50) -> GrapplerEstimate:
    """Grappler's peak memory per device for one step fetching ``fetches``."""
    from tensorflow.python.grappler import item as gitem

    meta, gpus = placed_metagraph(meta_graph, fetches)
    try:
        item = gitem.Item(meta)
        peaks = _cluster(gpu_mem, max(len(gpus), 1)).DeterminePeakMemoryUsage(item)
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LmsError(f"Grappler could not estimate the graph's memory: {text}") from None
    names = {_virtual_gpu(k): key for k, key in enumerate(gpus)}
    gpu_peaks: dict[str, int] = {}
    host_peak = 0
    live = ()
    for device in sorted(peaks):
        peak, tensors = peaks[device]
        if device in names:
            gpu_peaks[names[device]] = int(peak)
            if int(peak) >= max(gpu_peaks.values()):
                live = tuple(sorted(((t[0], int(t[1]), int(t[2])) for t in tensors), key=lambda x: (-x[2], x[0], x[1])))
        else:
            host_peak = max(host_peak, int(peak))
    return GrapplerEstimate(max(gpu_peaks.values(), default=0), host_peak, live, gpu_peaks)


@dataclass(frozen=True)
class Trace:
    """Grappler's virtual-scheduler run: execution order and per-op time in microseconds."""

    order: tuple[str, ...]
    micros: dict
    on_host: frozenset = frozenset()  # ops Grappler's placer put on the CPU (no GPU kernel)
    unmatched_first: bool = False  # ops missing from ``order`` run as soon as they are ready (an
    # order observed on the optimized graph lacks the nodes Grappler removed: cheap forwarding ops)
    shapes: dict = field(default_factory=dict)  # (node, output) -> dims, where Grappler's inference knows them all

    def observed(self, order, micros: dict | None = None) -> "Trace":
        """An execution order observed in a real run, with the op times observed there (ops it did
        not show keep this trace's times)."""
        return Trace(tuple(order), {**self.micros, **(micros or {})}, self.on_host, True, self.shapes)


def _step_stats(meta_graph, fetches, gpu_mem: int = 1 << 50):
    """One run of Grappler's virtual scheduler on a virtual GPU: its StepStats."""
    from tensorflow.python.grappler import item as gitem

    meta, gpus = placed_metagraph(meta_graph, fetches)
    try:
        _perfs, _run_time, step_stats = _cluster(gpu_mem, max(len(gpus), 1)).MeasureCosts(gitem.Item(meta))
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LmsError(f"Grappler could not schedule the graph: {text}") from None
    return step_stats


@timed("Grappler's scheduler")
def trace(meta_graph, fetches, gpu_mem: int = 1 << 50) -> Trace:
    """Run Grappler's virtual scheduler (analytical cost model, first-ready order) on a virtual GPU."""
    step_stats = _step_stats(meta_graph, fetches, gpu_mem)
    rows = []
    shapes = {}
    for dev in step_stats.dev_stats:
        for seq, ns in enumerate(dev.node_stats):
            rows.append((ns.all_start_micros, "GPU" not in dev.device.upper(), seq, ns.node_name,
                         ns.op_end_rel_micros))
            for out in ns.output:
                shape = out.tensor_description.shape
                if not shape.unknown_rank and all(d.size >= 0 for d in shape.dim):
                    shapes[(ns.node_name, out.slot)] = tuple(d.size for d in shape.dim)
    rows.sort()
    return Trace(tuple(r[3] for r in rows), {r[3]: int(r[4]) for r in rows}, frozenset(r[3] for r in rows if r[1]),
                 shapes=shapes)


def tensor_sizes(meta_graph, fetches) -> dict:
    """Bytes Grappler's own shape inference gives each output: ``(node, output) -> bytes``."""
    step_stats = _step_stats(meta_graph, fetches)
    return {(ns.node_name, o.slot): int(o.tensor_description.allocation_description.allocated_bytes)
            for dev in step_stats.dev_stats for ns in dev.node_stats for o in ns.output}


CALL_OPS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase", "PartitionedCall",
                      "StatefulPartitionedCall"})


def call_ops(functions) -> frozenset:
    """Op types that call a function: the functional control-flow and call ops, and every function
    of ``functions`` (a graph's library), which a node may name as its op."""
    return CALL_OPS | {f.signature.name for f in functions}


@timed("Grappler's optimizations")
def optimize(meta_graph, fetches, remapping: bool = True):
    """The GraphDef that Grappler's default optimizations (as a Session runs them on this machine)
    make of ``meta_graph`` for a step fetching ``fetches``; None if Grappler refuses the graph.
    ``remapping=False``: without the remapper's fusions."""
    tensorflow()
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.grappler import tf_optimizer

    meta = type(meta_graph)()
    meta.CopyFrom(meta_graph)
    _only(meta, fetches)
    config = config_pb2.ConfigProto()
    if not remapping:
        config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    try:
        return tf_optimizer.OptimizeGraph(config, meta)
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def onednn() -> bool:
    """Whether oneDNN's optimizations are on in this process (``TF_ENABLE_ONEDNN_OPTS``, which
    TensorFlow reads once): with them, Grappler's remapper fuses a batch norm with its ReLU on a
    CPU (``_FusedBatchNormEx``); the stand-in's processes run without them."""
    tensorflow()
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip().lower() not in ("0", "false")


def dead_nodes(graph_def, optimized, fetches) -> frozenset:
    """Names of the nodes of ``graph_def`` whose results Grappler's default optimizations find
    unused and prune: neither in ``optimized`` nor feeding, through data edges, a node that is
    (or a fetch). ``tf.gradients`` makes many: the gradient of ``0.5 * x`` with respect to the
    constant, of a dropout mask, of the exponent of ``Pow`` - kept in the step as written only by
    the control edges of its ``tuple`` groups, which the dependency optimizer removes."""
    if optimized is None:
        return frozenset()
    from lmscli.graph.graphview import parse_input

    producers = {node.name: [parse_input(text)[0] for text in node.input if not text.startswith("^")]
                 for node in graph_def.node}
    reached = ({node.name for node in optimized.node} | set(fetches)) & producers.keys()
    stack = list(reached)
    while stack:
        for src in producers[stack.pop()]:
            if src not in reached and src in producers:
                reached.add(src)
                stack.append(src)
    ops = {node.name: node.op for node in graph_def.node}
    # Control-only ops (the NoOps of tf.gradients' tuple groups) hold no memory: they stay, as the
    # order constraints and swap-in triggers they are in the graph as written.
    return frozenset(name for name in producers.keys() - reached if ops[name] != "NoOp")


def fused_away(graph_def, optimized) -> frozenset:
    """Names of the nodes of ``graph_def`` that Grappler's default optimizations fold, fuse or
    prune away (absent from ``optimized``, the result of :func:`optimize`). A swap node attached
    to one of them would change what Grappler optimizes, and with it the last bits of the
    results, so lms leaves them alone."""
    if optimized is None:
        return frozenset()
    kept = {node.name for node in optimized.node}
    # Function calls (functional If/While, PartitionedCall, calls of library functions) are inlined,
    # not fused: their inputs are ordinary tensors, and the optimizer guard checks each plan anyway.
    calls = call_ops(graph_def.library.function)
    return frozenset(node.name for node in graph_def.node if node.name not in kept and node.op not in calls)


def folded_shapes(graph_def, fused: frozenset) -> frozenset:
    """Names of the shape reads (``Shape``, ``ShapeN``, ``Size``, ``Rank``) that Grappler's
    constant folding replaces with constants (the shapes are static): in a step they never run, so
    they hold the tensor they read no longer than its other readers. In the graph as written a
    v1 cond's gradient runs its ``ShapeN`` late in the backward pass, and every activation it
    reads looked held to then, as if no swap could free it (QA: no plan at twice the lower
    bound)::

        Relu (forward branch) --> ShapeN (gradient branch, folded) --> Conv2DBackpropInput
    """
    from lmscli.graph.graphview import SHAPE_OPS

    ops = {node.name: node.op for node in graph_def.node}
    return frozenset(name for name in fused if ops.get(name) in SHAPE_OPS)


def optimize_in_parallel(meta_graph, fetches) -> "forked.Pending":
    """Start :func:`optimize` beside the caller's own work, in a second process where it may fork
    (:mod:`lmscli.forked`); calling the result waits for the GraphDef (or None, as
    :func:`optimize`); ``cancel()`` gives up on it."""
    return forked.start("Grappler's optimizations (second process)", optimize, meta_graph, fetches)
