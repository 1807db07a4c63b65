"""The execution schedule of one training step, as plain values for the simulator and planner.

Only the ancestors of the fetches run (as in ``Session.run``). By default their order and op times
are those of Grappler's virtual scheduler on a virtual GPU (first-ready list scheduling with
TensorFlow's analytical cost model), so our memory figures are comparable with TensorFlow's own
estimate. Without Grappler, the same first-ready scheduling runs on our roofline cost model.
Either way the order does not depend on the GraphDef's node order. Each tensor is described by its
producer's position, its consumers' positions and its size; variables and constants are *resident*
for the whole step.

A tensor counts against GPU memory when its producer or one of its consumers is a GPU op (any op
not explicitly placed on a CPU); a host tensor read by a GPU op is a copy on the GPU.
"""

from __future__ import annotations

import heapq
import itertools
import re
from dataclasses import dataclass
from functools import cached_property

from lmscli.model.costmodel import op_time
from lmscli.graph.graphview import CONSTANT_OPS, DEFAULT_GPU, PLACEHOLDER_OPS, VARIABLE_OPS, GraphView
from lmscli.timing import timed


@dataclass(frozen=True)
class SimTensor:
    id: int
    producer: int  # position of the producing op
    output: int
    num_bytes: int
    consumers: tuple[int, ...]  # positions of the ops reading it, sorted, unique
    pieces: int = 1  # allocations it stands for: what a loop keeps, one per iteration (up to MAX_PIECES)
    least_bytes: int | None = None  # what a loop keeps at least, if less (lmscli.model.loops.Storage.least_bytes)
    filled_in: str = ""  # the while-loop frame whose iterations make its pieces, one each ("": made at once)

    @property
    def floor_bytes(self) -> int:
        """The bytes a lower bound counts: ``least_bytes`` if set, else ``num_bytes``."""
        return self.num_bytes if self.least_bytes is None else self.least_bytes


