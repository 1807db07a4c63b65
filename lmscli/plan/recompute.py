"""Which tensors may be made again instead of kept or swapped, and from what (recipes).

A *recipe* for a tensor ``t`` is a short chain of ops of the step, ending with ``t``'s producer,
and the tensors the chain reads from outside it (its *sources*). Running clones of the chain just
before ``t``'s far consumers makes ``t`` again, bit for bit, when:

* every op of the chain is deterministic and stateless (:data:`RECOMPUTABLE_OPS`: element-wise
  math, activations, bias adds, batch norms, pooling, concatenations, pads, casts, transposes, and
  convolutions and matrix products (:data:`HEAVY_OPS`), whose kernels compute the same bits for
  the same shapes; never a random op, a variable update, a convolution's gradient or an op of a
  while loop or cond branch);
* every source still holds the value the original chain read: a constant, a variable that no op
  has updated yet when the clones run (the ops that update it are made to wait for the clones,
  which is possible only when they run after the trigger; checked per plan; a training batch
  norm's running mean and variance are no such read: its output 0 is made without them), or an activation
  whose buffer is still on the GPU when the clones run (checked per plan: not swapped, not made
  again itself, and read by an op after the clones, or kept for the clones beyond its last use
  where that holds at most half the bytes the recomputation frees: a transformer's attention
  probabilities made again from its queries and keys);
* Grappler's optimizations make the same kernels of the clones as of the originals: an edge the
  remapper fuses (batch norm into activation, ...) is never cut, the chain takes in its producer
  instead; nodes the optimizations remove are never read. The optimizer guard checks every plan.

Recipes are listed shortest first: the planner takes the first whose sources are all on the GPU
when the clones would run. A recipe costs its ops' time (a convolution's is its FLOPs at the
device's rate), so the planner makes a convolution's output again only where that is faster than
waiting for the link; its chain holds at most :data:`MAX_HEAVY` of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmscli.plan.candidates import fused_at
from lmscli.graph.graphview import CONSTANT_OPS, CONTROL_FLOW_OPS, VARIABLE_OPS, GraphView
from lmscli.graph.opdefs import StatefulOps
from lmscli.model.memmodel import FORWARDING_OPS, IN_PLACE_OPS, RESIDENT
from lmscli.model.schedule import Schedule

CHEAP_OPS = (IN_PLACE_OPS - {"AddN"}) | frozenset({
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "MaxPool", "AvgPool", "MaxPool3D", "AvgPool3D",
    "ConcatV2", "Pad", "PadV2", "MirrorPad", "Cast", "Transpose", "Softmax", "LogSoftmax",
})
# Forward convolutions and matrix products: real arithmetic, made again only where their time is
# less than the link's (the planner chooses by cost).
HEAVY_OPS = frozenset({
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
    "Einsum",  # (attention written with tf.einsum: a ViT's queries, keys, values and scores; QA r52)
})
RECOMPUTABLE_OPS = CHEAP_OPS | HEAVY_OPS
# A transformer's feed-forward activation made again from the layer norm before it is nine ops
# (the norm's last two, the matrix product, its bias add, the GELU's five), four rings out: with
# 6 ops and 3 rings it was swapped instead (at 35% of the peak on PCIe 3, +141% step time against
# +83%; 14 ops and 7 rings changed nothing). The longer recipes are not always better for a greedy
# planner (a DenseNet-style net's recompute-only plan at 50%: +20.9% against +15.3% with the short
# ones), so the planner makes its plans with the short recipes and with all (:func:`short`).
MAX_OPS = 10  # ops in one recipe
MAX_HEAVY = 2  # convolutions or matrix products in one recipe
SMALL_SOURCE = 64 << 10  # sources this small are kept for the clones whenever they are made
MAX_DEPTH = 5  # recipes per tensor: the producer, then up to four rings of producers around it
SHORT_OPS, SHORT_DEPTH = 6, 3  # the short recipes: at most this many ops, within this many rings


@dataclass(frozen=True)
class Recipe:
    positions: tuple[int, ...]  # schedule positions of the ops to clone, inputs first
    sources: tuple[int, ...]  # tensor ids read from outside the chain that must still be on the GPU
    cost: int  # microseconds the clones keep the GPU busy
    extra: int  # bytes of intermediate results held while they run
    writers: tuple[int, ...] = ()  # positions of the ops updating a variable the chain reads (they wait for it)
    small: tuple[int, ...] = ()  # small sources, kept for the clones wherever they are
    ring: int = 0  # rings of producers around the tensor's producer the chain reaches


def recipes(view: GraphView, schedule: Schedule, cands, fused: frozenset = frozenset()) -> dict[int, tuple[Recipe, ...]]:
    """Recipes for the candidate tensors ``cands`` (ids) whose producer may be run again, shortest first."""
    from lmscli.plan.document import recompute_cost

    pos_of = {node: k for k, node in enumerate(schedule.nodes)}
    tensor_of = {(t.producer, t.output): t.id for t in schedule.tensors}
    stateless = _stateless_ops({view.ops[node] for node in schedule.nodes})
    stateful = StatefulOps()
    out: dict[int, tuple[Recipe, ...]] = {}

    def allowed(node: int) -> bool:
        k = pos_of.get(node)
        return (k is not None and schedule.on_gpu[k] and view.ops[node] in RECOMPUTABLE_OPS and view.ops[node] in stateless
                and not view.in_loop(node) and not view.conditional(node))

    for tid in sorted(cands):
        t = schedule.tensors[tid]
        root = schedule.nodes[t.producer]
        if not allowed(root):
            continue
        chain = {root}
        found: list[Recipe] = []
        for depth in range(MAX_DEPTH):
            chain = _close(view, chain, allowed, fused)
            if chain is None or len(chain) > MAX_OPS or sum(view.ops[n] in HEAVY_OPS for n in chain) > MAX_HEAVY:
                break
            found_sources = _sources(view, schedule, chain, pos_of, tensor_of, first_output=t.output == 0)
            if found_sources is None:
                break
            sources, variables, small = found_sources
            writers = tuple(sorted({pos_of[w] for v in variables for w in _writers(view, v, stateful) if w in pos_of}))
            positions = tuple(sorted(pos_of[n] for n in chain))
            if positions[-1] != t.producer:
                break  # an op of the chain runs after the tensor's producer: not a chain ending in it
            cost, extra = recompute_cost(schedule, positions)
            if not found or found[-1].sources != sources:
                found.append(Recipe(positions, sources, cost, extra, writers, small, depth))
            grown = chain | {schedule.nodes[schedule.tensors[s].producer] for s in sources
                             if allowed(schedule.nodes[schedule.tensors[s].producer])}
            if grown == chain:
                break
            chain = grown
        if found:
            out[tid] = tuple(found)
    return out


def short(found: dict[int, tuple[Recipe, ...]]) -> dict[int, tuple[Recipe, ...]]:
    """The short recipes of ``found`` (at most :data:`SHORT_OPS` ops, within :data:`SHORT_DEPTH`
    rings): each tensor's list is shortest first, so they are its first ones."""
    out = {}
    for tid, listed in found.items():
        kept = tuple(r for r in listed if len(r.positions) <= SHORT_OPS and r.ring < SHORT_DEPTH)
        if kept:
            out[tid] = kept
    return out


