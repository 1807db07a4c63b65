"""Which tensors may be swapped, and which consumers may be rewired to a swap-in.

A tensor is a *candidate* when swapping it is both safe and useful:

* its producer is an active GPU op outside any v1 while-loop frame (a forwarding op Grappler
  removes included: :data:`REMOVED_ALIASES`) and is not a control-flow op
  (a cond's Switch and Merge excepted: their outputs are ordinary tensors, inside a branch or
  after the cond), a constant, a variable or a shape op. Unlike TFLMS we do swap variable
  reads, identities and placeholders: TensorFlow's memory accounting (and Grappler's) gives their outputs buffers of
  their own, and a large weight read held from the forward to the backward pass is as costly
  as an activation;
* its dtype is numeric (no resource, variant or string handles), its rank is at least 2 and its
  size is known;
* its swap frees memory: not a variable's own buffer; a buffer that other tensors share (an
  Identity or a Switch forwarding it) is freed only by swapping them all (``Candidate.shares``);
* it is not summed by an AddN of three or more inputs at input 0, nor at a later input when
  input 0's buffer has another reader (see :func:`_order_sensitive_sum`);
* at least one consumer is *rewirable*: a GPU op outside while-loop frames that is not itself a
  control-flow op (those need their inputs in a particular frame or form), or the ``Enter`` of a
  loop invariant into a loop (:func:`loop_entry`), and whose edge from the producer is not one
  Grappler fuses (see :data:`FUSED_EDGES`).

User filters (name scopes and op types, for producers and consumers) narrow this further.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmscli.graph.graphview import CONTROL_FLOW_OPS, PLACEHOLDER_OPS, SHAPE_OPS, UNWAITING_OPS, VARIABLE_OPS, GraphView
from lmscli.model.schedule import Schedule, invariant_enter

NEVER_SWAP_PRODUCERS = frozenset({"Const", "HostConst", "BroadcastGradientArgs"}) | SHAPE_OPS | VARIABLE_OPS | CONTROL_FLOW_OPS

# An Identity's output is its input's value: when Grappler removes one, its consumers read that
# input instead, so its output still exists (unlike an op fused into a kernel) and may be swapped.
# That is allowed for the Identities lms's inlining makes (lmscli.graph.inline.BOUNDARY_ATTR): a
# TensorFlow 2 backward function reads every activation it needs through them, so without them
# nothing crossing a function boundary could be swapped; and for other removed forwarding ops
# (REMOVED_ALIASES below), which are swapped but never recomputed (clones of them made
# recompute-only plans worse on v1 graphs).
ALIAS_OPS = frozenset({"Identity"})

# The ops of a v1 cond (outside while loops) make ordinary tensors: a Switch output is its input
# inside one branch (dead in the other), a Merge output the branch's result after the cond.
COND_PRODUCERS = frozenset({"Switch", "Merge"})


@dataclass(frozen=True)
class Filters:
    """Include/exclude filters by name scope (prefix) and op type, for producers and consumers."""

    include_scopes: tuple[str, ...] = ()
    exclude_scopes: tuple[str, ...] = ()
    include_types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    include_consumer_scopes: tuple[str, ...] = ()
    exclude_consumer_scopes: tuple[str, ...] = ()
    include_consumer_types: tuple[str, ...] = ()
    exclude_consumer_types: tuple[str, ...] = ()

    @staticmethod
    def _ok(name: str, op: str, inc_scopes, exc_scopes, inc_types, exc_types) -> bool:
        if inc_scopes and not any(_in_scope(name, s) for s in inc_scopes):
            return False
        if any(_in_scope(name, s) for s in exc_scopes):
            return False
        if inc_types and op not in inc_types:
            return False
        return op not in exc_types

    def producer_ok(self, name: str, op: str) -> bool:
        return self._ok(name, op, self.include_scopes, self.exclude_scopes, self.include_types, self.exclude_types)

    def consumer_ok(self, name: str, op: str) -> bool:
        return self._ok(name, op, self.include_consumer_scopes, self.exclude_consumer_scopes,
                        self.include_consumer_types, self.exclude_consumer_types)

    def to_dict(self) -> dict:
        return {k: list(v) for k, v in self.__dict__.items() if v}

    @classmethod
    def from_dict(cls, data: dict) -> "Filters":
        return cls(**{k: tuple(v) for k, v in (data or {}).items()})


_MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
_ACTIVATIONS = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid"})
# Producer -> consumer edges that Grappler's remapper folds or fuses (transposes into matmuls: see
# fused_at for which; bias adds and activations into convolutions, on GPUs as on CPUs). A swap node on such an edge stops the
# fusion and the kernel that runs instead rounds differently in the last bit, so those consumers
# always read the GPU copy. Rewrites of element-wise arithmetic chains (the arithmetic optimizer,
# constant folding) are device-independent: :mod:`lmscli.plan.optguard` checks each plan against them.
_TRANSPOSES = frozenset({"Transpose", "ConjugateTranspose"})
FUSED_EDGES = (
    (_TRANSPOSES, _MATMULS),
    (frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul"}), frozenset({"BiasAdd", "Add", "AddV2"})),
    (frozenset({"BiasAdd", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"}), _ACTIVATIONS),
)


def fused_edge(producer_op: str, consumer_op: str) -> bool:
    """True for an edge Grappler's remapper may fold or fuse."""
    return any(producer_op in src and consumer_op in dst for src, dst in FUSED_EDGES)