@dataclass(frozen=True)
class Schedule:
    nodes: tuple[int, ...]  # GraphView index of the op at each position
    names: tuple[str, ...]
    ops: tuple[str, ...]
    levels: tuple[int, ...]
    compute: tuple[int, ...]  # microseconds of GPU time per position (0 for host ops)
    on_gpu: tuple[bool, ...]
    tensors: tuple[SimTensor, ...]
    inputs: tuple[tuple[int, ...], ...]  # ids of the counted tensors each position reads
    variable_bytes: int  # variables placed on this GPU (resident for the whole step)
    constant_bytes: int
    device: str = DEFAULT_GPU  # the GPU this schedule describes (graphs may place ops on several)
    memory_model: str = "grappler"  # how the simulator counts memory (see lmscli.model.memmodel)
    shares: tuple[int, ...] = ()  # executor model: per tensor, the tensor whose buffer it shares
    in_place: tuple[bool, ...] = ()  # executor model: per tensor, that link is an in-place reuse
    scratch: tuple[int, ...] = ()  # per position, kernel scratch bytes held while the op runs
    scratch_first: tuple[bool, ...] = ()  # per position, the kernel takes its scratch before its outputs
    # The step as the CPU stand-in's executor runs it (set by on_stand_in): a swap-out's transfer
    # starts only when an op waits for it (see lmscli.model.simulator), where a GPU's starts when
    # its producer ends; and an output the other process reads is no input's buffer (memmodel.sharing).
    stand_in: bool = False
    # Gradient stacks kept on the host (lmscli.plan.hoststacks): per loop and direction, (position,
    # bytes copied over one step, microseconds of the loop's compute those copies can hide behind),
    # and per stack (first push, last pop, bytes) of host memory.
    stack_copies: tuple[tuple[int, int, int], ...] = ()
    host_held: tuple[tuple[int, int, int], ...] = ()
    # Per position, the op's first input is a constant of this GPU (counted in constant_bytes, not
    # a tensor): a forwarding op hands on the constant's buffer; or the op pops a stack that keeps a
    # variable's or constant's buffer (loops.resident_pops): it hands that buffer on.
    reads_constant: tuple[bool, ...] = ()
    # Per position, the op is a loop's Merge whose value is, from the second iteration on, one the
    # last iteration made (memmodel.sharing): every loop's, except on the stand-in those of loops
    # running iterations at once (loops.running_ahead), whose sums wait (Schedule.ahead).
    carried: tuple[bool, ...] = ()
    # Per allocation that iterations of a loop running ahead of the one the model counts held in a
    # traced step (lmscli.model.loops.iterations_ahead): (first position, last position, bytes),
    # held while the ops from first to last run.
    ahead: tuple[tuple[int, int, int], ...] = ()
    # Per position, for an op that forwards each input to the output of its index (IdentityN: a
    # custom gradient's outputs), its data inputs as (producer position, output); -1: not scheduled.
    ports: tuple[tuple[tuple[int, int], ...], ...] = ()

    def with_scratch(self, by_name: dict, first=frozenset()) -> "Schedule":
        """The same schedule with kernel scratch bytes per op name (e.g. measured on the stand-in),
        taken before the op's outputs by the ops named in ``first``, after them by the others."""
        from dataclasses import replace

        return replace(self, scratch=tuple(int(by_name.get(name, 0)) for name in self.names),
                       scratch_first=tuple(name in first for name in self.names) if first else ())

    def on_stand_in(self) -> "Schedule":
        """The same step as the CPU stand-in runs it (``stand_in``): a swap-out's transfer waits
        for an op that needs it, and an op whose output the other process reads takes a buffer of
        its own (:func:`lmscli.model.memmodel.sharing`; counted again, as a schedule given
        ``stand_in`` by ``replace`` alone has a GPU's sharing)."""
        from dataclasses import replace

        return replace(self, stand_in=True).with_memory_model(self.memory_model)

    def with_memory_model(self, memory_model: str) -> "Schedule":
        """The same schedule counted by another memory model (``executor`` or ``grappler``)."""
        from dataclasses import replace

        from lmscli.model import memmodel

        if memory_model not in memmodel.MODELS:
            raise ValueError(f"unknown memory model {memory_model!r}")
        shares, in_place = ((), ())
        if memory_model == "executor":
            shares, in_place = memmodel.sharing(self.ops, self.tensors, self.inputs, self.on_gpu, self.reads_constant,
                                                self.carried, stand_in=self.stand_in, ports=self.ports)
        return replace(self, memory_model=memory_model, shares=shares, in_place=in_place)

    def without(self, names) -> "Schedule":
        """The schedule without the ops named in ``names`` (e.g. what Grappler prunes as dead):
        their outputs are gone and they no longer read their inputs, so those end sooner.

        Before::  x -> A -> B (dead) ;  x -> C (backward)      x lives from A to C, B holds y
        After::   x -> A ;  x -> C                              B and its output are gone

        The order of the other ops is kept; resident bytes are unchanged (variables stay)."""
        drop = {pos for pos, name in enumerate(self.names) if name in names}
        return self._keeping(drop, frozenset()) if drop else self

    def without_tensors(self, ids) -> "Schedule":
        """The schedule without the tensors ``ids`` (they no longer take GPU memory; e.g. what a
        gradient stack kept on the host would keep); ops and order are unchanged, ids renumbered."""
        return self._keeping(frozenset(), frozenset(ids)) if ids else self

    def reordered(self, order) -> "Schedule":
        """The same ops run in ``order`` (old positions, a permutation that keeps every tensor's
        producer before its consumers): positions and tensor ids renumbered (ids in producer order).

        Before::  A (makes dx) ; B (last reads x)      x and dx live together at A
        After::   B ; A                                x is gone before dx is made

        For schedules without stacks on the host (their positions are not renumbered)."""
        return self._keeping(frozenset(), frozenset(), order)

    def _keeping(self, drop_positions, drop_tensors, order=None) -> "Schedule":
        """The schedule without the ops at ``drop_positions`` (and their outputs) and without the
        tensors ``drop_tensors``: positions and tensor ids renumbered, the order kept (or that of
        ``order``, old positions)."""
        from dataclasses import replace

        kept = [pos for pos in (range(len(self.nodes)) if order is None else order) if pos not in drop_positions]
        new_pos = {old: new for new, old in enumerate(kept)}
        tensors: list[SimTensor] = []
        new_id: dict[int, int] = {}
        survivors = [t for t in self.tensors if t.producer not in drop_positions and t.id not in drop_tensors]
        if order is not None:
            survivors.sort(key=lambda t: (new_pos[t.producer], t.output))
        for t in survivors:
            new_id[t.id] = len(tensors)
            tensors.append(SimTensor(len(tensors), new_pos[t.producer], t.output, t.num_bytes,
                                     tuple(sorted(new_pos[c] for c in t.consumers if c not in drop_positions)),
                                     t.pieces, t.least_bytes, t.filled_in))
        inputs = tuple(tuple(new_id[tid] for tid in self.inputs[pos] if tid in new_id) for pos in kept)
        pick = lambda values: tuple(values[pos] for pos in kept) if values else values  # noqa: E731
        ahead = []
        for first, last, num_bytes in self.ahead:
            span = [new_pos[pos] for pos in range(first, last + 1) if pos in new_pos]
            if span:
                ahead.append((min(span), max(span), num_bytes))
        pruned = replace(self, nodes=pick(self.nodes), names=pick(self.names), ops=pick(self.ops),
                         levels=pick(self.levels), compute=pick(self.compute), on_gpu=pick(self.on_gpu),
                         tensors=tuple(tensors), inputs=inputs, scratch=pick(self.scratch),
                         scratch_first=pick(self.scratch_first), shares=(), in_place=(),
                         reads_constant=pick(self.reads_constant), carried=pick(self.carried), ahead=tuple(ahead),
                         ports=tuple(tuple((new_pos.get(src, -1), out) for src, out in p) for p in pick(self.ports)))
        return pruned.with_memory_model(self.memory_model)

    @property
    def resident_bytes(self) -> int:
        return self.variable_bytes + self.constant_bytes

    @cached_property
    def outputs(self) -> tuple[tuple[int, ...], ...]:
        """Per position, the ids of the tensors the op there produces (computed once)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for t in self.tensors:
            out[t.producer].append(t.id)
        return tuple(tuple(ids) for ids in out)

    def __len__(self) -> int:
        return len(self.nodes)

    def label(self, tid: int) -> str:
        """``node:output``; for what a loop keeps across iterations, the op that keeps it."""
        t = self.tensors[tid]
        if t.output == STORAGE_OUTPUT:
            # (a lower bound counts such a stack as if every iteration took the cond's smaller
            # branch: its share of that branch's stacks; QA r45 read "its branch" as the stack's own)
            least = ", as if every iteration took the smaller branch" if t.least_bytes is not None else ""
            return f"{self.names[t.producer]} (kept across loop iterations{least})"
        return f"{self.names[t.producer]}:{t.output}"


def variable_bytes(view: GraphView, i: int) -> int:
    """Storage bytes of a variable node, from its ``shape`` and ``dtype`` attributes."""
    node = view.node_defs[i]
    if "shape" not in node.attr or "dtype" not in node.attr:
        return 0
    return storage_bytes(node.attr["shape"].shape, node.attr["dtype"].type)


def storage_bytes(shape, dtype: int) -> int:
    """Bytes of a tensor of ``shape`` (a TensorShapeProto) and ``dtype`` (a DataType enum value);
    0 when either is not known."""
    if shape.unknown_rank or any(d.size < 0 for d in shape.dim):
        return 0
    from tensorflow.python.framework import dtypes

    try:
        itemsize = dtypes.as_dtype(dtype).base_dtype.size
    except Exception:
        return 0
    total = itemsize
    for d in shape.dim:
        total *= d.size
    return total


def first_ready_order(view: GraphView, active: set[int], cost: dict[int, int],
                      rank: dict[int, int] | None = None) -> list[int]:
    """List-schedule ``active`` on one device: run the op that became ready first (ties by name).

    With ``rank`` (an observed execution order, e.g. Grappler's trace), ops run in rank order
    whenever their inputs allow it; the result is always a topological order of ``active``.
    """
    after = _exit_waits(view, active)
    indegree = {i: 0 for i in active}
    for i in active:
        for src in view.predecessors(i):
            if src in active:
                indegree[i] += 1
        indegree[i] += len(after.get(i, ()))
    waiting: dict[int, list[int]] = {}  # a NextIteration -> the Exits of its frame
    for i, sources in after.items():
        for src in sources:
            waiting.setdefault(src, []).append(i)
    ready_at = {i: 0 for i in active}
    big = len(view.names) + 1

    def key(i):
        if rank is not None:
            return (rank.get(i, big), ready_at[i], view.names[i], i)
        return (ready_at[i], view.names[i], i)

    heap = [key(i) for i in active if indegree[i] == 0]
    heapq.heapify(heap)
    clock = 0
    order = []
    while heap:
        item = heapq.heappop(heap)
        i = item[-1]
        clock = max(clock, ready_at[i]) + cost[i]
        order.append(i)
        for j in itertools.chain(view.successors(i), waiting.get(i, ())):
            if j not in indegree:
                continue
            ready_at[j] = max(ready_at[j], clock)
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(heap, key(j))
    return order


def invariant_enter(view: GraphView, i: int) -> bool:
    """Is ``i`` the ``Enter`` of a loop invariant (``is_constant``): a value every iteration reads?"""
    if view.ops[i] != "Enter":
        return False
    attr = view.node_defs[i].attr
    return "is_constant" in attr and attr["is_constant"].b


def late_invariant_enters(view: GraphView, order: list[int]) -> list[int]:
    """``order`` with each loop invariant's ``Enter`` moved to just before the first op reading it.

    An ``Enter`` forwards its input's buffer and takes no time, so where it runs changes no
    allocation: the buffer lives until the last use of any tensor sharing it either way. It
    changes where the planner may bring the value back. A first-ready order runs a gradient
    loop's ``Enter`` of a forward tensor as soon as that tensor exists, long before the loop;
    placed there, the ``Enter`` would read the tensor all along and no swap could take it off the
    GPU in between. Moved, it is a consumer where the loop needs it, and a swap-in may feed it
    (:func:`lmscli.plan.candidates.candidates`)::

        before:  x  Enter(x) ... [forward and backward layers] ... body(Enter)
        after:   x  ... [forward and backward layers] ... Enter(x) body(Enter)
    """
    position = {i: k for k, i in enumerate(order)}
    moved: dict[int, list[int]] = {}  # position of the first reader -> Enters to run just before it
    for i in order:
        if not invariant_enter(view, i):
            continue
        first = min((position[j] for j in view.successors(i) if j in position), default=None)
        if first is not None and first > position[i] + 1:
            moved.setdefault(first, []).append(i)
    if not moved:
        return order
    gone = {i for group in moved.values() for i in group}
    out: list[int] = []
    for k, i in enumerate(order):
        for e in moved.get(k, ()):
            out.append(e)
        if i not in gone:
            out.append(i)
    return out


def _exit_waits(view: GraphView, active: set[int]) -> dict[int, tuple[int, ...]]:
    """Per ``Exit`` of a v1 while loop, the ``NextIteration`` ops of its frame that must run before it.

    The graph without its back edges lets an ``Exit`` run as soon as the loop condition has been
    computed once, before the body; a loop ends after its last iteration, whose values reach the
    condition through the ``NextIteration`` ops. Without this, a schedule ran a gradient loop's
    accumulated result, and the ops that read it, before the loop body::

        Merge -> Switch -> Exit -> ReluGrad        Merge -> Switch -> body -> NextIteration
                       +-> body -> NextIteration    ... then Exit -> ReluGrad
    """
    nexts: dict[str, list[int]] = {}
    exits: list[int] = []
    for i in active:
        op = view.ops[i]
        if op in ("NextIteration", "RefNextIteration") and view.frames[i]:
            nexts.setdefault(view.frames[i], []).append(i)
        elif op in ("Exit", "RefExit") and view.frames[i]:
            exits.append(i)
    return {i: tuple(nexts[view.frames[i]]) for i in exits if view.frames[i] in nexts}


_FED = re.compile(r"^_recv_(.+)_0$")  # an observed order's arrival of a fed value (lmscli.prove.scratch)


def arrival_name(placeholder: str) -> str:
    """The name an observed order gives the arrival of ``placeholder``'s fed value on the device
    (the name TensorFlow's session gives the feed's receive): ``_recv_NAME_0``."""
    return f"_recv_{placeholder}_0"


def fed_at_receive(view: GraphView, order, rank: dict[int, int]) -> dict[int, int]:
    """Per placeholder a real run feeds, its rank in the observed ``order``: where its value
    reached the device (``_recv_NAME_0``), not the step's start.

    A fed value takes memory on the device (a GPU, or the stand-in, from the session's master on
    the host) only when it arrives there, as the executor gets to its receive. A tanh RNN's 2 MiB
    input arrived just before its first reader, into a hole above what the loop had made; placed
    first, below that, the step was predicted to need 8 MiB, where the stand-in needed 5-6::

        order: ..., rnn/loop/MatMul_1, _recv_inputs_0, rnn/transpose, ...
        rank:  inputs -> the rank of _recv_inputs_0
    """
    found: dict[int, int] = {}
    for r, name in enumerate(order):
        match = _FED.match(name)
        node = view.index.get(match.group(1)) if match else None
        if node is not None and node not in rank and node not in found and view.ops[node] in PLACEHOLDER_OPS:
            found[node] = r
    return found


@timed("schedule")
def build_schedules(view: GraphView, fetches, flops: float = 15.7e12, mem_bandwidth: float = 900e9,
                    trace=None, memory_model: str = "executor") -> tuple[Schedule, ...]:
    """Order the ops that a step of ``fetches`` runs and describe their tensors, once per GPU.

    ``trace`` (a :class:`lmscli.grappler.Trace`) supplies Grappler's execution order and op times;
    without it, our roofline cost model and first-ready list scheduling are used. All schedules
    share one order; in the schedule of GPU ``d`` only ``d``'s ops take time and count as on the
    GPU (other GPUs run in parallel, as host ops do). One schedule, of the default GPU, when no op
    names another; schedules come sorted by device name.
    """
    roots = [view.index[name] for name in fetches]
    active = view.ancestors(roots)
    on_host = trace.on_host if trace is not None else frozenset()
    gpu_of = {i: None if view.names[i] in on_host else view.gpus[i] for i in active}
    cost = {}
    for i in active:
        if gpu_of[i] is None:
            cost[i] = 0
        elif trace is not None and view.names[i] in trace.micros:
            cost[i] = trace.micros[view.names[i]]
        else:
            cost[i] = op_time(view, i, flops, mem_bandwidth)
    rank = None
    if trace is not None:
        rank = {view.index[name]: r for r, name in enumerate(trace.order) if name in view.index}
        if trace.unmatched_first:
            rank.update(fed_at_receive(view, trace.order, rank))
            rank = {i: rank.get(i, -1) for i in active}
    order = first_ready_order(view, active, cost, rank)
    if memory_model == "executor":
        order = late_invariant_enters(view, order)
    trips = loop_trips(view)
    if trips:  # a loop body is scheduled once but runs its trip count times (the order is unchanged)
        cost = {i: c * trips.get(view.frames[i], 1) if view.frames[i] else c for i, c in cost.items()}
    devices = sorted({g for g in gpu_of.values() if g is not None}) or [DEFAULT_GPU]
    return tuple(_describe(view, order, cost, [gpu_of[i] == device for i in order], device,
                           _idle_variable_bytes(view, active, device)).with_memory_model(memory_model)
                 for device in devices)


def _idle_variable_bytes(view: GraphView, active, device: str) -> int:
    """The bytes of the variables on ``device`` that the step does not read. They are resident all
    the same: a session initializes or restores every variable of the graph, where it is placed
    (QA r47: a TensorFlow 2 SavedModel's other signatures hold 6.5 MiB of variables of their own;
    the step was predicted 24 MiB and needed 30, 31 MiB in use)."""
    active = set(active)
    return sum(variable_bytes(view, i) for i in range(len(view.names))
               if i not in active and view.ops[i] in VARIABLE_OPS and (view.gpus[i] or DEFAULT_GPU) == device)


STORAGE_OUTPUT = -1  # the output index of the tensor standing for what a loop keeps across iterations
MAX_PIECES = 1024  # allocations the allocator model places for one such tensor (more iterations: larger pieces)


def loop_storage(view: GraphView):
    """What the graph's v1 while loops keep across iterations (:func:`lmscli.model.loops.storage`),
    computed once per view with tensor facts."""
    cached = view.__dict__.get("_loop_storage")
    if cached is None:
        from lmscli.model import loops

        cached = loops.storage(view, loop_counts(view)) if any(view.frames) else ()
        view.__dict__["_loop_storage"] = cached
    return cached


def loop_trips(view: GraphView) -> dict[str, int]:
    """Per v1 while-loop frame, its iterations over one step (times those of the loops around
    it); frames whose count lms cannot read are left out (their body counts once)."""
    cached = view.__dict__.get("_loop_trips")
    if cached is None:
        from lmscli.model import loops

        counts = loop_counts(view)
        cached = {frame: total for frame in counts
                  if (total := loops.total_trips(view, frame, counts)) and total > 1}
        view.__dict__["_loop_trips"] = cached
    return cached


def loop_counts(view: GraphView):
    """Per v1 while-loop frame, its trip count as read from the graph
    (:func:`lmscli.model.loops.trip_counts`), once per view."""
    cached = view.__dict__.get("_loop_counts")
    if cached is None:
        from lmscli.model import loops

        cached = loops.trip_counts(view) if any(view.frames) else {}
        view.__dict__["_loop_counts"] = cached
    return cached


def _replaced_constants(view: GraphView, position: dict, folded) -> frozenset[int]:
    """The ``Const`` nodes whose every reader becomes a runtime constant (``folded``): once the
    runtime has folded them, nothing reads the ``Const`` and the optimizer drops it. A frozen
    graph's weights, ``Const -> Identity (read) -> Conv2D``, each held once, not twice (QA: a
    frozen CNN's constants were counted at 1.07 MiB, 549 KiB in the graph TensorFlow runs)."""
    out = set()
    for i in range(view.size):
        if view.ops[i] not in CONSTANT_OPS or i not in position:
            continue
        readers = {dst for dst, _port, _out in view.consumers[i] if dst in position}
        if readers and all(_all_outputs_folded(view, dst, position, folded) for dst in readers):
            out.add(i)
    return frozenset(out)


def _all_outputs_folded(view: GraphView, node: int, position: dict, folded) -> bool:
    read = {out for dst, _port, out in view.consumers[node] if dst in position}
    return bool(read) and all((node, out) in folded for out in read)


def _add_storage(tensors: list, inputs: list, pos: int, kept, position: dict, n: int, loop_end: int = -1,
                 reader_ends: tuple = (), value: bool = False, filled_in: str = "", entry_read: int = -1) -> None:
    """A tensor of ``kept.num_bytes`` made at ``pos`` (a push, a TensorArray write) and read by the
    pops or reads of the same stack or array (the last op of the step when none runs), and held
    at least to ``loop_end``, the last op of the loop it is filled in (outermost, for nested loops),
    and to ``reader_ends``, the last ops of the loops its readers run in::

        StackPushV2 (pos) --- 64 x element ---> StackPopV2      one tensor, output -1, 64 pieces

    The schedule runs a loop body once, in an order that may put one stack's push after another's
    pop; in a real step every stack of a loop is full when the loop ends, so each is held that long,
    and a gradient loop pops one element per iteration, so its stacks are still nearly full while
    its first iterations run whatever order the body once has: each is held to that loop's end
    (freed at its first pop, a tanh RNN's stacks were 1.7 MiB short of its 13.3 MiB peak).
    A stack nothing pops is held to the end of the step (it is a resource of the step); a
    TensorList nothing pops (``value``: an accumulator the gradient does not need) only to the
    end of its loop, when the list is dropped (QA: a GRU's 18.75 MiB of unpopped accumulators
    counted at a peak that never held them, 51 MiB predicted, 33 measured). ``filled_in``: the
    loop frame whose iterations make its pieces (:func:`lmscli.model.memmodel.in_pieces`).
    ``entry_read``: the last position reading the value a loop variable's stack starts with
    (:attr:`lmscli.model.loops.Storage.entry`): read until the stack's last reader has run, its
    buffer, which the first iteration pushed, is counted with it, not with the stack (QA r45: a
    TensorFlow 2 loop of residual blocks counted its input twice, its lower bound 24.90 MiB above
    the 23 MiB it needed on the stand-in).
    """
    readers = {position[r] for r in kept.readers if r in position and position[r] > pos}
    if readers and loop_end > pos:
        readers.add(loop_end)
    if readers:
        readers.update(end for end in reader_ends if end > pos)
    if not readers and value and loop_end > pos:
        readers = {loop_end}
    readers = tuple(sorted(readers)) or (n - 1,)
    num_bytes, least, pieces = kept.num_bytes, kept.least_bytes, kept.trips
    if entry_read >= readers[-1] and kept.trips > 1:  # (the first element is the entry value's buffer)
        num_bytes -= kept.num_bytes // kept.trips
        least = None if least is None else least - least // kept.trips
        pieces -= 1
    tid = len(tensors)
    tensors.append(SimTensor(tid, pos, STORAGE_OUTPUT, num_bytes, readers, max(1, min(pieces, MAX_PIECES)),
                             least, filled_in))
    for reader in readers:
        inputs[reader].append(tid)


def _describe(view: GraphView, order: list[int], cost: dict, on_gpu: list[bool], device: str,
              idle_variable_bytes: int = 0) -> Schedule:
    """The schedule of ``order`` as seen by one GPU: ``on_gpu`` marks its ops; the variables on it
    that the step does not read hold ``idle_variable_bytes`` besides."""
    position = {node: pos for pos, node in enumerate(order)}
    on_gpu = tuple(on_gpu)
    var_bytes = idle_variable_bytes + sum(variable_bytes(view, i) for pos, i in enumerate(order)
                                          if view.ops[i] in VARIABLE_OPS and on_gpu[pos])
    const_bytes = 0
    folded = view.runtime_constants
    tensors: list[SimTensor] = []
    inputs: list[list[int]] = [[] for _ in order]
    kept = {s.writer: s for s in loop_storage(view)}
    # Outermost loop frame -> its last position on this GPU. The ops of a loop placed elsewhere
    # (the Exit of a list a plan keeps on the host) end it in their own process: a traced step
    # listed one after the next loop and its gradient, and the lists this GPU drops at the
    # loop's end were held that long (QA r40 rnn3's plan, predicted 38 MiB where 22 was planned).
    loop_end: dict[str, int] = {}
    if kept:
        for pos, i in enumerate(order):
            if view.frames[i] and on_gpu[pos]:
                loop_end[view.outermost(view.frames[i])] = pos
    replaced = _replaced_constants(view, position, folded) if folded else frozenset()
    if folded:
        from lmscli.graph.constfold import repeated

        repeats = repeated(view, {(i, out) for i, out in folded if i in position})  # (the step's own)
    for pos, i in enumerate(order):
        if view.ops[i] in VARIABLE_OPS or i in replaced:
            continue
        if i in kept and on_gpu[pos]:
            end = loop_end.get(view.outermost(view.frames[i]), -1) if view.frames[i] else -1
            reader_ends = tuple(loop_end.get(view.outermost(view.frames[r]), -1) for r in kept[i].readers
                                if view.frames[r])
            entry = kept[i].entry
            entry_read = max((position[dst] for dst, _port, out in view.consumers[entry[0]]
                              if out == entry[1] and dst in position), default=-1) if entry else -1
            _add_storage(tensors, inputs, pos, kept[i], position, len(order), end, reader_ends,
                         view.ops[i].startswith("TensorList"), view.frames[i] or "", entry_read)
        is_const = view.ops[i] in CONSTANT_OPS
        by_output: dict[int, set[int]] = {}
        for dst, _port, output in view.consumers[i]:
            if dst in position:
                by_output.setdefault(output, set()).add(position[dst])
        for output, info in enumerate(view.outputs(i)):
            size = info.num_bytes or 0
            if size <= 0:
                continue
            readers = tuple(sorted(by_output.get(output, ())))
            if not (on_gpu[pos] or any(on_gpu[r] for r in readers)):
                continue
            if is_const:
                const_bytes += size
                continue
            if (i, output) in folded and on_gpu[pos]:  # the runtime's constant: resident (once for
                const_bytes += 0 if (i, output) in repeats else size  # equal copies), and what the op
                readers = ()  # still makes each step is read by none
            tid = len(tensors)
            tensors.append(SimTensor(tid, pos, output, size, readers))
            for reader in readers:
                inputs[reader].append(tid)
    compute = tuple(cost[i] if on_gpu[pos] else 0 for pos, i in enumerate(order))
    first_inputs = [view.data_inputs[i][0] if view.data_inputs[i] else (-1, 0) for i in order]
    reads_constant = tuple(on_gpu[pos] and src >= 0 and (view.ops[src] in CONSTANT_OPS or (src, output) in folded)
                           and src in position and on_gpu[position[src]]
                           for pos, (src, output) in enumerate(first_inputs))
    from lmscli.model.memmodel import PORT_FORWARDING_OPS

    ports = tuple(tuple((position.get(src, -1), out) for src, out in view.data_inputs[i])
                  if view.ops[i] in PORT_FORWARDING_OPS else () for i in order)
    if any(view.frames):
        from lmscli.model.loops import loop_merges, resident_pops

        pops = resident_pops(view)
        reads_constant = tuple(flag or (order[pos] in pops and on_gpu[pos]) for pos, flag in enumerate(reads_constant))
        carried = loop_merges(view, order)
    else:
        carried = ()
    return Schedule(
        nodes=tuple(order),
        names=tuple(view.names[i] for i in order),
        ops=tuple(view.ops[i] for i in order),
        levels=tuple(view.levels[i] for i in order),
        compute=compute,
        on_gpu=on_gpu,
        tensors=tuple(tensors),
        inputs=tuple(tuple(x) for x in inputs),
        variable_bytes=var_bytes,
        constant_bytes=const_bytes,
        device=device,
        reads_constant=reads_constant if any(reads_constant) else (),
        carried=carried if any(carried) else (),
        ports=ports if any(ports) else (),
    )
