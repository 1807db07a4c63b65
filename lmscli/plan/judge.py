"""The checks a plan's rewrite must pass before the tune loop (:mod:`lmscli.plan.tuning`) accepts it.

* the **optimizer guard** (:func:`optimizer_culprits`): Grappler's default optimizations must treat
  the rewritten graph as they treat the original, else training is not bit-identical; the edits
  that make them differ are named, and the loop plans again without them;
* the **judge** (:func:`run_peak`): the peak of the graph a Session really runs (the rewrite after
  Grappler's optimizations) by the executor model or, for the stand-in, by real runs under the
  limit (:func:`stand_in_need`);
* **Grappler's estimate** (:func:`check_with_grappler`), kept as a second opinion.
"""

from __future__ import annotations

from dataclasses import replace

from lmscli import timing
from lmscli.analysis import Prepared
from lmscli.device import Device
from lmscli.plan.document import Plan
from lmscli.emit.rewriter import DEFAULT_HOST_DEVICE, emit
from lmscli.timing import timed
from lmscli.units import format_size

GUARD_HOPS = 4  # how far from a node Grappler optimizes differently a swap is held responsible


def check_with_grappler(prepared: Prepared, plan: Plan, host_device: str = DEFAULT_HOST_DEVICE,
                        rewritten=None) -> dict:
    """Grappler's estimate of the rewritten graph (tensors on each virtual GPU, plus the bytes
    resident there). ``per_device`` holds each GPU's figures; the top-level ones are the largest.
    ``rewritten`` (the plan already emitted) saves emitting it again."""
    from lmscli import grappler

    meta = rewritten if rewritten is not None else emit(prepared, plan, host_device=host_device, force=True)[0]
    estimate = grappler.estimate_peak(meta, prepared.model.fetches)
    budget = int(plan.device.get("budget_bytes", 0))
    per_device = {}
    for schedule in prepared.schedules or (prepared.schedule,):
        tensors = estimate.gpu_peaks.get(schedule.device, 0)
        total = tensors + schedule.resident_bytes
        per_device[schedule.device] = {"peak_bytes": total, "tensor_peak_bytes": tensors,
                                       "fits": total <= budget if budget else None}
    worst = max(per_device.values(), key=lambda f: f["peak_bytes"])
    figures = {"peak_bytes": worst["peak_bytes"], "tensor_peak_bytes": worst["tensor_peak_bytes"],
               "host_peak_bytes": estimate.host_peak_bytes,
               "fits": all(f["fits"] for f in per_device.values()) if budget else None}
    if len(per_device) > 1:
        figures["per_device"] = per_device
    return figures


def _breaking(prepared: Prepared, plan: Plan) -> tuple[str, ...]:
    """The tensors of a smallest part of ``plan``'s edits, found by halving, whose rewrite
    Grappler's default optimizations fail on (all of them when no half fails alone)."""
    from lmscli.plan import optguard

    every = [edit.tensor for edit in plan.edits] + [h.stack for h in plan.host_stacks]

    def fails(keep: list) -> bool:
        part = optguard.without(plan, set(every) - set(keep), ())
        return prepared.grappler(emit(prepared, part, force=True)[0]) is None

    found = every
    while len(found) > 1:
        half = len(found) // 2
        if fails(found[:half]):
            found = found[:half]
        elif fails(found[half:]):
            found = found[half:]
        else:
            break
    return tuple(found)


