"""What v1 while loops keep across iterations: trip counts, gradient stacks and TensorArrays.

The schedule runs a loop body once. What one iteration makes and drops is counted that way, but
two things grow with the number of iterations and outlive the loop:

* **gradient stacks**: the gradient of a loop saves each iteration's forward values with a
  ``StackPushV2`` in the forward loop and takes them back with a ``StackPopV2`` in the gradient
  loop; a stack holds ``trips x`` the pushed tensor from its pushes to its pops. A TensorFlow 2
  loop (a ``While`` lowered by lms, see :mod:`lmscli.graph.inline`) does the same with TensorList
  accumulators (``TensorListPushBack``, ``TensorListPopBack``);
* **TensorArrays**: a ``TensorArrayWriteV3`` in a loop stores one element per iteration until the
  array is read, gathered or concatenated after it (``dynamic_rnn``'s outputs); a
  ``TensorArrayScatterV3`` before a loop stores a whole tensor, split, until the loop has read it
  (``dynamic_rnn``'s inputs, and the gradient of its outputs).

:func:`storage` finds both and sizes them with the loop's trip count, which :func:`trip_counts`
reads from the loop condition: ``Less(i, n)`` (or a ``LogicalAnd`` of such tests, as
``maximum_iterations`` makes) with ``n`` computed outside the loop, from a constant or, failing
that, by running the few ops it depends on (shapes of the placeholders, known statically). In a
TensorFlow 2 loop ``n`` is itself a loop variable the body passes on unchanged: its value is the
one it enters the loop with. A
gradient loop runs as many iterations as the loop whose stacks it pops. A loop whose count cannot
be read is left at one iteration, and :func:`notes` says so::

    forward loop (64 iterations)            gradient loop (64 iterations)
    h_t = cell(x_t, h_t-1)                  dh = ...
    StackPushV2(stack, gates_t)   ------->  gates = StackPopV2(stack)
                      held: 64 x gates, from the first push to the last pop
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lmscli.graph.graphview import GraphView
from lmscli.graph.loopvalues import Evaluator, invariant, pushes_and_pops, source

WRITE_OPS = frozenset({"TensorArrayWriteV3", "TensorArrayScatterV3"})
READ_OPS = frozenset({"TensorArrayReadV3", "TensorArrayGatherV3", "TensorArrayConcatV3"})
COMPARISONS = {"Less": 0, "LessEqual": 1, "Greater": 0, "GreaterEqual": 1}  # counter < n: n trips


@dataclass(frozen=True)
class Loop:
    frame: str
    trips: int | None  # iterations of one run of the loop; None: unknown (counted as 1)
    how: str  # where the count comes from, or why it is unknown


@dataclass(frozen=True)
class Storage:
    """Bytes a loop keeps across iterations: made by ``writer`` (a push or a TensorArray write),
    held until the last of ``readers`` (pops, reads, gathers) has run, or to the end of the step."""

    writer: int  # GraphView index
    readers: tuple[int, ...]
    num_bytes: int
    kind: str  # "stack", "tensor array" or "tensor list"
    trips: int = 1  # iterations over one step of the loop the writer runs in (num_bytes: that many elements)
    sharers: tuple[int, ...] = ()  # other pushes keeping the same buffers (a value pushed on two stacks)
    # A stack of the larger branch of a cond inside the loop: its share of what the loop keeps when
    # every iteration takes the other branch (see _one_branch_per_cond); None: num_bytes.
    least_bytes: int | None = None
    # A loop variable's stack: the value the loop starts with, made outside it (GraphView index,
    # output), whose buffer the first iteration pushes (see _entry_value); else None.
    entry: tuple[int, int] | None = None


def trip_counts(view: GraphView) -> dict[str, Loop]:
    """Per while-loop frame, its trip count (see the module docstring)."""
    frames = sorted({f for f in view.frames if f})
    if not frames:
        return {}
    conds: dict[str, int] = {}
    for i in range(view.size):
        if view.ops[i] == "LoopCond" and view.frames[i]:
            conds.setdefault(view.frames[i], i)
    evaluator = Evaluator(view)
    out: dict[str, Loop] = {}
    for frame in frames:
        cond = conds.get(frame)
        if cond is None:
            out[frame] = Loop(frame, None, "no LoopCond")
            continue
        trips, how = _bound(view, view.data_inputs[cond][0][0], frame, evaluator)
        counted = _counted(view, view.data_inputs[cond][0], frame, evaluator, trips)
        if counted is not None and counted != trips:
            trips, how = counted, "its condition computed from its counters"
        out[frame] = Loop(frame, trips, how)
    # A gradient loop pops what a forward loop pushed: it runs as many iterations.
    stacks = pushes_and_pops(view)
    for pushes, pops in stacks.values():
        known = [out[view.frames[p]] for p in pushes
                 if out.get(view.frames[p]) and out[view.frames[p]].trips is not None]
        for p in pops:
            frame = view.frames[p]
            if known and frame and (frame not in out or out[frame].trips is None):
                out[frame] = Loop(frame, known[0].trips, f"as many as {known[0].frame}, whose stacks it pops")
    return out


def storage(view: GraphView, loops: dict[str, Loop] | None = None) -> tuple[Storage, ...]:
    """The stacks and TensorArrays of the graph's loops, sized by their trip counts (elements of
    unknown size, or in loops of unknown count, are left out: one iteration is counted anyway)."""
    loops = trip_counts(view) if loops is None else loops
    found: list[Storage] = []
    seen: set[tuple[int, int]] = set()  # values already kept: a buffer pushed twice is one buffer
    by_value: dict[tuple[int, int], int] = {}  # a value kept by a stack -> its entry in found
    lists = {s.writer: s for s in whole_lists(view)}
    for pushes, pops in pushes_and_pops(view).values():
        popped = max((view.tensor_bytes(p, 0) for p in pops), default=0)  # when the pushed size is unknown
        for push in pushes:
            value = _new_buffer_each_iteration(view, push, 1, set())
            if value is None:
                continue
            whole = _element_of(view, *value)
            if whole in lists:  # an element of a whole list: its buffer, kept until these pops too
                kept = lists[whole]
                lists[whole] = replace(kept, readers=tuple(sorted(set(kept.readers) | set(pops))))
                continue
            if value in by_value:  # pushed on another stack too: one buffer, two stacks keep it
                first = found[by_value[value]]
                found[by_value[value]] = replace(first, readers=tuple(sorted(set(first.readers) | set(pops))),
                                                 sharers=first.sharers + (push,))
                continue
            if value in seen:
                continue
            seen.add(value)
            size = _element_bytes(view, push, 1) or view.tensor_bytes(*value) or popped
            trips = total_trips(view, view.frames[push], loops)
            if size and trips and trips > 1:
                by_value[value] = len(found)
                found.append(Storage(push, tuple(sorted(pops)), trips * size, "stack", trips,
                                     entry=_entry_value(view, push, 1)))
    found = _one_branch_per_cond(view, found, loops)
    for writes, reads in _arrays(view).values():
        for write in writes:
            if view.frames[write] and _new_buffer_each_iteration(view, write, 2, seen) is None:
                continue
            size = _element_bytes(view, write, 2)
            if view.ops[write] == "TensorArrayScatterV3" and not view.frames[write]:
                # A whole tensor split into the array's elements before a loop reads them one by one:
                # the kernel copies each element into a buffer of its own.
                if size:
                    found.append(Storage(write, tuple(sorted(reads)), size, "tensor array",
                                         _scattered_elements(view, write)))
                continue
            trips = total_trips(view, view.frames[write], loops)
            if size and trips and trips > 1 and view.ops[write] == "TensorArrayWriteV3":
                found.append(Storage(write, tuple(sorted(reads)), trips * size, "tensor array", trips))
    found.extend(lists.values())
    found.extend(_written_lists(view, seen, loops))
    return tuple(sorted(found, key=lambda s: s.writer))


def _written_lists(view: GraphView, seen: set, loops: dict[str, Loop]) -> list[Storage]:
    """TensorFlow 2's TensorArrays that a loop writes: a ``TensorListReserve`` made before the loop
    and a ``TensorListSetItem`` per iteration, each keeping that iteration's value until the list
    is read after the loop (stacked, gathered), as ``TensorArrayWriteV3`` does in a v1 loop. A
    value a stack keeps too (``seen``: a state the gradient pops) is counted once, with the stack;
    the others were counted nowhere (a decoder's per-step logits)::

        TensorListReserve --> Enter -> ... SetItem(t, logits_t) ... Exit --> TensorListStack
                                          held: trips x logits, to the stack"""
    from lmscli.model.memmodel import rounded

    writes: dict[int, list[int]] = {}  # the list's maker -> its writes in loops
    for i in range(view.size):
        if view.ops[i] == "TensorListSetItem" and view.frames[i] and len(view.data_inputs[i]) > 2:
            made = _list_maker(view, view.data_inputs[i][0][0])
            if view.ops[made] in ("TensorListReserve", "EmptyTensorList") and not view.frames[made]:
                writes.setdefault(made, []).append(i)
    if not writes:
        return []
    readers = _list_readers(view, writes, skip_ops=frozenset({"TensorListSetItem"}))
    out = []
    for made, sets in sorted(writes.items()):
        for write in sets:
            value = _new_buffer_each_iteration(view, write, 2, seen)
            size = view.tensor_bytes(*value) if value is not None else 0
            trips = total_trips(view, view.frames[write], loops)
            if size and trips and trips > 1:
                out.append(Storage(write, tuple(sorted(readers[made])), trips * rounded(size), "tensor list", trips))
    return out


LIST_LIKE = frozenset({"ZerosLike", "OnesLike"})  # of a TensorList: a list of as many new elements


def whole_lists(view: GraphView) -> list[Storage]:
    """The TensorLists made whole before a TensorFlow 2 loop reads them, which hold a buffer per
    element: ``TensorListFromTensor`` copies each slice of its tensor into one (a tf_keras RNN's
    inputs, and the gradient of its output sequence), and ``ZerosLike`` of such a list makes as
    many zeros (the start of the inputs' gradient, which the gradient loop carries to an ``AddN``
    after it). The list is a handle (a variant of no size), so without this its elements were
    counted nowhere (QA: a tf_keras LSTM+GRU's lists held 1.25 MiB the model missed, and a plan
    predicted at 10 MiB needed 12)::

        x [32, 32, 128] -> TensorListFromTensor --> Enter -> ... GetItem(t) ...      32 buffers of 16 KiB
                                    +-> ZerosLike --> Enter (gradient loop) ... Exit -> AddN
                                                                                     32 more, to the AddN

    Held from the maker to its last reader, through the loops the readers run in; a ``ZerosLike``
    reads the list it copies the shape of, and the executor may run it only after the loop (QA: a
    TensorFlow 2 RNN's 8 MiB input list was still there when its zeros were made, predicted 36 MiB,
    needed 41 to 43; 44 since). An element read
    from the list (``TensorListGetItem``) is the list's own buffer: a loop that pushes it for its
    gradient keeps no copy, and the list's buffers are held until those pops (see :func:`storage`;
    counted twice, a 32-step RNN's inputs were 0.5 MiB too many)."""
    from lmscli.model.memmodel import rounded

    sizes: dict[int, tuple[int, int]] = {}  # maker -> (elements, bytes per element)
    for i in range(view.size):
        if view.ops[i] == "TensorListFromTensor" and not view.frames[i] and view.data_inputs[i]:
            info = view.tensor(*view.data_inputs[i][0])
            total = view.tensor_bytes(*view.data_inputs[i][0])
            first = info.shape[0] if info is not None and info.shape else None
            if total and isinstance(first, int) and first > 0:
                sizes[i] = (first, total // first)
    if not sizes:
        return []
    for i in range(view.size):  # (in graph order, a list's ZerosLike after the list's maker)
        if view.ops[i] in LIST_LIKE and not view.frames[i] and view.data_inputs[i] and view.outputs(i) \
                and view.outputs(i)[0].dtype == "variant":
            made = sizes.get(_list_maker(view, view.data_inputs[i][0][0]))
            if made is not None:
                sizes[i] = made
    readers = _list_readers(view, sizes)  # (a ZerosLike of a list too: it may run long after the loop)
    return [Storage(m, tuple(sorted(readers[m])), n * rounded(per), "tensor list", n)
            for m, (n, per) in sorted(sizes.items())]


def notes(view: GraphView, active, loops: dict[str, Loop]) -> tuple[str, ...]:
    """What the analysis says about the loops a step runs."""
    frames = sorted({view.frames[i] for i in active if view.frames[i]})
    if not frames:
        return ()
    known = [loops[f] for f in frames if f in loops and loops[f].trips is not None]
    unknown = [f for f in frames if f not in loops or loops[f].trips is None]
    parts = []
    if known:  # (a loop that runs 0 times, --feed n=0, is still counted for one iteration: an upper bound)
        parts.append("; ".join(f"{loop.frame}: {loop.trips} iterations ({loop.how}"
                               + ("; counted as one" if not loop.trips else "") + ")" for loop in known[:4])
                     + ("; ..." if len(known) > 4 else ""))
    line = (f"the step runs {len(frames)} while loop(s), each body counted once, with what it keeps across "
            "iterations (gradient stacks, TensorArrays) times its trip count")
    if parts:
        line += ": " + parts[0]
    out = [line]
    if unknown:
        out.append(f"{len(unknown)} loop(s) with a trip count lms cannot read ({', '.join(unknown[:3])}"
                   f"{', ...' if len(unknown) > 3 else ''}): counted for one iteration, so what they keep is "
                   "underestimated (a loop bounded by a placeholder's value, a sequence length, is counted by "
                   "the value --feed NAME=VALUE gives it)")
    parallel = max((_parallel_iterations(view, i) for i in active if view.frames[i]
                    and view.ops[i] in ("Enter", "RefEnter")), default=1)
    if parallel > 1:
        out.append(f"up to {parallel} iterations of this graph's loops may run at once (parallel_iterations): "
                   "lms's GPU figures count the temporaries of one iteration, so the graph as written can need more "
                   "on a GPU (for example, a dynamic_rnn GRU lms was tested on needed 38 MiB on the stand-in, 20 "
                   "counted so); its stand-in figures (--stand-in, lms measure) add what the stand-in's traced steps "
                   "showed iterations holding at once; lms's plans run such loops one iteration at a time, which "
                   "computes the same, unless --keep-loop-parallelism")
    return tuple(out)


# ---------------------------------------------------------------------------- internals
def _list_maker(view: GraphView, node: int) -> int:
    """The op that made the TensorList ``node`` passes on, through the loops' control flow ops and
    the ``TensorListSetItem`` ops that change one of its elements in place."""
    return source(view, node, through_exit=True, also=frozenset({"TensorListSetItem"}))


def _list_readers(view: GraphView, makers, skip_ops: frozenset = frozenset()) -> dict[int, set[int]]:
    """Per list maker of ``makers``, the ops reading its list (through the ops that hand it on,
    which count as readers too: a list a loop passes on unread lives until that loop's Exit),
    other than the maker itself and ops of ``skip_ops``."""
    readers: dict[int, set[int]] = {m: set() for m in makers}
    for i in range(view.size):
        if view.data_inputs[i] and view.ops[i] not in skip_ops:
            made = _list_maker(view, view.data_inputs[i][0][0])
            if made in readers and made != i:
                readers[made].add(i)
    return readers


def _element_of(view: GraphView, node: int, output: int) -> int | None:
    """For an element a ``TensorListGetItem`` reads (output 0), the op that made its list."""
    if view.ops[node] != "TensorListGetItem" or output != 0 or not view.data_inputs[node]:
        return None
    return _list_maker(view, view.data_inputs[node][0][0])


def _one_branch_per_cond(view: GraphView, found: list[Storage], loops: dict | None = None) -> list[Storage]:
    """``found`` with the stacks of conds inside loops counted by the iterations that take their
    branch: exactly where the cond's predicate is computed from the loop's counters
    (:func:`_branch_trips`: ``t % 2 == 0`` sends half the trips each way), else as below.

    Otherwise, ``found`` without the stacks that the smaller branch of such a cond pushes to.
    Each iteration runs one branch, so over the loop the branches share its trips; which way
    they split depends on the data. Counting every stack with every trip counted the branches twice
    over (QA: a 24-step loop alternating two branches was said to need 24.60 MiB at least, and
    trained under a 19 MiB hard limit); the larger branch's stacks with every trip are an upper
    bound for any split, as the larger branch of a cond outside loops is for either.

    A lower bound needs the other end: every iteration taking the smaller branch. Each kept stack
    carries that share as ``least_bytes`` (its bytes times the smaller branch's bytes per
    iteration over the larger's), so that the kept stacks sum to the smaller branch's stacks
    with every trip (QA: with both branches at full size, the nested loop's lower bound was
    21.60 MiB, and lms's own plan trained under 19 MiB on the stand-in)."""
    stacks = [s for s in found if s.kind == "stack"]
    if not stacks:
        return found
    tags = view.branch_tags(in_loops=True)
    taken = _branch_trips(view, {tag[0] for s in stacks for tag in tags[s.writer]}, loops or {})
    exact = {}
    for s in stacks:
        if len(tags[s.writer]) == 1 and next(iter(tags[s.writer]))[0] in taken:
            pred, port = next(iter(tags[s.writer]))
            exact[s.writer] = sum(1 for branch in taken[pred] if branch == bool(port))
    if exact:
        exact = _less_shared(view, exact, taken, tags)
        found = [replace(s, num_bytes=s.num_bytes // s.trips * exact[s.writer], trips=exact[s.writer])
                 if s.writer in exact else s for s in found if exact.get(s.writer, 1) > 0]
        stacks = [s for s in found if s.kind == "stack" and s.writer not in exact]
    per_iteration: dict[tuple, int] = {}
    for s in stacks:
        for tag in tags[s.writer]:
            per_iteration[tag] = per_iteration.get(tag, 0) + s.num_bytes // s.trips
    smaller, share = set(), {}
    for pred in {pred for pred, _port in per_iteration}:
        kept = max((1, 0), key=lambda port: per_iteration.get((pred, port), 0))  # (a tie keeps the true branch)
        smaller.add((pred, 1 - kept))
        share[(pred, kept)] = (per_iteration.get((pred, 1 - kept), 0), per_iteration[(pred, kept)])
    out = []
    for s in found:
        if s.writer in exact:
            out.append(s)
            continue
        if s.kind == "stack" and tags[s.writer] & smaller:
            continue
        shares = [share[tag] for tag in tags[s.writer] if tag in share] if s.kind == "stack" else []
        if shares:
            least, per = min(shares, key=lambda f: f[0] / f[1])
            s = replace(s, least_bytes=s.num_bytes * least // per)
        out.append(s)
    return out


def _branch_trips(view: GraphView, preds, loops: dict[str, Loop]) -> dict[tuple, list[bool]]:
    """Per predicate of a cond inside a loop (``(node, output)``), the branch each iteration of
    one run of the loop takes (True: the true branch), where the predicate is computed from the
    loop's counters (:func:`lmscli.graph.loopvalues.per_iteration`) in a loop that no other loop
    runs (QA: a loop taking one branch on even steps and the other on odd ones was predicted to
    need 85 MiB, its larger branch counted every trip; it trained under 45)."""
    from lmscli.graph.loopvalues import per_iteration

    out: dict[tuple, list[bool]] = {}
    evaluator = None
    for pred in sorted(preds):
        frame = view.frames[pred[0]]
        loop = loops.get(frame)
        if not loop or not loop.trips or loop.trips > MAX_COUNTED or view.frame_parent.get(frame, ""):
            continue
        evaluator = evaluator or Evaluator(view)
        values = per_iteration(view, pred[0], pred[1], frame, loop.trips, evaluator)
        if values is None or not all(isinstance(v, bool) for v in values):
            continue
        out[pred] = values
    return out


def _less_shared(view: GraphView, exact: dict[int, int], taken: dict, tags) -> dict[int, int]:
    """``exact`` (per push of a cond's branch, the iterations that take it) less the iterations
    in which it pushes a buffer that the other push keeps already: a loop variable's value, made
    by a branch of the cond the iteration before and pushed there too. A loop alternating two
    branches, one pushing its result ``tanh`` and both pushing the value they start from::

        iteration 0 (even): push h0, push tanh0 = h1       even stacks: h0 h2 h4 ..  tanh0 tanh2 ..
        iteration 1 (odd):  push h1 (= tanh0's buffer)     odd stack:   h1 h3 ..     (tanh0 tanh2 ..)
    """
    values = {push: _kept_value(view, push, 1) for push in exact}
    pushed: dict[tuple, set] = {}  # (pred, port) -> values the pushes of that branch keep
    for push, value in values.items():
        pushed.setdefault(next(iter(tags[push])), set()).add(value)
    out = dict(exact)
    for push in exact:
        pred, port = next(iter(tags[push]))
        made = _made_by_branches(view, push, pred, tags)
        if made is None:
            continue
        sequence = taken[pred]
        shared = sum(1 for k in range(1, len(sequence)) if sequence[k] == bool(port)
                     and made.get(int(sequence[k - 1])) in pushed.get((pred, int(sequence[k - 1])), ()))
        out[push] = exact[push] - shared
    return out


def _made_by_branches(view: GraphView, push: int, pred: tuple, tags) -> dict[int, tuple[int, int]] | None:
    """For a push of a loop variable inside a branch of the cond testing ``pred``, where the value
    the loop carries is that cond's result: per port of the cond, the tensor its branch makes for
    it (through Identities); None for any other push::

        Merge (loop) -> Switch:1 -> Identity -> Switch (cond) --> push      the loop variable
        NextIteration <- Merge (cond) <- tanh (true branch), mul (false branch)
    """
    frame = view.frames[push]
    src, output = view.data_inputs[push][1] if len(view.data_inputs[push]) > 1 else (None, 0)
    seen = set()
    while src is not None and src not in seen and view.frames[src] == frame and view.data_inputs[src]:
        seen.add(src)
        op = view.ops[src]
        if op == "Identity" or (op in ("Switch", "RefSwitch") and _loop_merge(view, src, output) is None):
            src, output = view.data_inputs[src][0]
            continue
        break
    carried = _carried(view, src, output) if src is not None else None
    if carried is None or view.ops[carried[0]] not in ("Merge", "RefMerge"):
        return None
    out = {}
    for node, out_port in view.data_inputs[carried[0]]:
        node, out_port = _through_identities(view, node, out_port, frame)
        branch = [port for p, port in tags[node] if p == pred]
        if len(branch) != 1:
            return None
        out[branch[0]] = (node, out_port)
    return out


def parallel_loops(view: GraphView, names) -> tuple[str, ...]:
    """The frame names of the while loops among the ops ``names`` whose ``parallel_iterations`` is
    more than 1, sorted. Their iterations may overlap, each holding its own temporaries, where
    lms's model counts one iteration in flight; a plan runs them one at a time
    (:attr:`lmscli.plan.document.Plan.serial_loops`)."""
    names = set(names)
    return tuple(sorted({view.frame_names[i] for i in range(view.size)
                         if view.ops[i] in ("Enter", "RefEnter") and view.names[i] in names
                         and view.frame_names[i] and _parallel_iterations(view, i) > 1}))


def overlap_bytes(view: GraphView, schedule) -> int:
    """At most what iterations running at once add to a step's peak (``schedule`` counts one iteration
    of each loop in flight): for each loop with ``parallel_iterations`` P above 1, P - 1 more
    iterations (no more than its trip count) each holding the most one iteration holds at once
    (its working set: the tensors it makes, each from its op to its last reader in the schedule),
    over all such loops. An upper bound (the iterations are never all at their peak at once; QA:
    the sum of everything an iteration makes said 139 MiB where the stand-in showed 7); 0 when
    every loop runs one iteration at a time."""
    from lmscli.model.schedule import STORAGE_OUTPUT

    parallel = _frame_parallelism(view)
    if all(p <= 1 for p in parallel.values()):
        return 0
    events: dict[str, list[tuple[int, int]]] = {}
    for t in schedule.tensors:
        frame = view.frames[schedule.nodes[t.producer]]
        if frame and t.output != STORAGE_OUTPUT and t.num_bytes:
            end = max(t.consumers, default=t.producer)
            events.setdefault(frame, []).extend(((t.producer, t.num_bytes), (end + 1, -t.num_bytes)))
    per_iteration: dict[str, int] = {}
    for frame, changes in events.items():
        held = most = 0
        for _position, change in sorted(changes):  # (at one position, what is freed goes first)
            held += change
            most = max(most, held)
        per_iteration[frame] = most
    counted = trip_counts(view)
    total = 0
    for frame, p in parallel.items():
        trips = counted[frame].trips if frame in counted and counted[frame].trips else p
        total += (min(p, trips) - 1) * per_iteration.get(frame, 0)
    return total


# Ops whose output is an element a loop keeps (a stack's, a TensorArray's, a TensorList's): its
# buffer is counted with what the loop keeps, however far ahead it is read.
ELEMENT_READS = frozenset({"StackPopV2", "StackPop", "TensorArrayReadV3", "TensorArrayReadV2", "TensorListGetItem",
                           "TensorListPopBack"})


# Control-flow ops that hand a buffer on to the next iteration or out of the loop: a ``Merge`` runs
# once more than the body (its first value comes from the ``Enter``), so its k-th run is not
# iteration k's; the buffer's life in iteration k ends at its last other reader.
CARRIERS = frozenset({"Merge", "RefMerge", "NextIteration", "RefNextIteration", "Switch", "RefSwitch", "Exit",
                      "RefExit", "Enter", "RefEnter"})


def iterations_ahead(view: GraphView, schedule, *orders) -> tuple[tuple[int, int, int], ...]:
    """What iterations of loops running at once held beyond one iteration, as traced steps show it:
    each of ``orders``, the names of the ops a step started, one entry per run (a loop body's ops
    once per iteration); the most any of them shows. For each loop whose ``parallel_iterations``
    is above 1 (``schedule``, an executor-model schedule of that step, counts one iteration in
    flight), each buffer one of its ops makes lives in iteration k from the op's k-th start to the
    k-th start of the last of its readers in the loop. While each op ran (loops run side by side: a bidirectional RNN's two), some
    buffers were live for more than one iteration at once; at the run of that op when those extra
    buffers took the most bytes, each is one allocation held while the op runs: ``(position,
    position, bytes)`` per allocation, sorted.

    The executor starts ready ops last-in first-out: the stack_rnn sample's gradient loop ran ten
    iterations' weight gradients before the first was added to its sum, each 256 KiB (measured
    need 14 MiB, against 12 for the same graph with ``parallel_iterations`` 1; predicted 13
    without this, 14 with it)::

        order:  MatMul_1_grad/MatMul_1 (k), ..., MatMul_1_grad/MatMul_1 (k+9), Enter_grad/Add (k), ...
        held:   10 x 256 KiB while the Adds run, where one iteration holds 256 KiB

    A body op that does not run once per iteration (inside a cond in the loop, or in an inner loop)
    is left out; a loop that ran once or not at all holds nothing more."""
    from lmscli.model.memmodel import roots
    from lmscli.model.schedule import STORAGE_OUTPUT

    frames = {f for f, p in _frame_parallelism(view).items() if p > 1}
    if not frames or not any(orders) or not schedule.shares:
        return ()
    frame_at = [view.frames[node] for node in schedule.nodes]
    readers: dict[int, set[int]] = {}  # buffer (root tensor) -> positions reading it in its loop
    root_of = roots(schedule)
    for t in schedule.tensors:
        root = root_of[t.id]
        if root < 0:
            continue
        frame = frame_at[schedule.tensors[root].producer]
        if (frame not in frames or schedule.tensors[root].output == STORAGE_OUTPUT
                or schedule.ops[schedule.tensors[root].producer] in ELEMENT_READS):
            continue
        readers.setdefault(root, set()).update(c for c in t.consumers
                                               if frame_at[c] == frame and schedule.ops[c] not in CARRIERS)
    position = {name: k for k, name in enumerate(schedule.names)}
    best: dict[int, tuple[int, dict[int, int]]] = {}  # position -> (extra bytes, extra runs per buffer)
    for order in orders:
        _held_ahead(schedule, order, readers, position, best)
    out: list[tuple[int, int, int]] = []
    for k, (_extra, extras) in best.items():
        for root, n in extras.items():
            out.extend((k, k, schedule.tensors[root].num_bytes) for _ in range(n))
    return tuple(sorted(out))


def _held_ahead(schedule, order, readers: dict, position: dict, best: dict) -> None:
    """:func:`iterations_ahead` for one traced ``order``: update ``best`` (position -> the most
    extra bytes seen while the op there ran, and the extra runs per buffer then)."""
    runs: dict[str, list[int]] = {}
    wanted = {schedule.names[schedule.tensors[r].producer] for r in readers}
    wanted.update(schedule.names[c] for cs in readers.values() for c in cs)
    for index, name in enumerate(order):
        if name in wanted:
            runs.setdefault(name, []).append(index)
    events: list[tuple[int, int, int, int]] = []  # (index in the order, phase, root, +1/-1)
    for root, positions in sorted(readers.items()):
        t = schedule.tensors[root]
        made = runs.get(schedule.names[t.producer], [])
        # (a reader that never ran is an op Grappler removed, an Identity of the graph as written)
        reads = [r for r in (runs.get(schedule.names[c], []) for c in sorted(positions)) if r]
        if len(made) < 2 or not reads or any(len(r) != len(made) for r in reads):
            continue
        ends = [max(r[k] for r in reads) for k in range(len(made))]
        if any(end < start for start, end in zip(made, ends)):
            continue
        for start, end in zip(made, ends):
            events.append((start, 0, root, 1))
            events.append((end, 1, root, -1))
    events.sort()
    count: dict[int, int] = {}
    extra = 0
    for j, (index, phase, root, delta) in enumerate(events):
        # (the op at ``index`` runs when its outputs are made and what it last read is not yet freed)
        if phase == 1 and (j == 0 or events[j - 1][:2] != (index, 1)):
            _note_running(best, position.get(order[index]), extra, count)
        before = count.get(root, 0)
        count[root] = before + delta
        if delta > 0 and before >= 1:
            extra += schedule.tensors[root].num_bytes
        elif delta < 0 and before >= 2:
            extra -= schedule.tensors[root].num_bytes
        if phase == 0 and (j + 1 == len(events) or events[j + 1][0] != index):
            _note_running(best, position.get(order[index]), extra, count)


def _note_running(best: dict, k: int | None, extra: int, count: dict) -> None:
    """Keep, for the op at position ``k``, the most ``extra`` bytes seen while it ran and the extra
    runs per buffer then (``count``: iterations each buffer was live for)."""
    if k is not None and extra > best.get(k, (0, None))[0]:
        best[k] = (extra, {r: n - 1 for r, n in count.items() if n > 1})


def run_serially(schedule, view: GraphView):
    """``schedule`` as a plan running every loop one iteration at a time counts it (``schedule``
    itself when that changes nothing): no iterations running ahead (``ahead``), and every loop's
    ``Merge`` carried (``carried``: a sum that starts as a constant is, from the second iteration
    on, the last iteration's value)."""
    from dataclasses import replace

    carried = loop_merges(view, schedule.nodes)
    if not schedule.ahead and (not any(carried) or carried == schedule.carried):
        return schedule
    return replace(schedule, ahead=(), carried=carried if any(carried) else ()).with_memory_model(schedule.memory_model)


def loop_merges(view: GraphView, nodes) -> tuple[bool, ...]:
    """Per node of ``nodes``, is it a while loop's ``Merge`` (one that a ``NextIteration`` feeds,
    not a cond's inside a loop body)?"""
    return tuple(view.ops[i] in ("Merge", "RefMerge") and bool(view.frames[i])
                 and any(view.ops[src] in ("NextIteration", "RefNextIteration") for src, _ in view.data_inputs[i])
                 for i in nodes)


def running_ahead(schedule, view: GraphView, order, *orders):
    """``schedule`` (an executor-model schedule of the step on the stand-in) with what the traced
    ``order`` and ``orders`` show its loops' iterations running at once holding
    (:func:`iterations_ahead`); in those loops no ``Merge`` is carried: the stand-in's executor
    leaves each sum's additions for last (the stack_rnn sample: ten weight gradients waiting and
    no sum yet at its peak), so what they hold is what the traced steps show."""
    from dataclasses import replace

    parallel = {f for f, p in _frame_parallelism(view).items() if p > 1}
    carried = schedule.carried
    if carried and parallel:
        carried = tuple(c and view.frames[node] not in parallel for c, node in zip(carried, schedule.nodes))
        carried = carried if any(carried) else ()
    out = replace(schedule, ahead=iterations_ahead(view, schedule, order, *orders), carried=carried)
    return out.with_memory_model(schedule.memory_model) if carried != schedule.carried else out


def _frame_parallelism(view: GraphView) -> dict[str, int]:
    """Per while-loop frame, its ``parallel_iterations`` (the largest its ``Enter`` ops carry)."""
    parallel: dict[str, int] = {}
    for i in range(view.size):
        if view.ops[i] in ("Enter", "RefEnter") and view.frames[i]:
            parallel[view.frames[i]] = max(parallel.get(view.frames[i], 1), _parallel_iterations(view, i))
    return parallel


def _parallel_iterations(view: GraphView, enter: int) -> int:
    """An ``Enter``'s ``parallel_iterations`` (1 when it has none)."""
    attr = view.node_defs[enter].attr
    return int(attr["parallel_iterations"].i) if "parallel_iterations" in attr else 1


def total_trips(view: GraphView, frame: str, loops: dict[str, Loop]) -> int | None:
    """Iterations of ``frame`` over one step: its trips times those of the loops around it."""
    total = 1
    while frame:
        loop = loops.get(frame)
        if loop is None or not loop.trips:
            return None
        total *= loop.trips
        frame = view.frame_parent.get(frame, "")
    return total


def _arrays(view: GraphView) -> dict[int, tuple[list[int], list[int]]]:
    """Per TensorArray (its TensorArrayV3 node), the writes inside loops and the reads."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(view.size):
        op = view.ops[i]
        if (op in WRITE_OPS or op in READ_OPS) and view.data_inputs[i]:
            array = source(view, view.data_inputs[i][0][0])
            writes, reads = out.setdefault(array, ([], []))
            if op in WRITE_OPS and (view.frames[i] or op == "TensorArrayScatterV3"):
                writes.append(i)
            elif op in READ_OPS:
                reads.append(i)
    return out


def _new_buffer_each_iteration(view: GraphView, node: int, port: int, seen: set) -> tuple[int, int] | None:
    """The tensor whose value ``node`` keeps (its input ``port``), if it takes a new buffer each
    iteration, not yet kept by another stack or array (else None)? Not so for a variable's read (the variable's own buffer, see
    :data:`lmscli.model.memmodel.RESIDENT_READS`), a constant, or a value made outside the loop (the same
    buffer every iteration); an Identity forwards its input's buffer."""
    kept = _kept_value(view, node, port)
    if kept is None:
        return None
    src, output = kept
    if view.frames[src] != view.frames[node] or _resident(view, src) or (src, output) in seen:
        return None
    seen.add((src, output))
    return src, output


def _kept_value(view: GraphView, node: int, port: int) -> tuple[int, int] | None:
    """The tensor ``node`` keeps through its input ``port``: through Identities and Enters of its
    frame, and for a loop variable the value the previous iteration made."""
    inputs = view.data_inputs[node]
    if len(inputs) <= port:
        return None
    src, output = inputs[port]
    frame = view.frames[node]
    while view.ops[src] in ("Identity", "Enter", "RefEnter") and view.frames[src] == frame and view.data_inputs[src]:
        src, output = view.data_inputs[src][0]
    carried = _carried(view, src, output)
    if carried is not None:  # a loop variable: the value last iteration made (and maybe kept)
        src, output = carried
    return src, output


def _entry_value(view: GraphView, node: int, port: int) -> tuple[int, int] | None:
    """For a push of a loop variable (``node``'s input ``port``, through Identities), the tensor
    the loop starts it with, made outside the loop: the first iteration pushes that tensor's own
    buffer (a push keeps a reference, no copy), the others what the iterations before made::

        h0 (outside) --> Enter --> Merge --> Switch:1 --> push      iteration 0 keeps h0's buffer
                                     ^-- NextIteration <-- h1 ...   iteration k keeps h_k

    None for any other value."""
    inputs = view.data_inputs[node]
    if len(inputs) <= port:
        return None
    frame = view.frames[node]
    src, output = _through_identities(view, *inputs[port], frame)
    merge = _loop_merge(view, src, output)
    found = _merge_input(view, merge, ("Enter", "RefEnter")) if merge is not None else None
    if found is None or view.frames[found[0]] == frame or _resident(view, found[0]):
        return None
    return found


def _resident(view: GraphView, node: int) -> bool:
    from lmscli.graph.graphview import VARIABLE_OPS
    from lmscli.model.memmodel import RESIDENT_READS

    return view.ops[node] in RESIDENT_READS or view.ops[node] in VARIABLE_OPS or view.ops[node] == "Const"


def resident_pops(view: GraphView) -> frozenset[int]:
    """The pops of stacks whose every push keeps a variable's or a constant's buffer: what they pop
    is that resident buffer, no allocation. A loop's ``MatMul`` reading an 8 MiB kernel pushes the
    kernel's read for its gradient each iteration; counted as a new 8 MiB buffer, the pop had an
    LSTM's need predicted 8 MiB high (43 MiB, measured 35)::

        kernel -> ReadVariableOp (the kernel's buffer) -> StackPushV2 ... StackPopV2 -> MatMul (gradient)
        before: the pop makes an 8 MiB tensor   after: the pop is the kernel's buffer
    """
    out = set()
    for pushes, pops in pushes_and_pops(view).values():
        if pushes and all((kept := _kept_value(view, push, 1)) is not None and _resident(view, kept[0])
                          for push in pushes):
            out.update(pops)
    return frozenset(out)


def _carried(view: GraphView, node: int, output: int) -> tuple[int, int] | None:
    """For a loop variable as the body reads it (a Switch's output 1), the tensor the previous
    iteration made for it (what reaches its NextIteration), through Identities; else None."""
    merge = _loop_merge(view, node, output)
    found = _merge_input(view, merge, ("NextIteration", "RefNextIteration")) if merge is not None else None
    if found is None:
        return None
    return _through_identities(view, *found, view.frames[node])


def _through_identities(view: GraphView, node: int, output: int, frame: str) -> tuple[int, int]:
    """The tensor ``(node, output)`` forwards, through the Identities of ``frame``."""
    while view.ops[node] == "Identity" and view.frames[node] == frame and view.data_inputs[node]:
        node, output = view.data_inputs[node][0]
    return node, output


def _loop_merge(view: GraphView, node: int, output: int) -> int | None:
    """The ``Merge`` of a loop variable as the body reads it (``node``'s output 1, a Switch), else None."""
    if view.ops[node] not in ("Switch", "RefSwitch") or output != 1 or not view.data_inputs[node]:
        return None
    merge = view.data_inputs[node][0][0]
    return merge if view.ops[merge] in ("Merge", "RefMerge") else None


def _merge_input(view: GraphView, merge: int, ops) -> tuple[int, int] | None:
    """The tensor reaching a loop's ``merge`` through its input op of ``ops`` (an ``Enter``: the
    value the loop starts with; a ``NextIteration``: the one the iteration before made), else None."""
    for src, _ in view.data_inputs[merge]:
        if view.ops[src] in ops and view.data_inputs[src]:
            return view.data_inputs[src][0]
    return None


def _scattered_elements(view: GraphView, scatter: int) -> int:
    """Elements a ``TensorArrayScatterV3`` writes: its value's first dimension (1 when unknown)."""
    inputs = view.data_inputs[scatter]
    info = view.tensor(*inputs[2]) if len(inputs) > 2 else None
    first = info.shape[0] if info is not None and info.shape else None
    return first if isinstance(first, int) and first > 0 else 1


def _element_bytes(view: GraphView, node: int, port: int) -> int:
    inputs = view.data_inputs[node]
    if len(inputs) <= port:
        return 0
    src, output = inputs[port]
    return view.tensor_bytes(src, output)


def _bound(view: GraphView, node: int, frame: str, evaluator) -> tuple[int | None, str]:
    """The iterations a loop condition allows: the smallest bound of its comparisons."""
    op = view.ops[node]
    if op in ("LogicalAnd",):
        found = [_bound(view, src, frame, evaluator) for src, _ in view.data_inputs[node]]
        known = [f for f in found if f[0] is not None]
        if not known:
            return None, found[0][1] if found else "empty condition"
        trips, how = min(known)
        if len(known) < len(found):  # (an upper bound: the other tests may end the loop sooner)
            other = next(f[1] for f in found if f[0] is None)
            how = f"at most {trips} ({how}); the rest of its condition may end it sooner: {other}"
        return trips, how
    if op in ("Identity",) and view.data_inputs[node]:
        return _bound(view, view.data_inputs[node][0][0], frame, evaluator)
    if op not in COMPARISONS or len(view.data_inputs[node]) != 2:
        return None, f"a loop condition made by {op}"
    (a, a_out), (b, b_out) = view.data_inputs[node]
    if _varies(view, a, frame) and not _varies(view, b, frame):
        counter_first, (limit, limit_out) = True, (b, b_out)
    elif _varies(view, b, frame) and not _varies(view, a, frame):
        counter_first, (limit, limit_out) = False, (a, a_out)
    else:
        return None, "a condition without one counter and one bound"
    if counter_first != (op in ("Less", "LessEqual")):
        return None, "a loop counting down"
    value = evaluator.value(limit, limit_out, frame)
    if value is None:
        return None, f"a bound ({view.names[limit]}) lms cannot compute"
    trips = int(value) + COMPARISONS[op]
    return max(trips, 0), f"{op}(counter, {int(value)})"


MAX_COUNTED = 1 << 16  # iterations :func:`_counted` runs a loop's condition for at most


def _counted(view: GraphView, cond: tuple[int, int], frame: str, evaluator, guess: int | None) -> int | None:
    """The iterations a loop runs, where its condition ``cond`` is computed from its counters
    alone (:func:`lmscli.graph.loopvalues.per_iteration`): the first iteration whose condition is
    false. :func:`_bound` reads ``Less(counter, n)`` as n trips, as if every counter started at 0
    and went up by 1; this sees ``i = 3; i < 15`` run 12 times and ``i += 2`` half as many.
    None where the condition reads anything else, or holds for :data:`MAX_COUNTED` iterations."""
    from lmscli.graph.loopvalues import per_iteration

    n = max(2, (guess or 0) + 1)
    if n > MAX_COUNTED:
        return None
    while True:
        values = per_iteration(view, cond[0], cond[1], frame, n, evaluator)
        if values is None or not all(isinstance(v, bool) for v in values):
            return None
        if False in values:
            return values.index(False)
        if n >= MAX_COUNTED:
            return None
        n = min(4 * n, MAX_COUNTED)


def _varies(view: GraphView, node: int, frame: str) -> bool:
    """Does ``node`` depend on the loop's own Merge (a value that changes each iteration)?"""
    stack, seen = [node], set()
    while stack:
        i = stack.pop()
        if i in seen or view.frames[i] != frame:
            continue
        seen.add(i)
        if view.ops[i] in ("Merge", "RefMerge"):
            if invariant(view, i) is None:
                return True
            continue
        stack.extend(src for src, _ in view.data_inputs[i])
    return False