def fused_at(view: GraphView, src: int, dst: int) -> bool:
    """:func:`fused_edge` for the edge from node ``src`` into node ``dst``: a transpose folds into
    a matrix product only when it swaps the last two dimensions (the product's adjoint flags); the
    head split of attention (``[0, 2, 1, 3]``) stays a transpose of its own."""
    if not fused_edge(view.ops[src], view.ops[dst]):
        return False
    return view.ops[src] not in _TRANSPOSES or _inner_transpose(view, src)


def _inner_transpose(view: GraphView, node: int) -> bool:
    """Does the transpose ``node`` swap the last two dimensions and keep the others (True when its
    permutation is not a constant)?"""
    inputs = view.data_inputs[node]
    value = view.constant(inputs[1][0]) if len(inputs) >= 2 else None
    if value is None:
        return True
    perm = [int(x) for x in value.ravel()]
    n = len(perm)
    return n < 2 or perm == list(range(n - 2)) + [n - 1, n - 2]


def absorbed(view: GraphView, node: int, fused: frozenset) -> bool:
    """Is ``node`` an activation that Grappler's remapper folds into its producer's kernel?

    Before::  conv -> FusedBatchNormV3 -> Relu -> {Pad, ReluGrad}
    After::   conv -> _FusedBatchNormEx (the batch norm's name) -> {Pad, ReluGrad}

    The fused kernel's output is the activation's tensor under its producer's name, and the
    remapper looks only at the edge into the activation, so a swap-out reading the activation's
    output leaves the fusion as it is (the optimizer guard checks each plan all the same)."""
    inputs = view.data_inputs[node]
    if view.ops[node] not in _ACTIVATIONS or len(inputs) != 1:
        return False
    src = inputs[0][0]
    return view.names[src] not in fused and fused_edge(view.ops[src], view.ops[node])


def remapped(view: GraphView, optimized) -> frozenset:
    """Names of the nodes Grappler's remapper turns into a fused kernel under their own name
    (``_FusedBatchNormEx``, ``_FusedConv2D``, ``_FusedMatMul``), found in ``optimized`` (what
    Grappler's default optimizations make of the graph). A control input into one stops that
    fusion (QA: a U-Net's stand-in plans made batch norms wait for swap-outs, and the optimizer
    guard took a swap out of every plan, round after round, until none fitted)::

        conv -> FusedBatchNormV3 -> Relu   ==>  conv -> _FusedBatchNormEx (the batch norm's name)
        swap-out - - -> FusedBatchNormV3   ==>  conv -> FusedBatchNormV3 -> Relu (not fused)
    """
    if optimized is None:
        return frozenset()
    out = set()
    for node in optimized.node:
        i = view.index.get(node.name)
        if i is not None and node.op.startswith("_Fused") and view.ops[i] != node.op:
            out.add(node.name)
    return frozenset(out)


def _in_scope(name: str, scope: str) -> bool:
    scope = scope.rstrip("/")
    return name == scope or name.startswith(scope + "/")


def edge_safe(view: GraphView, schedule: Schedule, k: int) -> bool:
    """May the op at position ``k`` take part in any added control edge (trigger, waiter,
    serialized chain)? A GPU op outside while loops and cond branches that is not itself control
    flow."""
    return trigger_safe(view, schedule, k) and not view.conditional(schedule.nodes[k])


# Ops that are, or that Grappler's constant folding turns into, constants. A control edge added
# into one is moved by its constant folding and dependency optimizer, which can then build a
# cycle (seen: a landing edge into the Const of a SquaredDifference gradient on a transformer).
CONSTANT_LIKE_OPS = frozenset({"Const", "HostConst"}) | SHAPE_OPS