def _close(view: GraphView, chain: set, allowed, fused: frozenset):
    """``chain`` with the producers of every edge into it that Grappler fuses or folds (an edge
    from a node the optimizations remove, other than an identity or reshape they look through);
    None when such a producer may not be recomputed."""
    chain = set(chain)
    todo = list(chain)
    while todo:
        node = todo.pop()
        for src, _out in view.data_inputs[node]:
            if src in chain or view.ops[src] in CONSTANT_OPS or variable_of(view, src) is not None:
                continue  # constants and variables are read as they are (Grappler may fold or merge them)
            if fused_at(view, src, node) or (view.names[src] in fused
                                                              and view.ops[src] not in FORWARDING_OPS):
                if not allowed(src):
                    return None
                chain.add(src)
                todo.append(src)
    return chain


BATCH_NORMS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})


def _running_statistics(view: GraphView, node: int, port: int) -> bool:
    """Is input ``port`` of ``node`` the running mean or variance of a batch norm in training
    mode? Its normalized output (0) is made from the batch's own statistics: the running ones only
    go into its outputs 1 and 2 (the updated averages), so an update of the moving averages,
    which runs in the forward pass, need not wait for clones of it (QA r52: no batch norm of a
    DenseNet-BC from ``tf.compat.v1.layers`` was made again, and recompute-only found no plan at
    80% of its peak)."""
    if port not in (3, 4) or view.ops[node] not in BATCH_NORMS:
        return False
    attr = view.node_defs[node].attr.get("is_training")
    return attr is None or bool(attr.b)  # (true by default)


