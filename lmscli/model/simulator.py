"""The memory-and-time simulator: a pure function of a schedule, a set of swaps and a link speed.

Model of one training step (times are whole microseconds, so equal times are exact):

* GPU ops run one at a time, in schedule order, each for its cost-model time.
* A tensor is allocated when its producer starts and freed when its last consumer ends.
* Variables and constants are resident for the whole step.
* A swap-out starts when the producer ends, on the device-to-host stream (one transfer at a time,
  at the link's bandwidth). The GPU copy is freed when the swap-out is done *and* the near
  consumers (those still reading the GPU copy) have ended.
* A swap-in starts when its trigger op ends and the swap-out is done, on the host-to-device
  stream; its GPU buffer is allocated when it starts and freed when its last consumer ends.
  A consumer cannot start before its swap-in is done: the difference is a stall.
* A recomputation (``kind="recompute"``) has no swap-out: the GPU copy is freed when the near
  consumers have ended. When its trigger ends, the cloned ops run on the GPU (``cost``
  microseconds, delaying every later op) into a new buffer, freed when its last consumer ends;
  ``extra`` bytes of intermediate results are held while the clones run. Clones that read a
  source from a swap-in or from another recomputation's clones (``via``) wait for it, and its
  buffer stays until they have run.
* ``sync_out`` makes the near consumers wait for the swap-out as well; ``waiters`` are other ops
  that wait for it (so the GPU copy is gone before they allocate).
* A swap-in's ``landing`` op waits until its transfer is done (stand-in plans: the transfer then
  lands at one place in the order of allocations, not wherever it happens to arrive).
* Gradient stacks kept on the host (``schedule.stack_copies``): a loop's pushes copy one
  iteration's value each to the host, its pops one each back, on the link while the loop computes;
  the op at the given position is delayed by what the copies take beyond the loop's compute.
* On the CPU stand-in (``schedule.stand_in``) a swap-out starts only when the first op that
  waits for it is reached (its send is an expensive CPU kernel, queued behind the ops the
  executor runs inline), or at its first swap-in's trigger when nothing waits for it.

At equal times allocations come before frees, as in Grappler's memory accounting: a chain of
zero-time ops holds all its tensors at once. This is conservative and keeps our figures
comparable with TensorFlow's own estimate.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from lmscli.model.schedule import Schedule


SCRATCH, SCRATCH_FIRST = 2, -1  # event kinds of kernel scratch taken after and before the op's outputs


@dataclass(frozen=True)
class SwapIn:
    consumers: tuple[int, ...]  # positions served by this swap-in (sorted)
    trigger: int  # position of the op whose end starts the transfer
    landing: int = -1  # position of an op that waits until the transfer is done (-1: none)


@dataclass(frozen=True)
class SimSwap:
    tensor: int  # SimTensor id
    near: tuple[int, ...]  # positions still reading the GPU copy
    groups: tuple[SwapIn, ...]
    sync_out: bool = False  # the near consumers wait for the swap-out (TFLMS sync_mode 1)
    waiters: tuple[int, ...] = ()  # further positions that wait for the swap-out (recompute: for the clones)
    kind: str = "swap"  # or "recompute": the far consumers read a clone of the producer's ops
    cost: int = 0  # recompute: microseconds the cloned ops keep the GPU busy (per group)
    extra: int = 0  # recompute: bytes of intermediate results held while the clones run
    chain: tuple[int, ...] = ()  # recompute: positions of the ops cloned, inputs first
    via: tuple[tuple[int, int], ...] = ()  # recompute: (tensor, group) swap-ins the clones read sources from
    pins: tuple[tuple[int, int], ...] = ()  # (first, then): "then" runs after "first", an order the swap needs

    @property
    def recompute(self) -> bool:
        return self.kind == "recompute"


@dataclass(frozen=True)
class SimResult:
    peak_bytes: int  # GPU peak including resident variables and constants
    activation_peak_bytes: int  # GPU peak of tensors only
    resident_bytes: int
    peak_time: float
    peak_position: int  # op running at the peak
    live_at_peak: tuple[tuple[str, int, int], ...]  # (kind, tensor id, bytes), largest first
    memory_by_position: tuple[int, ...]  # activation bytes: max while each op runs
    curve: tuple[tuple[float, int], ...]  # (time, activation bytes) after each event
    host_peak_bytes: int
    host_curve: tuple[tuple[float, int], ...]
    swap_out_bytes: int
    swap_in_bytes: int
    num_swap_outs: int
    num_swap_ins: int
    compute_time: float  # sum of op times: the step time with no stall
    step_time: float
    stall_time: float  # step time beyond the compute time: waiting on transfers, and recomputation
    transfers: tuple[tuple[str, int, float, float], ...] = field(default=())  # (dir, tensor, start, end)
    starts: tuple[int, ...] = field(default=())  # microseconds, per position
    ends: tuple[int, ...] = field(default=())
    allocator_peak_bytes: int = 0  # with ``allocator=True``: the smallest limit the BFC allocator needs
    recompute_time: float = 0.0  # GPU time of the recomputations (part of the step time)
    num_recomputes: int = 0  # recomputation groups (each runs its clones once)
    recompute_bytes: int = 0  # bytes the recomputations make again
    stack_copy_bytes: int = 0  # bytes hosted gradient stacks copy over the link (both ways)

    @property
    def overhead(self) -> float:
        return self.step_time / self.compute_time - 1.0 if self.compute_time > 0 else 0.0


def transfer_us(num_bytes: int, bandwidth: float) -> int:
    if math.isinf(bandwidth):
        return 0
    return int(round(num_bytes / bandwidth * 1e6))  # whole microseconds, as op times


def simulate(schedule: Schedule, swaps=(), link_bandwidth: float = math.inf, detail: bool = True,
             allocator: bool = False) -> SimResult:
    """Simulate one step of ``schedule`` with ``swaps`` (a sequence of :class:`SimSwap`).

    ``detail=False`` computes the peaks, traffic and times only (no curves, no per-position
    memory, no live set): what a search needs to decide fit or no fit. ``allocator=True`` (executor
    model) also places every allocation as the BFC allocator does, for the limit the step needs
    with fragmentation (:func:`lmscli.model.memmodel.allocator_high_water`)."""
    n = len(schedule)
    tensors = schedule.tensors
    swap_of = {s.tensor: s for s in swaps}

    # What each op waits for, what each op end triggers.
    in_groups: dict[tuple[int, int], int] = {}  # (tensor, consumer position) -> group index
    triggered: dict[int, list[tuple[int, int]]] = {}  # trigger position -> [(tensor, group index)]
    sync_waits: dict[int, list[int]] = {}  # consumer position -> tensors whose swap-out it waits for
    landings: dict[int, list[tuple[int, int]]] = {}  # position -> swap-ins it waits to have landed
    swapped_by_producer: dict[int, list[int]] = {}
    sent_at: dict[int, list[int]] = {}  # waited sends: position -> tensors whose swap-out starts there
    for tid in sorted(swap_of):
        swap = swap_of[tid]
        if schedule.stand_in and not swap.recompute:
            first = min((swap.near if swap.sync_out else ()) + swap.waiters, default=None)
            if first is not None:
                sent_at.setdefault(max(first, tensors[tid].producer + 1), []).append(tid)
        else:
            swapped_by_producer.setdefault(tensors[tid].producer, []).append(tid)
        for g, group in enumerate(swap.groups):
            trig = max(group.trigger, tensors[tid].producer)
            triggered.setdefault(trig, []).append((tid, g))
            for c in group.consumers:
                in_groups[(tid, c)] = g
            if group.landing >= 0:
                landings.setdefault(group.landing, []).append((tid, g))
        if swap.recompute:
            continue  # its waiters (variable updates) run after the clones in the schedule's order
        for c in (swap.near if swap.sync_out else ()) + swap.waiters:
            sync_waits.setdefault(c, []).append(tid)

    start = [0] * n
    end = [0] * n
    out_start: dict[int, int] = {}
    out_end: dict[int, int] = {}
    in_start: dict[tuple[int, int], int] = {}
    in_end: dict[tuple[int, int], int] = {}
    d2h_free = h2d_free = 0
    clock = 0
    copies_beyond: dict[int, int] = {}  # position -> microseconds hosted stacks' copies delay it
    for pos, num_bytes, hidden in schedule.stack_copies:
        copies_beyond[pos] = copies_beyond.get(pos, 0) + max(0, transfer_us(num_bytes, link_bandwidth) - hidden)
    recompute_us = 0
    records = []

    def send(tid: int, at: int) -> None:
        """Start the swap-out of ``tid`` on the device-to-host stream, at ``at`` or once it is free."""
        nonlocal d2h_free
        s = max(at, d2h_free)
        out_start[tid] = s
        out_end[tid] = d2h_free = s + transfer_us(tensors[tid].num_bytes, link_bandwidth)
        records.append(("out", tid, s, out_end[tid]))

    for k in range(n):
        for tid in sent_at.get(k, ()):  # the executor reaches an op waiting for these: they are sent
            send(tid, clock)
        ready = clock
        for tid in schedule.inputs[k]:
            g = in_groups.get((tid, k))
            if g is not None:
                ready = max(ready, in_end[(tid, g)])
        for tid in sync_waits.get(k, ()):
            ready = max(ready, out_end[tid])
        for key in landings.get(k, ()):
            ready = max(ready, in_end.get(key, ready))
        start[k] = ready
        end[k] = clock = ready + schedule.compute[k] + copies_beyond.get(k, 0)
        for tid in swapped_by_producer.get(k, ()):
            if swap_of[tid].recompute:
                out_start[tid] = out_end[tid] = end[k]  # nothing to copy: the GPU copy is free to go
                continue
            send(tid, end[k])
        # Swap-ins start in trigger order on the host-to-device stream.
        # Swap-ins first: clones may read one that this op's end starts.
        # (Recomputations in the order of their tensors: one whose clones read another's runs after it.)
        for tid, g in sorted(triggered.get(k, ()), key=lambda x: (swap_of[x[0]].recompute, tensors[x[0]].producer, x)):
            if swap_of[tid].recompute:  # the clones run on the GPU now (once what they read is back)
                ready = max([clock] + [in_end[v] for v in swap_of[tid].via if v in in_end])
                in_start[(tid, g)] = ready
                in_end[(tid, g)] = clock = ready + swap_of[tid].cost
                recompute_us += swap_of[tid].cost
                continue
            if tid not in out_end:  # a waited send nothing waited for: it goes when the swap-in needs it
                send(tid, end[k])
            s = max(end[k], out_end[tid], h2d_free)
            in_start[(tid, g)] = s
            in_end[(tid, g)] = h2d_free = s + transfer_us(tensors[tid].num_bytes, link_bandwidth)
            records.append(("in", tid, s, in_end[(tid, g)]))
    step_time = max([clock, d2h_free, h2d_free])

    # Memory events: (time, order, kind, id, delta); kind 0 is a swap-in buffer, 1 a tensor, 2 kernel
    # scratch (-1: scratch a kernel takes before its outputs). Plain tuples sort fastest. Grappler's
    # model orders an instant's allocations before its frees (order = phase); the executor's runs
    # ops one after another (order = position).
    if schedule.memory_model == "executor":
        events, host_events = _executor_events(schedule, swap_of, start, end, out_start, out_end, in_start, in_end)
    else:
        events, host_events = _grappler_events(schedule, swap_of, start, end, out_start, out_end, in_start, in_end)
    events.sort()

    live = peak = 0
    peak_index = -1
    curve = []
    by_time: dict[int, int] = {}  # highest live bytes seen at each event time
    if detail:
        for idx, (time, _phase, _kind, _tid, delta) in enumerate(events):
            live += delta
            if delta > 0 and live > peak:
                peak, peak_index = live, idx
            if live > by_time.get(time, -1):
                by_time[time] = live
            curve.append((time, live))
    else:
        for idx, event in enumerate(events):
            live += event[4]
            if live > peak:
                peak, peak_index = live, idx
    executor = schedule.memory_model == "executor"
    if not detail:
        by_position = ()
    elif executor:
        by_position = _by_order(n, events)
    else:
        by_position = _by_position(start, end, events, by_time)
    live_set: dict[tuple[str, int], int] = {}
    kinds = ("swapin", "tensor")
    for _time, _phase, kind, tid, delta in (events[: peak_index + 1] if detail else ()):
        if kind > 1 or kind < 0:
            continue  # kernel scratch is not a tensor
        if delta > 0:
            live_set[(kinds[kind], tid)] = delta
        else:
            live_set.pop((kinds[kind], tid), None)
    live_at_peak = tuple(sorted(((k, t, b) for (k, t), b in live_set.items()), key=lambda x: (-x[2], x[1], x[0])))
    peak_time = events[peak_index][0] if peak_index >= 0 else 0
    peak_position = bisect.bisect_right(start, peak_time) - 1 if n else 0
    if executor and peak_index >= 0:
        peak_position = min(events[peak_index][1] // 4, n - 1)

    for first, last, num_bytes in schedule.host_held:
        host_events.append((start[first], 0, num_bytes))
        host_events.append((end[last], 1, -num_bytes))
    host_events.sort()
    host_live = host_peak = 0
    host_curve = []
    for time, _phase, delta in host_events:
        host_live += delta
        host_peak = max(host_peak, host_live)
        host_curve.append((time / 1e6, host_live))

    compute_us = sum(schedule.compute)
    allocator_peak = peak + schedule.resident_bytes
    if allocator and executor:
        from lmscli.model.memmodel import allocator_high_water, bounded_min_limit, in_pieces

        events = in_pieces(events, schedule.tensors)
        allocator_peak = max(allocator_peak, allocator_high_water(events, schedule.resident_bytes))
        allocator_peak = bounded_min_limit(events, schedule.resident_bytes, start=allocator_peak)
    return SimResult(
        peak_bytes=peak + schedule.resident_bytes,
        activation_peak_bytes=peak,
        resident_bytes=schedule.resident_bytes,
        peak_time=peak_time / 1e6,
        peak_position=max(peak_position, 0),
        live_at_peak=live_at_peak,
        memory_by_position=by_position,
        curve=tuple((t / 1e6, b) for t, b in curve),
        host_peak_bytes=host_peak,
        host_curve=tuple(host_curve),
        swap_out_bytes=sum(tensors[tid].num_bytes for tid, s in swap_of.items() if not s.recompute),
        swap_in_bytes=sum(tensors[tid].num_bytes * len(s.groups) for tid, s in swap_of.items() if not s.recompute),
        num_swap_outs=sum(1 for s in swap_of.values() if not s.recompute),
        num_swap_ins=sum(len(s.groups) for s in swap_of.values() if not s.recompute),
        compute_time=compute_us / 1e6,
        step_time=step_time / 1e6,
        stall_time=max(0, step_time - compute_us) / 1e6,
        transfers=tuple((d, tid, s / 1e6, e / 1e6) for d, tid, s, e in records),
        starts=tuple(start),
        ends=tuple(end),
        allocator_peak_bytes=allocator_peak,
        recompute_time=recompute_us / 1e6,
        num_recomputes=sum(len(s.groups) for s in swap_of.values() if s.recompute),
        recompute_bytes=sum(tensors[tid].num_bytes * len(s.groups) for tid, s in swap_of.items() if s.recompute),
        stack_copy_bytes=sum(num_bytes for _, num_bytes, _ in schedule.stack_copies),
    )


def clone_sources(schedule: Schedule, swap: SimSwap) -> tuple[int, ...]:
    """The tensors the clones of a recomputation read from outside their chain: its sources."""
    chain = set(swap.chain)
    return tuple(sorted({tid for k in swap.chain for tid in schedule.inputs[k]
                         if schedule.tensors[tid].producer not in chain}))


def _read_by_clones(schedule, swap_of, in_end) -> dict[int, tuple[int, int]]:
    """Per tensor the clones of a recomputation read where it is (not from a swap-in), when the
    last of those clones ends: its buffer is held until then. A recipe may read a source the
    step no longer needs by then (a transformer's attention scores made again from its queries
    and keys, which the step dropped after the forward pass)::

        q, k --> QK^T --> softmax --> ... backward ... clones(q, k) --> softmax' --> its gradient
                 q and k held until the clones have run
    """
    held: dict[int, tuple[int, int]] = {}  # tensor -> (time, order) the last clones reading it end
    for tid, swap in swap_of.items():
        if not swap.recompute:
            continue
        via = {s for s, _g in swap.via}
        for src in clone_sources(schedule, swap):
            if src in via or src in swap_of:
                continue
            for g, group in enumerate(swap.groups):
                held[src] = max(held.get(src, (0, 0)), (in_end[(tid, g)], 4 * group.trigger + 3))
    return held


def _read_via(swap_of, in_end) -> dict[tuple[int, int], tuple[int, int]]:
    """Per swap-in or recomputation group another recomputation's clones read (``via``), when the
    last of those clones ends: its buffer stays until then. (Planned clones run before the group's
    last consumer; a plan read back from JSON may say otherwise.)"""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for tid, swap in swap_of.items():
        if not swap.recompute:
            continue
        for key in swap.via:
            for g, group in enumerate(swap.groups):
                out[key] = max(out.get(key, (0, 0)), (in_end[(tid, g)], 4 * group.trigger + 3))
    return out


def _grappler_events(schedule, swap_of, start, end, out_start, out_end, in_start, in_end):
    """Memory events of Grappler's accounting: every output a tensor of its own, live from its
    producer's start to its last consumer's end (or the end of the clones that read it); at one
    instant allocations come first."""
    events = []
    held = _read_by_clones(schedule, swap_of, in_end)
    via_read = _read_via(swap_of, in_end)
    for t in schedule.tensors:
        p = t.producer
        swap = swap_of.get(t.id)
        events.append((start[p], 0, 1, t.id, t.num_bytes))
        if swap is None:
            last = t.consumers[-1] if t.consumers else p
            events.append((max(end[last], held.get(t.id, (0, 0))[0]), 1, 1, t.id, -t.num_bytes))
            continue
        free_at = max([out_end[t.id]] + [end[c] for c in swap.near])
        events.append((free_at, 1, 1, t.id, -t.num_bytes))
        for g, group in enumerate(swap.groups):
            events.append((in_start[(t.id, g)], 0, 0, t.id, t.num_bytes))
            events.append((max(end[group.consumers[-1]], via_read.get((t.id, g), (0, 0))[0]), 1, 0, t.id,
                           -t.num_bytes))
            if swap.extra:
                events.append((in_start[(t.id, g)], 0, 2, -1 - t.id, swap.extra))
                events.append((in_end[(t.id, g)], 1, 2, -1 - t.id, -swap.extra))
    return events, _host_events(schedule.tensors, swap_of, out_start, out_end, in_end)


def _host_events(tensors, swap_of, out_start, out_end, in_end):
    """Host memory of the swapped tensors (both models): held from the swap-out's start until the
    swap-out and every swap-in of it are done."""
    host_events = []
    for tid in sorted(swap_of):
        if swap_of[tid].recompute:
            continue
        size = tensors[tid].num_bytes
        host_events.append((out_start[tid], 0, size))
        done = [out_end[tid]] + [in_end[(tid, g)] for g in range(len(swap_of[tid].groups))]
        host_events.append((max(done), 1, -size))
    return host_events


def _executor_events(schedule, swap_of, start, end, out_start, out_end, in_start, in_end):
    """Memory events of TensorFlow's executor (see :mod:`lmscli.model.memmodel`): one buffer per group of
    tensors sharing it (forwarded or reused in place), allocated when its first tensor's producer
    starts and freed after the last use of any of them; ops one after another, each freeing what it
    was the last to read before the next allocates; sizes rounded as the allocator rounds them.

    Order keys are ``4 * position + phase``: 0 allocation, 1 scratch free, 2 free after an op,
    3 free when a swap-out ends (after the allocations of the op running then)."""
    from lmscli.model.memmodel import OWN, RESIDENT, rounded

    tensors = schedule.tensors
    shares, in_place = schedule.shares, schedule.in_place

    def running(time: int) -> int:  # the op running (or last started) at ``time``
        return max(bisect.bisect_right(start, time) - 1, 0)

    def use_end(t) -> tuple[int, int]:  # when the GPU copy of ``t`` is last used
        swap = swap_of.get(t.id)
        if swap is None:
            last = t.consumers[-1] if t.consumers else t.producer
            return (end[last], 4 * last + 2)
        if swap.recompute:  # no transfer holds it: freed after the producer or the near consumers
            key = (end[t.producer], 4 * t.producer + 2)
            return max([key] + [(end[c], 4 * c + 2) for c in swap.near])
        at = running(out_end[t.id])
        if start[at] >= out_end[t.id] and (at in swap.waiters or (swap.sync_out and at in swap.near)):
            at -= 1  # the op starting as the swap-out ends waits for it: the copy is gone before it allocates
        key = (out_end[t.id], 4 * at + 3)
        return max([key] + [(end[c], 4 * c + 2) for c in swap.near])

    def not_in_place(tid: int, link: int) -> bool:
        """An in-place reuse the plan breaks: the input is swapped out (its transfer still holds
        the buffer). (A stand-in plan's swapped output is sent through an Identity, so on the
        stand-in too its kernel writes over its input: see :mod:`lmscli.emit.rewriter`.)"""
        return link in swap_of and not swap_of[link].recompute

    buffer_of: dict[int, tuple] = {}  # tensor id -> ("t", root id) or ("in", tensor id, group)
    alloc: dict[tuple, tuple[int, int, int]] = {}  # buffer -> (time, order, bytes)
    free: dict[tuple, tuple[int, int]] = {}
    for t in tensors:
        link = shares[t.id] if shares else OWN
        if link == RESIDENT:
            continue
        if link == OWN or (in_place[t.id] and not_in_place(t.id, link)):
            key = ("t", t.id)
            alloc[key] = (start[t.producer], 4 * t.producer, rounded(t.num_bytes))
        else:
            key = buffer_of.get(link)
            if key is None:
                continue  # shares a resident buffer through a chain
            source = swap_of.get(link)
            # Forwarded from a swap-in it reads, or written over a recomputation's clones in place?
            if source is not None and (not in_place[t.id] or source.recompute):
                for g, group in enumerate(source.groups):
                    if t.producer in group.consumers:
                        key = ("in", link, g)
                        break
        buffer_of[t.id] = key
        free[key] = max(free.get(key, (0, 0)), use_end(t))
    for src, until in _read_by_clones(schedule, swap_of, in_end).items():
        key = buffer_of.get(src)
        if key is not None:  # (held until the clones reading it have run)
            free[key] = max(free[key], until)
    events = []
    via_read = _read_via(swap_of, in_end)
    for tid in sorted(swap_of):
        for g, group in enumerate(swap_of[tid].groups):
            key = ("in", tid, g)
            at = in_start[(tid, g)]
            # A swap-in's buffer is taken when its transfer starts; clones run after their trigger
            # has ended and freed what it was the last to read.
            order = 4 * group.trigger + 3 if swap_of[tid].recompute else 4 * running(at)
            alloc[key] = (at, order, rounded(tensors[tid].num_bytes))
            last = group.consumers[-1]
            free[key] = max(free.get(key, (0, 0)), (end[last], 4 * last + 2), via_read.get((tid, g), (0, 0)))
            if swap_of[tid].extra:  # intermediate results of the clones, while they run
                events.append((at, order, 2, -1 - tid, swap_of[tid].extra))
                events.append((in_end[(tid, g)], order, 2, -1 - tid, -swap_of[tid].extra))
    for key, (time, order, size) in alloc.items():
        kind = 1 if key[0] == "t" else 0
        tid = key[1]
        events.append((time, order, kind, tid, size))
        f_time, f_order = free.get(key, (time, order + 2))
        events.append((f_time, f_order, kind, tid, -size))
    first = schedule.scratch_first
    for k, size in enumerate(schedule.scratch):
        if size > 0:  # before the op's outputs (kind -1 sorts first) or after them
            kind = SCRATCH_FIRST if first and first[k] else SCRATCH
            events.append((start[k], 4 * k, kind, k, size))
            events.append((end[k], 4 * k + 1, kind, k, -size))
    for j, (first, last, size) in enumerate(schedule.ahead):  # loop iterations running ahead
        events.append((start[first], 4 * first, 4, j, rounded(size)))
        events.append((end[last], 4 * last + 2, 4, j, -rounded(size)))
    return events, _host_events(tensors, swap_of, out_start, out_end, in_end)


def _by_order(n: int, events) -> tuple[int, ...]:
    """Executor model: highest live bytes while each op runs (its own events and the level it
    finds), from events sorted by (time, 4 * position + phase)."""
    out = [0] * n
    live = 0
    j = 0
    for k in range(n):
        best = live
        while j < len(events) and events[j][1] // 4 <= k:
            live += events[j][4]
            best = max(best, live)
            j += 1
        out[k] = best
    return tuple(out)


def _by_position(start, end, events, by_time) -> tuple[int, ...]:
    """Highest live activation bytes while each op runs (from its start to its end, inclusive)."""
    n = len(start)
    times = sorted(by_time)
    # Live bytes just after all events at each time, to carry the level across quiet intervals.
    level_after = {}
    live = 0
    j = 0
    for time in times:
        while j < len(events) and events[j][0] == time:
            live += events[j][4]
            j += 1
        level_after[time] = live
    out = [0] * n
    for k in range(n):
        lo = bisect.bisect_left(times, start[k])
        hi = bisect.bisect_right(times, end[k])
        best = 0
        if lo > 0:
            best = level_after[times[lo - 1]]
        for idx in range(lo, hi):
            best = max(best, by_time[times[idx]])
        out[k] = best
    return tuple(out)