def optimizer_culprits(prepared: Prepared, plan: Plan, rewritten, optimized=None,
                       waiters: set | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The swapped tensors and serialized ops of ``plan`` that make Grappler's default
    optimizations treat ``rewritten`` differently from the original (see :mod:`lmscli.plan.optguard`).
    ``optimized``: what those optimizations make of ``rewritten``, if already known. ``waiters``:
    a set to receive the waiters that alone involve a swap (see :func:`optguard.culprits`)."""
    from lmscli.plan import optguard

    if prepared.optimized is None or not (plan.changes or plan.serialize):
        return (), ()
    if optimized is None:
        optimized = prepared.grappler(rewritten)
    if optimized is None:
        # Grappler optimizes the original but fails on the rewrite (a Session would then run it
        # unoptimized, or with optimizers skipped): the edits that make it fail are the culprits.
        return _breaking(prepared, plan), ()
    view = prepared.view
    taken_out = frozenset(op for h in plan.dropped for op in h.ops
                          if op in view.index and view.ops[view.index[op]] == "TensorListPushBack")
    names = optguard.involved(prepared.optimized, optimized, taken_out)
    if prepared.optimized_on_cpu is not None:  # (and as `lms verify` runs the two graphs, on CPUs)
        on_cpu = prepared.grappler_on_cpu(rewritten)
        names |= optguard.involved(prepared.optimized_on_cpu, on_cpu, taken_out) if on_cpu is not None else frozenset()
    if not names:
        return (), ()
    for hops in range(GUARD_HOPS + 1):  # the nearest swaps first
        found = optguard.culprits(plan, optguard.around(prepared.view, names, hops), waiters)
        if found[0] or found[1] or waiters:
            return found
    return (), ()


@timed("judge")
def run_peak(prepared: Prepared, rewritten, optimized, link_bandwidth: float = float("inf"),
             device: Device | None = None) -> int | None:
    """The judge's figure for ``rewritten``: see :func:`lmscli.analysis.run_peak`, with transfers at
    ``link_bandwidth``. For the stand-in (a step prepared with :func:`lmscli.api.for_stand_in`) the judge is
    the truth: :func:`stand_in_need` on ``device``."""
    from lmscli.analysis import run_peak as peak_of

    if prepared.stand_in is None or device is None:
        return peak_of(prepared.model, rewritten, optimized, link_bandwidth=link_bandwidth,
                       known=prepared.view.tensor_facts(), fed=prepared.view.fed)
    return stand_in_need(prepared, rewritten, device)


def judged_limits(device: Device) -> tuple[int, int]:
    """The two limits :func:`stand_in_need` runs a rewrite under: the device's whole memory in whole
    MiB (at least 1 MiB), and that less half the reserve (at least 1 MiB less), the headroom a plan
    keeps."""
    from lmscli.prove.standin import MIB

    limit = max(MIB, device.gpu_mem // MIB * MIB)
    return limit, max(MIB, (limit - max(MIB, int(limit * device.reserve / 2))) // MIB * MIB)


def region_need(prepared: Prepared, plan: Plan, device: Device) -> int:
    """The smallest limit under which the plan's step finds room in the stand-in allocator's one
    region, fragmentation included, by the executor model in the order the planner plans in (the
    original's traced order): :func:`lmscli.model.memmodel.bounded_min_limit`. The planner counts
    the bytes in use; the allocator can need much more for the same bytes (a 3D U-Net plan with
    58 MiB in use at its peak was modelled to need 73 MiB, and one with 66 MiB in use ran out of
    memory under 78 MiB: a 16 MiB request failed with 47 MiB in use)."""
    from lmscli.model.simulator import simulate
    from lmscli.plan.document import simulated

    return simulate(*simulated(plan, prepared.schedule, prepared.view), device.link_bandwidth, detail=False,
                    allocator=True).allocator_peak_bytes


STAND_IN_JUDGE_RUNS = 5  # fresh runs of a rewrite on the stand-in before its judge says it fits ...
STAND_IN_JUDGE_STEPS = 2  # ... of this many training steps each, as `lms verify` runs


def judge_runs(prepared: Prepared) -> int:
    """How many fresh runs the stand-in's judge makes under each of its limits."""
    return prepared.judge_runs or STAND_IN_JUDGE_RUNS


@timed("judge on the stand-in")
def stand_in_need(prepared: Prepared, rewritten, device: Device) -> int:
    """The rewritten step run on the stand-in GPU as ``lms verify --gpu-mem`` will run it: under
    the limit less half the reserve (at least 1 MiB less), :data:`STAND_IN_JUDGE_RUNS` (or
    ``prepared.judge_runs``: ``--judge-runs``) fresh runs of :data:`STAND_IN_JUDGE_STEPS` steps
    (the variables left unread), then as many under the device's whole memory (in whole MiB).
    When every run fits, the budget (or the peak in use under the limit, if less); when a run
    fails, the budget plus what it lacked (what it had in use and the request that failed, beyond
    the limit it ran under; at least 2%). The runs are recorded in the plan
    (``predicted['stand_in']``).

    The room between the budget and the memory (``--reserve``) absorbs the runs' variation: the
    executor's order and the moments transfers land vary, and with them the allocator's
    fragmentation (not even monotonically: a plan can fit under one limit and not under a larger
    one). So a plan must keep headroom in real runs, not only in the model: QA plans that trained
    five times under their limit then ran out of memory in `lms verify` (an Inception at 98% of
    its limit; a decoder with 1.2 MiB free under 20 MiB, in 1 run of 18; an Inception plan whose
    five runs peaked at 23.5 MiB in use under 29, then needed 29.7 in one verify run of ten). The
    peak in use cannot tell: BFC hands a free chunk out whole when splitting it would leave less
    than the request (a two-loss net showed 53.9 of 54 MiB in use in every run, and trained under
    51), and the region's fragmentation varies from run to run.

    A graph judged under the same limits before, by the same stand-in, is not run again: its
    figure and verdict are the ones its runs gave (the region's check (:mod:`lmscli.plan.tuning`)
    comes back to the same plan from nearby margins, and the hybrid's other searches make the
    same plans: a 3D U-Net's tune ran 40 s of runs on each of them twice)."""
    import hashlib

    limit, tighter = judged_limits(device)
    stand_in = prepared.stand_in
    key = (hashlib.sha256(rewritten.SerializeToString(deterministic=True)).hexdigest(), limit, tighter,
           device.budget, tuple(prepared.model.fetches), prepared.batch_size, judge_runs(prepared))
    if key not in stand_in.judged:
        figure = _stand_in_need(prepared, rewritten, device, limit, tighter)
        stand_in.judged[key] = (figure, stand_in.last_verdict)
    figure, stand_in.last_verdict = stand_in.judged[key]
    return figure


def _stand_in_need(prepared: Prepared, rewritten, device: Device, limit: int, tighter: int) -> int:
    from lmscli.prove.standin import MIB

    stand_in = prepared.stand_in

    def runs(under: int):
        timing.step(f"running the rewritten step on the stand-in under {format_size(under)}")
        return stand_in.run(rewritten, prepared.model.fetches, under, batch_size=prepared.batch_size or 1,
                            runs=judge_runs(prepared), steps=STAND_IN_JUDGE_STEPS, peak=True,
                            values=False)

    def lacked(failed, under: int) -> int:  # the budget plus what a failed run lacked (at least 2%)
        return device.budget + max((failed.need_bytes or 0) - under, MIB, limit // 50)

    # Under the tighter limit first: a plan that fails fails there far more often (the limit's runs
    # are then not needed; a ResNet-50's judge spent half its time on runs that all fitted).
    headroom = runs(tighter)
    if not headroom.fits:
        stand_in.last_verdict = replace(headroom, limit_bytes=limit, headroom_limit_bytes=tighter,
                                        message=(f"under {format_size(tighter)} ({format_size(limit - tighter)} below "
                                                 f"the limit, the headroom a plan keeps): {headroom.message}"))
        return lacked(headroom, tighter)
    verdict = runs(limit)  # recorded as one verdict at the limit, of both sets of runs
    stand_in.last_verdict = replace(verdict, limit_bytes=limit, headroom_limit_bytes=tighter,
                                    runs=verdict.runs + headroom.runs, seconds=verdict.seconds + headroom.seconds)
    return min(verdict.peak_bytes or device.budget, device.budget) if verdict.fits else lacked(verdict, limit)
