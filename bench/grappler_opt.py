"""Grappler's own memory optimizer as a contender, and the one judge every contender faces.

The optimizer runs through ``tf_optimizer.OptimizeGraph`` against a virtual cluster (one virtual
GPU whose memory is the budget, and a host CPU), with only the memory optimizer enabled and
``min_graph_nodes = -1``. Its swap pairs are ``_CopyFromGpuToHost``/``_CopyFromHostToGpu`` nodes,
both placed on the GPU device; the first one's output lives in host memory (the kernel allocates
it ``on_host``). Those kernels do not exist in the CPU build of TensorFlow, so to judge its output
the pair becomes two Identity nodes: the swap-out on the host (where its output lives), the
swap-in on the GPU, exactly how the judge sees an lms swap-out (an Identity on the host).

The judge is Grappler's VirtualCluster estimate (``lmscli.grappler.estimate_peak``) of the graph a
contender produced, plus the bytes that stay resident (variables and constants), which Grappler
does not count. ``lms`` plans are judged by ``api.tune``'s own Grappler check, which is the same
estimate of the rewritten graph plus the same resident bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common import ROOT  # noqa: F401  (puts the project on sys.path)

GPU = "/job:localhost/replica:0/task:0/device:GPU:0"
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"
LEVELS = ("SWAPPING_HEURISTICS", "HEURISTICS")
SWAP_OUT, SWAP_IN = "_CopyFromGpuToHost", "_CopyFromHostToGpu"

# Every other optimizer of the meta optimizer, switched off so only the memory optimizer runs.
_OTHER_OPTIMIZERS = (
    "layout_optimizer", "constant_folding", "shape_optimization", "remapping", "common_subgraph_elimination",
    "arithmetic_optimization", "dependency_optimization", "loop_optimization", "function_optimization",
    "debug_stripper", "scoped_allocator_optimization", "pin_to_host_optimization", "implementation_selector",
    "auto_mixed_precision", "auto_mixed_precision_mkl", "auto_mixed_precision_onednn_bfloat16",
    "auto_mixed_precision_cpu",
)


def virtual_cluster(gpu_mem: int):
    """One virtual GPU of ``gpu_mem`` bytes and a host CPU, with the device properties
    lmscli.grappler uses for its estimates (a V100-like GPU)."""
    from tensorflow.core.protobuf import device_properties_pb2
    from tensorflow.python.grappler import cluster as gcluster

    gpu = device_properties_pb2.DeviceProperties(
        type="GPU", vendor="NVIDIA", model="virtual", frequency=1530, num_cores=80,
        memory_size=int(gpu_mem), bandwidth=900_000_000,
        environment={"architecture": "7.0", "cuda": "11000", "cudnn": "8000"},
    )
    cpu = device_properties_pb2.DeviceProperties(
        type="CPU", frequency=2000, num_cores=2, memory_size=1 << 40, bandwidth=50_000_000,
    )
    return gcluster.Cluster(
        disable_detailed_stats=False, disable_timeline=False,
        devices=[device_properties_pb2.NamedDevice(name=GPU, properties=gpu),
                 device_properties_pb2.NamedDevice(name=CPU, properties=cpu)],
    )


def _config(level: str):
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    rc = rewriter_config_pb2.RewriterConfig
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    for name in _OTHER_OPTIMIZERS:
        if name in rc.DESCRIPTOR.fields_by_name:
            setattr(rewrite, name, rc.OFF)
    rewrite.disable_model_pruning = True
    rewrite.memory_optimization = getattr(rc, level)
    rewrite.min_graph_nodes = -1
    rewrite.meta_optimizer_iterations = rc.ONE
    return config


def _placed(meta_graph, fetches):
    """Unplaced nodes on the virtual GPU, nodes on a CPU on the host, and a train_op collection."""
    meta = type(meta_graph)()
    meta.CopyFrom(meta_graph)
    for node in meta.graph_def.node:
        node.device = CPU if "cpu" in node.device.lower() else GPU
    meta.collection_def["train_op"].Clear()
    meta.collection_def["train_op"].node_list.value.extend(fetches)
    return meta


@dataclass(frozen=True)
class GrapplerRun:
    level: str
    graph_def: object  # the optimized GraphDef, swap kernels as Grappler wrote them
    seconds: float  # wall time of the optimizer (cluster construction included)
    swap_pairs: int
    recomputed: int  # nodes added other than swap pairs (recomputation, its triggers)
    error: str | None = None


def optimize(meta_graph, fetches, gpu_mem: int, level: str) -> GrapplerRun:
    """Run Grappler's memory optimizer at ``level`` against a virtual GPU of ``gpu_mem`` bytes."""
    from tensorflow.python.grappler import tf_optimizer

    placed = _placed(meta_graph, fetches)
    before = {node.name for node in placed.graph_def.node}
    t = time.perf_counter()
    try:
        out = tf_optimizer.OptimizeGraph(_config(level), placed, cluster=virtual_cluster(gpu_mem))
    except Exception as exc:  # reported on the row, never fatal
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return GrapplerRun(level, None, time.perf_counter() - t, 0, 0, text[:200])
    seconds = time.perf_counter() - t
    added = [node for node in out.node if node.name not in before]
    pairs = sum(1 for node in added if node.op == SWAP_OUT)
    recomputed = sum(1 for node in added if node.op not in (SWAP_OUT, SWAP_IN))
    return GrapplerRun(level, out, seconds, pairs, recomputed)