def _sources(view: GraphView, schedule: Schedule, chain: set, pos_of: dict, tensor_of: dict, first_output: bool = True):
    """``(tensor ids, variable nodes, small tensor ids)`` the chain reads from outside: the tensors
    that must be on the GPU when it runs again, the variables whose value it reads, and tensors of
    at most :data:`SMALL_SOURCE` bytes (scalars, per-channel vectors: the clones keep them, at no
    cost worth counting; they must not be swapped or made again); None when the
    chain reads something a clone may not (a host value that is not a constant, a control-flow
    output, a tensor the schedule does not count)."""
    out, variables, small = set(), set(), set()
    for node in chain:
        for port, (src, output) in enumerate(view.data_inputs[node]):
            if src in chain:
                continue
            op = view.ops[src]
            if op in CONSTANT_OPS:
                continue
            variable = variable_of(view, src)
            if variable is not None:
                if not (first_output and _running_statistics(view, node, port) and _only_output_0(view, node, chain)):
                    variables.add(variable)
                continue
            if op in CONTROL_FLOW_OPS or op in VARIABLE_OPS:
                return None
            k = pos_of.get(src)
            tid = tensor_of.get((k, output)) if k is not None else None
            if tid is None or (schedule.shares and schedule.shares[tid] == RESIDENT):
                return None  # not counted, or resident without being a variable's read
            if schedule.tensors[tid].num_bytes <= SMALL_SOURCE:
                small.add(tid)
            else:
                out.add(tid)
    return tuple(sorted(out)), tuple(sorted(variables)), tuple(sorted(small))


def _only_output_0(view: GraphView, node: int, chain: set) -> bool:
    """Do the ops of ``chain`` read only output 0 of ``node``?"""
    return all(out == 0 for dst, _port, out in view.consumers[node] if dst in chain)


def variable_of(view: GraphView, node: int) -> int | None:
    """The variable whose value ``node`` is: the variable itself (a reference variable), its
    ``read`` Identity, or a ReadVariableOp of its handle; else None."""
    for _ in range(8):
        op = view.ops[node]
        if op in VARIABLE_OPS:
            return node
        if op not in ("Identity", "Snapshot", "ReadVariableOp") or not view.data_inputs[node]:
            return None
        node = view.data_inputs[node][0][0]
    return None


def _writers(view: GraphView, variable: int, stateful) -> list[int]:
    """Ops that may change ``variable``: stateful ops reading its handle (directly or through an
    Identity) other than plain reads; every op but a read taking a reference variable (``Assign``,
    ``ApplyMomentum``: reference inputs are written in place by ops the registry does not mark
    stateful)."""
    out, todo, seen = [], [variable], {variable}
    while todo:
        node = todo.pop()
        for dst, _port, _out in view.consumers[node]:
            op = view.ops[dst]
            if op in ("Identity", "Snapshot") and dst not in seen and view.ops[node] in VARIABLE_OPS:
                seen.add(dst)
                if op != "Identity" or view.ops[variable] == "VarHandleOp":
                    todo.append(dst)  # a handle passed on (a ref variable's Identity is a read)
                continue
            if op in VARIABLE_READS:
                continue
            if stateful(op) or view.ops[variable] != "VarHandleOp":
                out.append(dst)  # reference inputs are updated in place by ops not marked stateful
    return out


VARIABLE_READS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized", "VariableShape"})


def _stateless_ops(ops) -> frozenset:
    """The ops among ``ops`` that TensorFlow's registry says are stateless (random ops are stateful)."""
    from lmscli.tfimport import tensorflow

    tensorflow()
    from tensorflow.python.framework import op_def_registry

    out = set()
    for op in ops:
        op_def = op_def_registry.get(op)
        if op_def is not None and not op_def.is_stateful:
            out.add(op)
    return frozenset(out)


class Buffers:
    """Which tensors share a buffer (executor model: forwarded or reused in place), to tell whether
    a source of a recomputation is still on the GPU when the clones run *without* the tensor being
    recomputed: ``relu = Relu(add)`` reuses ``add``'s buffer in place, so ``add`` stays only as
    long as ``relu`` is read, and once ``relu``'s later readers take a clone instead, ``add`` is
    gone by then."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.last = [t.consumers[-1] if t.consumers else t.producer for t in schedule.tensors]
        if schedule.memory_model == "executor" and schedule.shares:
            from lmscli.model.memmodel import roots

            self.root = roots(schedule)
        else:
            self.root = tuple(t.id for t in schedule.tensors)
        self.members: dict[int, list[int]] = {}
        for t in schedule.tensors:
            self.members.setdefault(self.root[t.id], []).append(t.id)

    def group(self, tid: int) -> list[int]:
        """The tensors sharing ``tid``'s buffer (just ``tid`` for a buffer of its own; [] if resident)."""
        r = self.root[tid]
        return [] if r < 0 else self.members[r]

    def alive(self, tid: int, position: int, without: int) -> bool:
        """Is ``tid``'s buffer still read after ``position`` by a tensor other than ``without`` and
        what is made from it in place or forwarded?"""
        if self.root[tid] < 0:
            return True  # resident
        return any(self.last[m] > position for m in self.group(tid)
                   if m != without and not self._through(m, without))

    def _through(self, m: int, t: int) -> bool:
        shares = self.schedule.shares
        if not shares:
            return False
        for _ in range(len(shares)):
            if m == t:
                return True
            if m < 0 or shares[m] < 0:
                return False
            m = shares[m]
        return False
