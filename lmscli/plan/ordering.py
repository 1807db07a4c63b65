"""Ops that free more than they allocate, run before the sibling ops that allocate (control edges).

The executor picks among the ops that are ready in its own order. In a backward pass it often
runs a convolution's input gradient before its filter gradient: both read the gradient coming in,
but only the filter gradient reads the layer's input, which dies with it. Run first, the input
gradient holds its (large) output while the layer's input is still live; run second, it finds the
input gone. A 3D U-Net 64³ held 16 MiB more at that point than the step needed::

    before:  dy -> dx = BackpropInput(dy)     [x 16 MiB, dy 8, dx 16 live]
                   dW = BackpropFilter(x, dy) [x dies]
    after:   dy -> dW = BackpropFilter(x, dy) [x dies: 16 MiB free]
                   dx = BackpropInput(dy)     [dy 8, dx 16 live]    (control edge dW -> dx)

:func:`freeing_first` finds such moves in a schedule: an op ``B`` whose inputs all exist before
an earlier position ``p``, that frees there buffers no op from ``p`` on reads but it (its
inputs' last read, forwarded copies included) larger than the outputs it makes, is moved to
just before the op at ``p`` (at most :data:`WINDOW` positions earlier, or, for an optimizer's
update that makes nothing, as early as its gradient); the op there waits for it. The stand-in's
executor can leave updates to the end::

    before:  dW9 ... dW1 [dW9..dW1 all held] ... update9 ... update1
    after:   dW9 update9 ... dW1 update1       (control edges update9 -> the op after dW9, ...)

A plan keeps the moves as ``serialize`` chains ``(B, op at p)``, emitted as control edges and
simulated by :func:`applied`. Ops in while loops or cond branches, control-flow ops, host ops,
variables and placeholders (a fed placeholder's control input is lost; QA: a stand-in's order ran
a label placeholder just before a float16 cast of the images, which was moved ahead of it) and
ops Grappler's optimizations remove are never moved nor made to wait; of the stateful ops
only an optimizer's update is moved (it frees the weight gradient it reads), and no op is moved
past one that writes a variable it reads or reads (or writes) one it writes. Results do not
change: the same kernels run on the same inputs, one after the other instead of the other way
round.
"""

from __future__ import annotations

from lmscli.graph.graphview import CONSTANT_OPS, CONTROL_FLOW_OPS, UNWAITING_OPS, VARIABLE_OPS, GraphView
from lmscli.graph.opdefs import StatefulOps
from lmscli.model.memmodel import FORWARDING_OPS, roots
from lmscli.plan.recompute import VARIABLE_READS, variable_of
from lmscli.model.schedule import Schedule

WINDOW = 8  # how many positions earlier an op may be moved (an update making nothing: any)
# The only stateful ops moved: an optimizer's update, past ops that touch none of its variables
# (it frees the weight gradient it reads). Random ops and other stateful ops keep their place.
TRAINING_OPS = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")
MIN_GAIN = 64 << 10  # bytes an op must free beyond what it makes to be worth moving