def landing_safe(view: GraphView, schedule: Schedule, k: int, fused: frozenset = frozenset()) -> bool:
    """May the op at ``k`` be a swap-in's landing op (wait until the swap-in is on the GPU, so that
    its own allocation comes after)? An op fit for control edges (:func:`trigger_safe`) that is not
    constant-like and that Grappler's optimizations keep (not in ``fused``, names of the nodes they
    fold or fuse away). (Waiters of swap-outs may be any op fit for control edges but an activation
    fused into its producer, :func:`absorbed`: other plans Grappler treats differently are caught
    by the optimizer guard.)"""
    return (schedule.ops[k] not in CONSTANT_LIKE_OPS and schedule.names[k] not in fused
            and trigger_safe(view, schedule, k))


def trigger_safe(view: GraphView, schedule: Schedule, k: int) -> bool:
    """May the op at position ``k`` trigger a swap-in or wait for a swap-out when the branches
    agree (see :func:`branch_safe`)? A GPU op outside while loops that is neither control flow nor
    a variable or placeholder (:data:`lmscli.graph.graphview.UNWAITING_OPS`: a momentum slot's
    ``VarHandleOp``, run late in the stand-in's traced order, was made to wait for a swap-out, and
    the slot's initialisation then ran the step's ops)."""
    node = schedule.nodes[k]
    return (schedule.on_gpu[k] and not view.in_loop(node) and schedule.ops[k] not in CONTROL_FLOW_OPS
            and schedule.ops[k] not in UNWAITING_OPS)


def branch_safe(source: frozenset, target: frozenset) -> bool:
    """May a control edge go from a node in the v1 cond branches ``source`` to one in ``target``
    (:meth:`GraphView.branch_tags`)? A node in an untaken branch is *dead*, and a control edge from
    a dead node makes its target dead too: that is harmless only when the target is dead whenever
    the source is, i.e. when it runs in every branch the source runs in::

        pred --> Switch --:1--> A (branch true)        A - - -> X   X outside the cond, or in the
                       --:0--> B (branch false)                     false branch: never runs when
                                                                    pred is false -- refused
                                                       A - - -> C   C in the true branch: fine
    """
    return source <= target


@dataclass(frozen=True)
class Candidate:
    tensor: int  # SimTensor id
    rewirable: tuple[int, ...]  # consumer positions that may read a swap-in
    pinned: tuple[int, ...] = field(default=())  # consumer positions that must read the GPU copy
    shares: tuple[int, ...] = field(default=())  # other tensors holding its buffer: swapped together or not at all
    beyond_tflms: bool = False  # an alias Grappler removes, a later input of an AddN of 3+, a head split into a matmul


def candidates(view: GraphView, schedule: Schedule, filters: Filters = Filters(),
               fused: frozenset = frozenset(), forbidden: frozenset = frozenset(),
               untaken: frozenset = frozenset()) -> dict[int, Candidate]:
    """Candidate tensors of ``schedule`` keyed by tensor id (see the module docstring). Nodes in
    ``fused`` (removed by Grappler's optimizations) neither produce swapped tensors (except an
    activation folded into its producer's kernel, see :func:`absorbed`, and an inlined call's
    argument or result, see :data:`ALIAS_OPS`) nor read swap-ins;
    tensors named in ``forbidden`` (``"node:output"``, e.g. found by the optimizer guard) are
    never swapped, nor tensors read by a node in ``untaken`` (the cond branch the schedule leaves
    out: if it is the one that runs, it must find the tensor on the GPU)."""
    out: dict[int, Candidate] = {}
    no_gain, shared = _no_gain(schedule)
    for t in schedule.tensors:
        if t.id in no_gain:
            continue
        p = t.producer
        node = schedule.nodes[p]
        op = view.ops[node]
        if not schedule.on_gpu[p] or view.in_loop(node):
            continue
        if op in NEVER_SWAP_PRODUCERS and op not in COND_PRODUCERS:
            continue
        if (view.names[node] in fused and not absorbed(view, node, fused) and op not in COND_PRODUCERS
                and not boundary(view, node) and not removed_alias(view, node)):
            continue  # (a cond's Switch Grappler removes is a duplicate: its twin forwards the same tensor)
        if forbidden and f"{view.names[node]}:{t.output}" in forbidden:
            continue
        if untaken and any(view.names[dst] in untaken for dst, _port, out in view.consumers[node] if out == t.output):
            continue
        info = view.tensor(node, t.output)
        if info is None or info.num_bytes is None or info.itemsize == 0 or (info.rank or 0) < 2:
            continue
        if any(_order_sensitive_sum(view, schedule.nodes[c], node, t.output) for c in t.consumers):
            continue
        # (TFLMS swapped neither: its style of plan leaves them, see planner.tflms_swaps; nor did
        # lms before it told a head split from a transpose Grappler folds into a matrix product:
        # the greedy swap plan with queries and keys to move took them on PCIe 3 where it had
        # waited less for others, a transformer at half its peak +167% against +136%)
        beyond = (view.names[node] in fused and removed_alias(view, node)) or any(
            _long_sum(view, schedule.nodes[c]) or (op in _TRANSPOSES and fused_edge(op, view.ops[schedule.nodes[c]]))
            for c in t.consumers)
        if not filters.producer_ok(view.names[node], op):
            continue
        rewirable, pinned = [], []
        for c in t.consumers:
            cnode = schedule.nodes[c]
            cop = view.ops[cnode]
            if (schedule.on_gpu[c] and ((cop not in CONTROL_FLOW_OPS and not view.in_loop(cnode))
                                        or loop_entry(view, cnode))
                    and not fused_at(view, node, cnode)
                    and view.names[cnode] not in fused
                    and filters.consumer_ok(view.names[cnode], cop)):
                rewirable.append(c)
            else:
                pinned.append(c)
        if rewirable:
            out[t.id] = Candidate(t.id, tuple(rewirable), tuple(pinned), shared.get(t.id, ()), beyond)
    return out