def judgeable(graph_def, swap_out_on_host: bool = True):
    """A copy with the swap kernels as Identity nodes (CPU builds have no such kernels); the
    swap-out goes on the host, where its output lives, unless ``swap_out_on_host`` is False."""
    copy = type(graph_def)()
    copy.CopyFrom(graph_def)
    for node in copy.node:
        if node.op in (SWAP_OUT, SWAP_IN):
            if node.op == SWAP_OUT and swap_out_on_host:
                node.device = CPU
            node.op = "Identity"
            for key in list(node.attr):
                if key != "T":
                    del node.attr[key]
    return copy


def judge_meta(meta_graph, fetches, resident_bytes: int) -> int:
    """The judge: Grappler's peak of the graph on the virtual GPU plus resident bytes."""
    from lmscli import grappler

    return grappler.estimate_peak(meta_graph, fetches).gpu_peak_bytes + resident_bytes


def judge_graph_def(model_meta, graph_def, fetches, resident_bytes: int) -> int:
    from lmscli import api

    return judge_meta(api.with_graph_def(model_meta, graph_def), fetches, resident_bytes)


def _node(name: str) -> str:
    return name.lstrip("^").split(":")[0]


def _tensor(name: str) -> str:
    return name if ":" in name else name + ":0"


def swap_plan(original, optimized, template: dict) -> dict:
    """Grappler's swap pairs as an lms plan (JSON form), so that our simulator can replay them
    for a predicted step time. One swap per tensor; each Grappler pair is one swap-in group whose
    trigger is the pair's control input (the nearest original ancestor for a node Grappler
    added), and ops with a control edge from the swap-out wait for it. Consumers Grappler added
    (recomputation) are left out: the replay covers the swaps only."""
    known = {node.name for node in original.node}
    nodes = {node.name: node for node in optimized.node}
    readers: dict[str, list[str]] = {}
    waiters: dict[str, list[str]] = {}
    for node in optimized.node:
        for inp in node.input:
            if inp.startswith("^"):
                waiters.setdefault(_node(inp), []).append(node.name)
            else:
                readers.setdefault(_tensor(inp), []).append(node.name)

    def original_ancestor(name: str) -> str | None:
        seen, frontier = set(), [name]
        while frontier:
            nxt = []
            for cur in frontier:
                if cur in known:
                    return cur
                if cur in seen or cur not in nodes:
                    continue
                seen.add(cur)
                nxt.extend(sorted(_node(i) for i in nodes[cur].input))
            frontier = nxt
        return None

    swaps: dict[str, dict] = {}
    for node in sorted(optimized.node, key=lambda n: n.name):
        if node.op != SWAP_IN:
            continue
        data = [i for i in node.input if not i.startswith("^")]
        if not data or _node(data[0]) not in nodes:
            continue
        out_node = nodes[_node(data[0])]
        src = [i for i in out_node.input if not i.startswith("^")]
        if not src:
            continue
        tensor = _tensor(src[0])
        if _node(tensor) not in known:
            continue
        consumers = sorted(c for c in readers.get(_tensor(node.name), []) if c in known)
        if not consumers:
            continue
        controls = [_node(i) for i in node.input if i.startswith("^")]
        trigger = None
        for c in controls:
            trigger = original_ancestor(c)
            if trigger:
                break
        entry = swaps.setdefault(tensor, {"tensor": tensor, "bytes": 0, "near": [], "swap_ins": [],
                                          "sync_out": False, "waiters": []})
        entry["swap_ins"].append({"consumers": consumers, "trigger": trigger or _node(tensor)})
        entry["waiters"].extend(w for w in waiters.get(out_node.name, []) if w in known)
    for tensor, entry in swaps.items():
        entry["near"] = sorted(c for c in readers.get(tensor, []) if c in known)
        entry["waiters"] = sorted(set(entry["waiters"]))
    plan = dict(template)
    plan.update(strategy="grappler", parameters={}, swaps=[swaps[t] for t in sorted(swaps)], serialize=[],
                predicted={}, grappler={})
    return plan