def freeing_first(view: GraphView, schedule: Schedule, fused: frozenset = frozenset(),
                  fixed: frozenset = frozenset()) -> tuple[tuple[str, str], ...]:
    """The moves for ``schedule``: ``(B, A)`` pairs of op names, B to run just before A (which it
    precedes in no data or control path today), in schedule order of A; each op moved at most once
    and made to wait at most once. Ops named in ``fixed`` are neither (the optimizer guard found a
    move of theirs changing what Grappler's optimizations make of the graph)."""
    n = len(schedule)
    index = {name: k for k, name in enumerate(schedule.names)}
    root = roots(schedule) if schedule.shares else tuple(range(len(schedule.tensors)))  # -1: resident
    uses: dict[int, set] = {}  # buffer -> the positions making or reading any tensor in it
    for t in schedule.tensors:
        uses.setdefault(root[t.id], set()).update((t.producer, *t.consumers))
    last = {r: max(u) for r, u in uses.items()}
    before_last = {r: max(u - {last[r]}, default=-1) for r, u in uses.items()}
    size = {t.id: t.num_bytes for t in schedule.tensors}
    size[-1] = 0

    def movable(k: int) -> bool:
        return _movable(view, schedule, k, fused, fixed)

    stateful = StatefulOps()
    variables: dict[int, tuple[frozenset, frozenset]] = {}

    def touched(k: int) -> tuple[frozenset, frozenset]:
        """(variables the op at ``k`` reads or writes, those it may write)."""
        if k not in variables:
            node = schedule.nodes[k]
            found = frozenset(v for v in (variable_of(view, src) for src, _ in view.data_inputs[node]) if v is not None)
            op = schedule.ops[k]
            if op in VARIABLE_READS or op in ("Identity", "Snapshot"):
                writes = frozenset()
            elif stateful(op):
                writes = found
            else:  # (a reference variable taken as it is is written in place by ops not marked stateful)
                writes = frozenset(src for src, _ in view.data_inputs[node]
                                   if view.ops[src] in VARIABLE_OPS and view.ops[src] != "VarHandleOp")
            variables[k] = (found, writes)
        return variables[k]

    def passes(b: int, k: int) -> bool:
        """May the op at ``b`` run before the op at ``k`` (no variable one writes the other touches)?"""
        (b_all, b_writes), (k_all, k_writes) = touched(b), touched(k)
        return not (b_writes & k_all) and not (k_writes & b_all)

    moved: set[int] = set()
    waiting: set[int] = set()
    out: list[tuple[int, int]] = []
    for b in range(n):
        if not movable(b) or (stateful(schedule.ops[b]) and not schedule.ops[b].startswith(TRAINING_OPS)):
            continue
        freeing = {r for r in {root[tid] for tid in schedule.inputs[b]} if r >= 0 and last.get(r) == b}
        made = sum(size[tid] for tid in schedule.outputs[b] if root[tid] == tid)
        if sum(size[r] for r in freeing) - made < MIN_GAIN:
            continue
        ready = max(_needs(schedule, b, view, index), default=-1) + 1

        def gain(k: int, freeing=freeing, made=made) -> int:
            # (what it frees there: the buffers no other op reads from ``k`` on)
            return sum(size[r] for r in freeing if before_last[r] < k) - made

        # The earliest place within reach, after everything it reads, before an op that makes a
        # buffer (nothing to gain ahead of ops that only forward or free), where it frees enough.
        # (an optimizer's update that makes nothing may go as far back as its gradient: the
        # executor ran a residual MLP's first nine at the end of the step, nine weight gradients
        # held through the backward pass)
        update = made == 0 and schedule.ops[b].startswith(TRAINING_OPS)
        start = ready if update else max(ready, b - WINDOW)
        # (never past an op that writes a variable it touches, or touches one it writes)
        start = next((k + 1 for k in range(b - 1, start - 1, -1) if not passes(b, k)), start)
        p = next((k for k in range(start, b)
                  if k not in moved and k not in waiting and movable(k) and gain(k) >= MIN_GAIN
                  and any(root[tid] == tid and size[tid] for tid in schedule.outputs[k])), None)
        if p is None:
            continue
        moved.add(b)
        waiting.add(p)
        out.append((b, p))
    out.sort(key=lambda m: m[1])
    return tuple((schedule.names[b], schedule.names[p]) for b, p in out)


def _movable(view: GraphView, schedule: Schedule, k: int, fused: frozenset, fixed: frozenset) -> bool:
    """May the op at ``k`` be moved or made to wait? A GPU op outside loops and cond branches that
    is not control flow, a constant, a variable, a placeholder or a forwarding op, that Grappler's
    optimizations keep (not in ``fused``) and that ``fixed`` does not name."""
    node = schedule.nodes[k]
    op = schedule.ops[k]
    return (schedule.on_gpu[k] and op not in CONTROL_FLOW_OPS and op not in CONSTANT_OPS
            and op not in UNWAITING_OPS and op not in FORWARDING_OPS and schedule.names[k] not in fixed
            and node not in fused and view.names[node] not in fused
            and not view.in_loop(node) and not view.conditional(node))