def loop_entry(view: GraphView, node: int) -> bool:
    """Is ``node`` the ``Enter`` of a loop invariant into a loop outside other loops and cond
    branches? A swap-in may feed it: the value leaves the GPU after its last use before the loop
    and comes back before the loop reads it (the schedule runs such an ``Enter`` just before its
    first reader, :func:`lmscli.model.schedule.late_invariant_enters`)::

        x --> Enter --> body            x --> swap-out --> swap-in --> Enter --> body
                                                trigger ---^ (an op before the loop)
    """
    return (invariant_enter(view, node) and not view.frame_parent.get(view.frames[node], "")
            and not view.conditional(node))


# Forwarding ops Grappler removes whose output lms may swap all the same: the tensor lives on
# under its input's name, read by the alias's consumers (v1 gradients reach their consumers
# through the ``tuple/control_dependency`` Identities of ``tf.gradients``; ``stop_gradient``
# feeds a second tower). Swapping one rewires those consumers, as for any tensor; the optimizer
# guard checks that Grappler still removes the alias. Not recomputed (see planner._Context.recipes).
REMOVED_ALIASES = frozenset({"Identity", "StopGradient", "PreventGradient", "Snapshot"})
# Forwarding ops whose output is input 0's buffer under another shape (the rest of their inputs
# say which): when Grappler removes one, as a no-op or as a duplicate of a twin reading the same
# tensor, the buffer its readers hold is still there (QA r47: a WaveNet's dilated convolutions each
# expand their input twice, for the filter and the gate; Grappler keeps one ExpandDims, and with
# the other unswappable no plan could free the buffer: stuck at 1.6x the lower bound).
REMOVED_RESHAPES = frozenset({"Reshape", "ExpandDims", "Squeeze", "EnsureShape"})
# ``tf.custom_gradient`` returns its results through an IdentityN of the results and the inputs
# (output k forwards input k), which Grappler removes: every ``tf.nn.silu``/tf_keras swish output
# is one (QA r50: an EfficientNet-style net's activations, read again by the next convolution's
# filter gradient, were no candidates, and no plan reached 55% of its peak).
REMOVED_MULTI_ALIASES = frozenset({"IdentityN"})


def removed_alias(view: GraphView, node: int) -> bool:
    """Is ``node`` (which Grappler removes) a forwarding op whose output may be swapped: one of
    :data:`REMOVED_ALIASES` with one input, an IdentityN (:data:`REMOVED_MULTI_ALIASES`), or one of
    :data:`REMOVED_RESHAPES`?"""
    op = view.ops[node]
    return ((op in REMOVED_ALIASES and len(view.data_inputs[node]) == 1) or op in REMOVED_RESHAPES
            or op in REMOVED_MULTI_ALIASES)


def boundary(view: GraphView, node: int) -> bool:
    """Is ``node`` an Identity lms's inlining made for a call's argument or result?"""
    from lmscli.graph.inline import BOUNDARY_ATTR

    return view.ops[node] in ALIAS_OPS and BOUNDARY_ATTR in view.node_defs[node].attr


SUM_OPS = frozenset({"AddN", "AccumulateNV2"})


