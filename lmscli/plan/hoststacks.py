"""Gradient stacks of v1 while loops kept in host memory.

The gradient of a v1 loop saves what its backward pass needs from each forward iteration on a
stack: a ``StackPushV2`` in the forward loop, a ``StackPopV2`` in the gradient loop. A stack holds
``trips x`` the pushed value from the first push to the last pop (:mod:`lmscli.model.loops`), and on
recurrent nets over long sequences these stacks are the peak. Their values are made inside a loop
frame, one per iteration, so they cannot be swapped tensor by tensor; the stack as a whole can
live on the host. Its ``StackV2`` and every op that uses its handle (pushes, pops, closes) are
placed on the host's CPU: each push then copies one iteration's value out of the GPU, each pop
copies one back, and what the stack keeps is host memory::

    before (all on the GPU)                      after
    h_t ──> StackPushV2 ─┐                       h_t ──> StackPushV2 @CPU ─┐  (copied out per iteration)
          stack: trips x h_t (GPU)                     stack: trips x h_t (host)
    grad <── StackPopV2 <┘                       grad <── StackPopV2 @CPU <┘  (copied in per iteration)

The ``Enter`` nodes that carry the handle into the loops stay where they are (a handle is a small
host tensor). TensorFlow's own ``swap_memory`` of a loop (an attribute of the pushes) does the
same only on a GPU, only for values over 2 KiB other than the first pushed, and only while the
GPU allocator is more than 70% full at that push (a heuristic inside the kernel), so neither its
effect nor a proof on the CPU stand-in can be planned for. Placement is unconditional, works on
the stand-in (its host is another process) and does not change a single computed bit.

A TensorFlow 2 loop (a ``While`` lowered by lms, see :mod:`lmscli.graph.inline`) keeps what its
gradient needs in TensorList accumulators: ``TensorListPushBack`` in the forward loop,
``TensorListPopBack`` in the gradient loop. A list is a value, not a handle: it passes from
iteration to iteration through the loop's ``Enter``, ``Merge``, ``Switch``, ``NextIteration`` and
``Exit``, and a list that changes device is copied whole. So the whole path of the list moves to
the host, from the ``EmptyTensorList`` that makes it to the last pop: each push then copies one
iteration's value out (its element, a GPU tensor, is an input of a host op) and each pop copies
one back, as for a stack, and the list never crosses devices (the loop's predicate, a bool, does)::

    before (all on the GPU)                           after
    EmptyTensorList -> Enter -> Merge -> Switch       the same ops, on the host
      -> PushBack(list, h_t) -> NextIteration ...     h_t (GPU) --copied out--> PushBack (host)
      -> Exit -> Enter -> ... -> PopBack              PopBack (host) --copied in--> its GPU readers

(QA: a tf_keras LSTM and GRU in a v1 graph needed 22 MiB on the stand-in, 14 of it in their
accumulators, and no plan reached below the need; with the accumulators on the host it trained,
bit-identically, under 19 MiB.)

A list that no op reads (pushed, never popped, its ``Exit`` read by nothing: TensorFlow 2
accumulates every intermediate of a loop body while Keras builds a layer) need not go anywhere:
its pushes become Identities of the list, which then stays empty (:func:`droppable`)::

    before                                            after
    h_t ──> PushBack(list, h_t) ──> NextIteration     list ──> Identity "PushBack" ──> NextIteration
            (trips x h_t kept to the loop's end)              (nothing kept; h_t freed when read)

Not hosted: TensorArrays, lists anything but pushes and pops read (a ``TensorListStack`` or
``SetItem``: a loop's outputs), stacks inside cond branches
(also a cond inside the loop, whose ``Enter`` and ``Switch`` pass the handle to the pop), and
stacks whose handle reaches other ops or passes through an op colocated with another (a resource
handle's readers are placed with it, on the host, against their ``_class``: TensorFlow refuses
to place that graph)::

    f_acc (StackV2) --> Switch/Enter (_class: loc:@while/mul_2) --> Switch --> StackPopV2
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lmscli.errors import PlanError
from lmscli.graph.graphview import GraphView
from lmscli.model.schedule import STORAGE_OUTPUT, Schedule, loop_storage

STACK_OPS = frozenset({"StackV2"})
HANDLE_USERS = frozenset({"StackPushV2", "StackPopV2", "StackCloseV2"})
PASS_THROUGH = frozenset({"Enter", "RefEnter", "Identity", "Switch", "Merge", "NextIteration", "Exit"})
LIST_MAKERS = frozenset({"EmptyTensorList", "TensorListReserve"})  # a TensorFlow 2 loop's accumulator
LIST_USERS = frozenset({"TensorListPushBack", "TensorListPopBack"})  # (output 0: the list, changed)


@dataclass(frozen=True)
class Hostable:
    """Gradient stacks that can be placed on the host together (view indices): one stack, or
    several that keep the same buffers (a loop variable pushed once as an op's output and once as
    the next iteration's input): moving only one of them would free nothing."""

    stacks: tuple[int, ...]  # the StackV2 nodes
    pushes: tuple[int, ...]
    pops: tuple[int, ...]
    users: tuple[int, ...]  # every op that uses a handle (pushes, pops, closes): they move with it
    num_bytes: int  # what the stacks keep over one step
    copy_bytes: int  # what their pushes copy out over one step (as much again comes back in)
    trips: int  # iterations of the loop that pushes (the gradient loop pops as many)
    dropped: bool = False  # accumulators no op reads: their pushes are taken out, nothing is kept

    @property
    def ops(self) -> tuple[int, ...]:
        return self.stacks + self.users


def hostable(view: GraphView, leave_out=frozenset(), keep=frozenset()) -> tuple[Hostable, ...]:
    """The graph's gradient stacks that keep memory across iterations and can move to the host,
    in units that move together, largest first (ties: graph order); accumulators no op reads are
    marked to be dropped (:func:`droppable`). ``leave_out``: node names the step does not run;
    ``keep``: node names whose values are fetched (never dropped)."""
    if not any(view.frames):
        return ()
    from lmscli.graph.loopvalues import pushes_and_pops

    storage = [s for s in loop_storage(view) if s.kind == "stack"]
    if not storage:
        return ()
    stack_of: dict[int, int] = {}  # push -> its stack
    members: dict[int, tuple[list[int], list[int]]] = {}
    for stack, (pushes, pops) in pushes_and_pops(view).items():
        members[stack] = (pushes, pops)
        for push in pushes:
            stack_of[push] = stack
    tags = view.branch_tags()
    colocated = _colocation_targets(view)
    units: list[tuple[set, int, int, int]] = []  # (stacks, bytes kept, bytes copied, trips)
    for s in storage:
        joined = {stack_of[w] for w in (s.writer, *s.sharers) if w in stack_of}
        if not joined:
            continue
        copied = sum(s.trips * _pushed_bytes(view, w) for w in (s.writer, *s.sharers))
        merged = [u for u in units if u[0] & joined]
        for u in merged:
            units.remove(u)
        units.append((joined.union(*(u[0] for u in merged)), s.num_bytes + sum(u[1] for u in merged),
                      copied + sum(u[2] for u in merged), max([s.trips] + [u[3] for u in merged])))
    found = []
    for stacks, num_bytes, copy_bytes, trips in units:
        users: set[int] = set()
        passers: set[int] = set()
        for stack in stacks:
            path = handle_path(view, stack) if view.ops[stack] in STACK_OPS | LIST_MAKERS else None
            if path is None:
                users = None
                break
            users.update(path[0])
            passers.update(path[1])
        if users is None or any(view.ops[i] in ("Switch", "RefSwitch") or "_class" in view.node_defs[i].attr
                                for i in passers):
            continue
        ops = tuple(sorted(stacks)) + tuple(sorted(users))
        moving = set(ops)
        if (any(tags[i] for i in ops) or any(view.on_host(i) for i in ops)
                or any(view.names[i] in leave_out or colocated.get(view.names[i], set()) - moving for i in ops)):
            continue
        pushes = tuple(sorted(p for st in stacks for p in members[st][0]))
        pops = tuple(sorted(p for st in stacks for p in members[st][1]))
        dropped = droppable(view, stacks, pushes, pops, users) and not any(view.names[i] in keep for i in ops)
        found.append(Hostable(tuple(sorted(stacks)), pushes, pops, tuple(sorted(users)), num_bytes, copy_bytes, trips,
                              dropped))
    return tuple(sorted(found, key=lambda h: (-h.num_bytes, h.stacks)))


def droppable(view: GraphView, lists, pushes, pops, users) -> bool:
    """Are ``lists`` TensorList accumulators that no op reads, whose pushes can be taken out?

    While Keras builds a recurrent layer in a graph, TensorFlow 2's ``While`` accumulates every
    intermediate of the loop body for a gradient, and the gradient pops only those it needs (QA: a
    tf_keras SimpleRNN pushed five 48 KiB values per iteration and popped one). The others are kept
    to the loop's end by the GPU and leave holes between the kept ones. Such a list (from its
    ``EmptyTensorList`` through ``Enter``, ``Merge``, ``Switch``, ``NextIteration`` and ``Exit`` to no
    reader: :func:`list_path`) changes no result when its pushes become Identities of the list
    (:func:`lmscli.emit.rewriter.drop_pushes`). Only when every pushed value has another reader:
    the rewrite then removes no op from the step (a value made only to be pushed stays made)."""
    if pops or not pushes or not all(view.ops[i] in LIST_MAKERS for i in lists):
        return False
    if any(view.ops[i] not in PASS_THROUGH and view.ops[i] != "TensorListPushBack" for i in users):
        return False
    for push in pushes:
        inputs = view.data_inputs[push]
        if len(inputs) < 2:
            return False
        src, output = inputs[1]
        if not any(dst != push and out == output and view.ops[dst] not in LIST_USERS for dst, _p, out in view.consumers[src]):
            return False
    return True


def named(view: GraphView, stacks) -> tuple[Hostable, ...]:
    """The :class:`Hostable` units a plan's stacks on the host make
    (:class:`lmscli.plan.document.PlannedHostStack`); raises PlanError for a stack this graph does not have
    or cannot host, or a unit the plan moves only part of."""
    if not stacks:
        return ()
    unit_of = {stack: h for h in hostable(view) for stack in h.stacks}
    asked = set()
    for planned in stacks:
        i = view.index.get(planned.stack)
        if i is None or i not in unit_of:
            raise PlanError(f"the plan keeps stack {planned.stack!r} on the host, which is not a gradient stack "
                            "of this graph's loops that can move there")
        asked.add(i)
    out = []
    for h in sorted({unit_of[i] for i in asked}, key=lambda h: h.stacks):
        missing = [view.names[i] for i in h.stacks if i not in asked]
        if missing:
            raise PlanError(f"the plan keeps {view.names[h.stacks[0]]!r} on the host but not {missing[0]!r}, "
                            "which keeps the same tensors: they must move together")
        out.append(h)
    dropped = {view.index[p.stack] for p in stacks if p.dropped}
    for k, h in enumerate(out):
        if dropped & set(h.stacks) and not h.dropped:
            raise PlanError(f"the plan drops the pushes of {view.names[h.stacks[0]]!r}, but the graph reads that "
                            "list (or a value only it reads): only accumulators no op reads can be dropped")
        if h.dropped and not dropped & set(h.stacks):
            out[k] = replace(h, dropped=False)  # (a plan may keep them on the host instead)
    return tuple(out)


def hosting(schedule: Schedule, view: GraphView, stacks) -> Schedule:
    """``schedule`` with ``stacks`` on the host: what they keep leaves GPU memory, and the copies
    their pushes and pops make (one iteration's value each, each way) are work for the link,
    hidden behind the loop's compute (all its iterations) as far as it lasts
    (:attr:`Schedule.stack_copies`). What dropped lists keep leaves it too, with no copies."""
    if not stacks:
        return schedule
    position = {node: k for k, node in enumerate(schedule.nodes)}
    pushes = {p for h in stacks for p in h.pushes}  # (dropped or hosted, the GPU keeps nothing)
    drop = {t.id for t in schedule.tensors
            if t.output == STORAGE_OUTPUT and schedule.nodes[t.producer] in pushes}
    frame_compute: dict[str, int] = {}
    for k, node in enumerate(schedule.nodes):
        frame = view.frames[node]
        if frame:
            frame_compute[frame] = frame_compute.get(frame, 0) + schedule.compute[k]
    last_read = {schedule.nodes[t.producer]: t.consumers[-1]  # push -> when what it keeps is last read
                 for t in schedule.tensors if t.id in drop and t.consumers}
    copies: dict[tuple[str, str], list[int]] = {}  # (frame, direction) -> [position, bytes]
    held = []
    for h in stacks:
        ran_pushes = [position[p] for p in h.pushes if p in position]
        ran_pops = [position[p] for p in h.pops if p in position]
        if not ran_pushes or h.dropped:
            continue
        for ops, direction, pick in ((ran_pushes, "out", max), (ran_pops, "in", min)):
            if not ops:
                continue
            frame = view.frames[schedule.nodes[ops[0]]]
            entry = copies.setdefault((frame, direction), [pick(ops), 0])
            entry[0] = pick(entry[0], pick(ops))
            entry[1] += h.copy_bytes
        kept_until = max((last_read[p] for p in h.pushes if p in last_read),
                         default=max(ran_pops, default=len(schedule) - 1))
        held.append((min(ran_pushes), kept_until, h.num_bytes))
    # (the schedule's compute of a loop's ops already counts every iteration)
    stack_copies = tuple(sorted((pos, num_bytes, frame_compute.get(frame, 0))
                                for (frame, _direction), (pos, num_bytes) in copies.items()))
    return replace(schedule.without_tensors(drop), stack_copies=schedule.stack_copies + stack_copies,
                   host_held=schedule.host_held + tuple(sorted(held)))


def at_peak(schedule: Schedule, live_at_peak) -> set[int]:
    """View indices of the pushes whose stacks are live at a simulated peak."""
    out = set()
    for kind, tid, _bytes in live_at_peak:
        t = schedule.tensors[tid]
        if kind == "tensor" and t.output == STORAGE_OUTPUT:
            out.add(schedule.nodes[t.producer])
    return out


def _pushed_bytes(view: GraphView, push: int) -> int:
    inputs = view.data_inputs[push]
    return view.tensor_bytes(*inputs[1]) if len(inputs) > 1 else 0


def _colocation_targets(view: GraphView) -> dict[str, set[int]]:
    """Names that nodes other than stack ops ask to be colocated with (``_class: loc:@name``), with
    those nodes: such a node would have to follow its target to the host, unless it moves too (a
    lowered loop's ``Identity`` colocated with the ``Merge`` of the list it passes on; the stack
    ops' own ``_class``, which names the value saved, is dropped when they move)."""
    out: dict[str, set[int]] = {}
    for i, node in enumerate(view.node_defs):
        if node.op in STACK_OPS or node.op in HANDLE_USERS or "_class" not in node.attr:
            continue
        for entry in node.attr["_class"].list.s:
            text = entry.decode(errors="replace")
            if text.startswith("loc:@"):
                out.setdefault(text[5:], set()).add(i)
    return out


def handle_users(view: GraphView, stack: int) -> tuple[int, ...] | None:
    """The ops that use ``stack``'s handle, through the ops that pass it on (Enter, Identity, ...);
    None when one of them is not a push, pop or close (it would have to move too)."""
    path = handle_path(view, stack)
    return None if path is None else path[0]


def handle_path(view: GraphView, stack: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(users, passers)``: the ops that move with ``stack`` (the pushes, pops and closes of its
    handle) and the ops that pass its handle on to them and stay (Enter, Switch, Identity, ...);
    None when the handle reaches any other op. For a TensorList (``stack`` an ``EmptyTensorList``)
    see :func:`list_path`."""
    if view.ops[stack] in LIST_MAKERS:
        path = list_path(view, stack)
        return None if path is None else (path, ())
    users, passers, seen, todo = set(), set(), {stack}, [stack]
    while todo:
        i = todo.pop()
        for dst, _port, _output in view.consumers[i]:
            if dst in seen:
                continue
            seen.add(dst)
            if view.ops[dst] in PASS_THROUGH:
                todo.append(dst)
                passers.add(dst)
            elif view.ops[dst] in HANDLE_USERS:
                users.add(dst)
            else:
                return None
    return tuple(sorted(users)), tuple(sorted(passers))


def list_path(view: GraphView, maker: int) -> tuple[int, ...] | None:
    """Every op the TensorList that ``maker`` makes passes through or is pushed to and popped
    from (its data edges: the list in, the list out), all of which move with it; None when the
    list reaches an op that is neither."""
    moved, todo = set(), [maker]
    while todo:
        i = todo.pop()
        for dst, _port, output in view.consumers[i]:
            if output < 0 or dst in moved:
                continue  # (a control edge, or an op met before)
            if output != 0 and view.ops[i] in LIST_USERS | {"Merge"}:
                continue  # (a pop's element, a Merge's value_index: tensors read where they are)
            if view.ops[dst] in PASS_THROUGH or view.ops[dst] in LIST_USERS:
                moved.add(dst)
                todo.append(dst)
            else:
                return None
    return tuple(sorted(moved))