def applied(schedule: Schedule, chains, view: GraphView | None = None) -> Schedule:
    """``schedule`` with each chain's ops run in the chain's order: an op that comes later than the
    op after it in a chain is moved to just before that op (the moves of :func:`freeing_first`),
    when what it reads (and, given ``view``, what it waits for) is made before that op; else, given
    ``view``, the op after it waits, and with it every op between the two that depends on it (the
    delays of :func:`later_branches`; a ``--serialize`` chain of one level's ops, whose inputs may
    be made in between), unless the first depends on it; without ``view`` the two stay as they are."""
    order, changed, _skipped = _apply(schedule, chains, view)
    return schedule.reordered(order) if changed else schedule


def feasible(schedule: Schedule, chains, view: GraphView) -> tuple[tuple[str, ...], ...]:
    """``chains`` without the pairs :func:`applied` leaves out because the first op depends on the
    op after it, through the graph or the chains' edges before it (the control edge would close
    a cycle), each chain split there. A plan keeps only these: the order it was planned in did
    not honour the others, and the rewrite would refuse their edges as a cycle::

        X waits for Y (a delay), Y depends on X through edges added before: left out"""
    _order, _changed, skipped = _apply(schedule, chains, view)
    if not skipped:
        return tuple(tuple(c) for c in chains)
    out: list[tuple[str, ...]] = []
    for k, chain in enumerate(chains):
        part = [chain[0]]
        for j, then in enumerate(chain[1:]):
            if (k, j) in skipped:
                if len(part) > 1:
                    out.append(tuple(part))
                part = [then]
            else:
                part.append(then)
        if len(part) > 1:
            out.append(tuple(part))
    return tuple(out)


def _apply(schedule: Schedule, chains, view: GraphView | None):
    """(order, changed, skipped): :func:`applied`'s order, whether it differs from the schedule's,
    and the ``(chain, pair)`` indices of the pairs left out (a cycle)."""
    skipped: set[tuple[int, int]] = set()
    order = list(range(len(schedule)))
    index = {name: k for k, name in enumerate(schedule.names)}
    added: dict[int, list[int]] = {}  # the chains' edges so far: op -> the ops it now waits for
    changed = False
    for c, chain in enumerate(chains):
        for j, (first, then) in enumerate(zip(chain, chain[1:])):
            a, b = index.get(first), index.get(then)
            if a is None or b is None:
                continue
            at_a, at_b = order.index(a), order.index(b)
            if at_a > at_b:
                if all(order.index(k) < at_b for k in _needs(schedule, a, view, index) + added.get(a, [])):
                    order.insert(at_b, order.pop(at_a))
                    changed = True
                elif view is not None:
                    waited = _waited(schedule, view, index, order, at_b, at_a, added)
                    if waited is None:  # (the first depends on the op after it: the edge would close a cycle)
                        skipped.add((c, j))
                        continue
                    order, changed = waited, True
            added.setdefault(b, []).append(a)
    return order, changed, skipped


def _waited(schedule: Schedule, view: GraphView, index: dict, order: list, at_b: int, at_a: int,
            added: dict) -> list | None:
    """``order`` with the op at ``order[at_b]``, and every op up to ``order[at_a]`` that depends on
    it (by the graph's edges and the ``added`` ones), run after ``order[at_a]`` (each group keeping
    its own order); None if ``order[at_a]`` depends on it (a cycle)."""
    waiting = {order[at_b]}
    for k in order[at_b + 1:at_a + 1]:
        if any(n in waiting for n in _needs(schedule, k, view, index) + added.get(k, [])):
            waiting.add(k)
    if order[at_a] in waiting:
        return None
    span = order[at_b:at_a + 1]
    return order[:at_b] + [k for k in span if k not in waiting] + [k for k in span if k in waiting] + order[at_a + 1:]


MAX_BRANCHES = 8  # readers of the step's inputs tried as the first op of a branch
MAX_WAITS = 64  # control edges one branch's first op may take (else it is left where it is)