def _order_sensitive_sum(view: GraphView, node: int, src: int, output: int) -> bool:
    """Does swapping tensor ``(src, output)`` risk the order of a sum at ``node``, an AddN of three
    or more tensors? TensorFlow's AddN kernel accumulates into the first input whose buffer it may
    reuse and moves that input to the front of the sum, so which input is free to reuse (a
    swap-out still holds its tensor; a swap-in's buffer is its own) can change the order of the
    sum, and with it the last bits. Two inputs commute exactly. A precaution taken from the
    kernel's code (the optimizer guard does not see it: the graph Grappler makes is the same).

    Safe: a tensor read at a later input when the sum is the only reader of every input's buffer.
    Then the kernel reuses input 0 before and after the swap, whichever input Grappler puts first
    (it sorts a commutative op's inputs by name): the swapped one's swap-in, too, has the sum as
    its only reader::

        g0, g1 (read only by AddN) --:0,:1--> AddN <--:2-- g2 (swapped: its swap-in is read instead)
        order before and after: g0 + g1 + g2, accumulated in g0's buffer
    """
    if not _long_sum(view, node):
        return False
    ports = [k for k, edge in enumerate(view.data_inputs[node]) if edge == (src, output)]
    return (view.ops[node] != "AddN" or 0 in ports or len(ports) > 1
            or not all(_sole_reader(view, s, o) for s, o in view.data_inputs[node]))


def _long_sum(view: GraphView, node: int) -> bool:
    """An AddN (or AccumulateNV2) of three or more tensors: the order of its sum can change."""
    return view.ops[node] in SUM_OPS and len(view.data_inputs[node]) >= 3


_OWN_BUFFER_NEVER = PLACEHOLDER_OPS | {"ReadVariableOp"}


def _sole_reader(view: GraphView, src: int, output: int) -> bool:
    """Has tensor ``(src, output)`` one reader, and does its buffer have no other (through the
    forwarding ops that make it: Identity, Reshape, ...)? Then its reader may reuse the buffer."""
    from lmscli.model.memmodel import FORWARDING_OPS

    while True:
        readers = [dst for dst, _port, out in view.consumers[src] if out == output]
        op = view.ops[src]
        if len(readers) != 1 or op in NEVER_SWAP_PRODUCERS or op in _OWN_BUFFER_NEVER or view.in_loop(src):
            return False
        if op not in FORWARDING_OPS:
            return True
        if op in CONTROL_FLOW_OPS or len(view.data_inputs[src]) != 1:
            return False
        src, output = view.data_inputs[src][0]


def _no_gain(schedule: Schedule) -> tuple[set[int], dict[int, tuple[int, ...]]]:
    """Executor model: ``(no_gain, shared)``. A variable read is the variable's own buffer: its
    swap frees nothing (``no_gain``). A tensor whose buffer other tensors still need after it is
    made (an Identity or a cond's Switch forwards its input's buffer) frees it only when they are
    swapped too: ``shared`` maps it to them. Outputs that reuse a tensor's buffer in place do not
    count: a swap-out holds the buffer, so the kernel allocates instead (see
    :func:`lmscli.model.simulator._executor_events`)::

        x = Relu(...)  --> Switch --:1--> conv (branch) ... ConvGrad (branch)      x and Switch:1 are
                       --> ReluGrad (after the cond)                               one buffer: swap both
    """
    if schedule.memory_model != "executor" or not schedule.shares:
        return set(), {}
    from lmscli.model.memmodel import roots

    root = roots(schedule)
    members: dict[int, list[int]] = {}
    out: set[int] = set()
    shared: dict[int, tuple[int, ...]] = {}
    for t in schedule.tensors:
        if root[t.id] >= 0:
            members.setdefault(root[t.id], []).append(t.id)
        else:
            out.add(t.id)
    for group in members.values():
        if len(group) < 2:
            continue
        for tid in group:
            made = schedule.tensors[tid].producer
            others = tuple(m for m in group if m != tid and _last(schedule.tensors[m]) > made
                           and not _in_place_from(schedule, m, tid))
            if others:
                shared[tid] = others
    return out, shared


def _in_place_from(schedule: Schedule, m: int, tid: int) -> bool:
    """Does ``m`` share ``tid``'s buffer through an in-place reuse of ``tid`` itself (directly or
    further down the chain)?"""
    while m >= 0 and schedule.shares[m] >= 0:
        if schedule.shares[m] == tid:
            return bool(schedule.in_place[m])
        m = schedule.shares[m]
    return False


def _last(t) -> int:
    return t.consumers[-1] if t.consumers else t.producer