def later_branches(view: GraphView, schedule: Schedule, fused: frozenset = frozenset(),
                   fixed: frozenset = frozenset(), budget: int | None = None) -> tuple[tuple[str, str], ...]:
    """Delays for ``schedule``: ``(Y, X)`` pairs, X (an op reading a placeholder: the first op of
    the work on one input) to wait for each Y, the ops after it that do not depend on it and whose
    results only work that depends on it reads: the end of the other work. Two micro-batches of
    gradient accumulation are independent until their gradients are summed; run interleaved, as
    the executor runs them, both micro-batches' activations are held at once::

        before:  fwd1 fwd2 bwd1 bwd2 -> sum               (activations of 1 and 2 live together)
        after:   fwd1 bwd1 (dW1 ...) - - -> fwd2 bwd2 -> sum  (fwd2's first op waits for each dW1)

    (waiting for one op of the other work is not enough: the executor leaves weight gradients,
    off the critical path, for later, and with them the activations they read; QA: a wait for the
    first micro-batch's first-layer gradient was modelled at 8.3 MiB and needed 14 to 21.) Each
    reader X of a placeholder (at most :data:`MAX_BRANCHES`, in schedule order) is tried; its
    delay is kept when the schedule it makes (:func:`applied`) has a peak by the executor model
    at least 1% and :data:`MIN_GAIN` lower, with at most :data:`MAX_WAITS` edges. X and the ops it
    waits for may take part in a move (not in loops or cond branches, not control flow, variables,
    placeholders, stateful ops or what Grappler's optimizations remove, not named in ``fixed``).
    Results do not change: the same kernels run on the same inputs, in another order.
    ``budget``: stop once the peak is under it."""
    from lmscli.graph.graphview import PLACEHOLDER_OPS
    from lmscli.model.simulator import simulate

    n = len(schedule)
    index = {name: k for k, name in enumerate(schedule.names)}
    stateful = StatefulOps()

    def movable(k: int) -> bool:
        return _movable(view, schedule, k, fused, fixed) and not stateful(schedule.ops[k])

    fed = {k for k in range(n) if schedule.ops[k] in PLACEHOLDER_OPS}
    readers = [k for k in range(n) if movable(k) and fed & set(_needs(schedule, k, view, index))][:MAX_BRANCHES]
    if len(readers) < 2:
        return ()
    chains: list[tuple[str, str]] = []
    waits: dict[str, list[str]] = {}  # the delays kept so far: op -> the ops it waits for
    current = schedule
    peak = simulate(current, detail=False).peak_bytes
    for reader in readers:
        if budget is not None and peak <= budget:
            break
        pos = {name: k for k, name in enumerate(current.names)}
        # (what each op needs, the kept delays included: an op the next delay may wait for never
        # depends on its waiter through one of them)
        needs = [_needs(current, k, view, pos) + [pos[w] for w in waits.get(current.names[k], ())]
                 for k in range(len(current))]
        readers_of: dict[int, list[int]] = {}
        for k, ks in enumerate(needs):
            for m in ks:
                readers_of.setdefault(m, []).append(k)
        x = pos[schedule.names[reader]]
        after = {x}  # what depends on X
        for k in range(x + 1, len(current)):
            if any(m in after for m in needs[k]):
                after.add(k)
        ends = [k for k in range(x + 1, len(current)) if k not in after and readers_of.get(k)
                and all(r in after for r in readers_of[k]) and movable(index[current.names[k]])]
        if not ends or len(ends) > MAX_WAITS:
            continue
        pairs = [(current.names[k], current.names[x]) for k in ends]
        trial = applied(schedule, chains + pairs, view)
        got = simulate(trial, detail=False).peak_bytes
        if got <= peak - max(MIN_GAIN, peak // 100):
            peak, current = got, trial
            chains.extend(pairs)
            waits.setdefault(schedule.names[reader], []).extend(y for y, _x in pairs)
    return tuple(chains)


def _needs(schedule: Schedule, k: int, view: GraphView | None, index: dict) -> list[int]:
    """Positions of what the op at ``k`` reads (counted tensors; with ``view``, every data and
    control input of the schedule, loops' back edges aside)."""
    out = [schedule.tensors[tid].producer for tid in schedule.inputs[k]]
    if view is not None:
        node = schedule.nodes[k]
        for src in [s for s, _ in view.data_inputs[node]] + list(view.control_inputs[node]):
            name = view.names[src]
            if name in index and not view.is_back_edge(src, node):
                out.append(index[name])
    return out
