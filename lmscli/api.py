"""The Python API: the passes the CLI runs, for scripted pipelines.

>>> from lmscli import api
>>> model = api.load("sample_graphs/cnn.meta")
>>> prepared = api.prepare(model)
>>> facts = api.analyze(prepared)
>>> result = api.tune(prepared, api.make_device(gpu_mem=int(facts.peak_bytes * 0.8), reserve=0.0))
>>> new_graph, report = api.rewrite(prepared, result.plan)
>>> api.save(model, new_graph, "/tmp/cnn.lms.meta")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import replace

from lmscli import timing
from lmscli.analysis import Analysis, Prepared, analyze, prepare, with_graph_def
from lmscli.candidates import Filters
from lmscli.device import Device, make_device
from lmscli.errors import InputError, NoFitError, PlanError
from lmscli.loader import Model, atomic_write, load, serialize
from lmscli.plan import Plan, graph_fingerprint
from lmscli.planner import (TFLMS_SEARCH_MAX_OPS, TflmsParams, TuneOptions, TuneResult, serialization_chains,
                             strategy_name)
from lmscli.rewriter import DEFAULT_HOST_DEVICE, RewriteReport
from lmscli.timing import timed
from lmscli.units import format_size

__all__ = [
    "Analysis", "Device", "Filters", "Model", "Plan", "Prepared", "RewriteReport", "TflmsParams", "TuneOptions",
    "TuneResult", "analyze", "check_with_grappler", "find_max_batch", "load", "make_device", "prepare",
    "rewrite", "save", "serialization_chains", "serialize", "tune",
]

GRAPPLER_ROUNDS = 4  # plans re-made with a tighter budget while Grappler's estimate is over it
GUARD_ROUNDS = 4  # plans re-made without the swaps that change Grappler's optimizations
FALLBACK_SHARE = 0.85  # budgets this share of the lower bound and above get the reordering fallback
GUARD_HOPS = 4  # how far from a node Grappler optimizes differently a swap is held responsible


def rewrite(prepared: Prepared, plan: Plan, host_device: str = DEFAULT_HOST_DEVICE, force: bool = False):
    """Emit the plan into a copy of the prepared graph: ``(meta_graph, RewriteReport)``."""
    from lmscli import rewriter

    if plan.graph_sha256 and plan.graph_sha256 != graph_fingerprint(prepared.graph_def):
        raise PlanError("the plan was made for a different graph (fingerprint mismatch); "
                        "re-run lms tune on this graph, or check --batch-size")
    meta = with_graph_def(prepared.model.meta_graph, prepared.graph_def)
    return rewriter.rewrite(meta, plan, host_device=host_device, force=force, view=prepared.view)


def check_with_grappler(prepared: Prepared, plan: Plan, host_device: str = DEFAULT_HOST_DEVICE,
                        rewritten=None) -> dict:
    """Grappler's estimate of the rewritten graph (tensors on each virtual GPU, plus the bytes
    resident there). ``per_device`` holds each GPU's figures; the top-level ones are the largest.
    ``rewritten`` (the plan already emitted) saves emitting it again."""
    from lmscli import grappler

    meta = rewritten if rewritten is not None else rewrite(prepared, plan, host_device=host_device, force=True)[0]
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
    from lmscli import grappler, optguard

    every = [edit.tensor for edit in plan.edits] + [h.stack for h in plan.host_stacks]

    def fails(keep: list) -> bool:
        part = optguard.without(plan, set(every) - set(keep), ())
        return grappler.optimize(rewrite(prepared, part, force=True)[0], prepared.model.fetches) is None

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


def optimizer_culprits(prepared: Prepared, plan: Plan, rewritten, optimized=None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The swapped tensors and serialized ops of ``plan`` that make Grappler's default
    optimizations treat ``rewritten`` differently from the original (see :mod:`lmscli.optguard`).
    ``optimized``: what those optimizations make of ``rewritten``, if already known."""
    from lmscli import grappler, optguard

    if prepared.optimized is None or not (plan.changes or plan.serialize):
        return (), ()
    if optimized is None:
        optimized = grappler.optimize(rewritten, prepared.model.fetches)
    if optimized is None:
        # Grappler optimizes the original but fails on the rewrite (a Session would then run it
        # unoptimized, or with optimizers skipped): the edits that make it fail are the culprits.
        return _breaking(prepared, plan), ()
    names = optguard.involved(prepared.optimized, optimized)
    if not names:
        return (), ()
    for hops in range(GUARD_HOPS + 1):  # the nearest swaps first
        found = optguard.culprits(plan, optguard.around(prepared.view, names, hops))
        if found[0] or found[1]:
            return found
    return (), ()


def run_peak(prepared: Prepared, rewritten, optimized, link_bandwidth: float = float("inf"),
             device: Device | None = None) -> int | None:
    """The judge's figure for ``rewritten``: see :func:`lmscli.analysis.run_peak`, with transfers at
    ``link_bandwidth``. For the stand-in (a step prepared with :func:`for_stand_in`) the judge is
    the truth: :func:`stand_in_need` on ``device``."""
    from lmscli.analysis import run_peak as peak_of

    if prepared.stand_in is None or device is None:
        return peak_of(prepared.model, rewritten, optimized, link_bandwidth=link_bandwidth,
                       known=prepared.view.tensor_facts())
    return stand_in_need(prepared, rewritten, device)


STAND_IN_JUDGE_RUNS = 5  # fresh runs of a rewrite on the stand-in before its judge says it fits ...
STAND_IN_JUDGE_STEPS = 2  # ... of this many training steps each, as `lms verify` runs


@timed("judge on the stand-in")
def stand_in_need(prepared: Prepared, rewritten, device: Device) -> int:
    """The rewritten step run on the stand-in GPU as ``lms verify --gpu-mem`` will run it: under
    the device's whole memory (in whole MiB), :data:`STAND_IN_JUDGE_RUNS` fresh runs of
    :data:`STAND_IN_JUDGE_STEPS` steps. When every run fits, the budget (or the allocator's peak
    bytes in use, if less); else the budget plus what the failed run lacked (what it had in use
    and the request that failed, beyond the limit; 2% when unknown); the runs themselves are recorded
    in the plan (``predicted['stand_in']``). The room between the budget
    and the memory (``--reserve``) is what absorbs the runs' variation: the executor's order and
    the moments transfers land vary, and with them the allocator's fragmentation (not even
    monotonically: a plan can fit under one limit and not under a larger one, whose region splits
    differently). So the judge runs the step under the very limit it will be proven at, and
    treats runs whose peak in use leaves less than half the reserve (at least 1 MiB) free as not
    fitting by that much: a QA Inception plan that trained 5 times at 98% of its limit then ran
    out of memory in `lms verify`."""
    from lmscli.prove.standin import MIB

    limit = max(MIB, device.gpu_mem // MIB * MIB)
    timing.step(f"running the rewritten step on the stand-in under {format_size(limit)}")
    verdict = prepared.stand_in.run(rewritten, prepared.model.fetches, limit, batch_size=prepared.batch_size or 1,
                                    runs=STAND_IN_JUDGE_RUNS, steps=STAND_IN_JUDGE_STEPS, peak=True)
    if verdict.fits:
        # Runs that fit with little room left fail in some later run (the allocator's chunks split
        # differently): the peak in use must leave half the reserve free (at least 1 MiB).
        safe = limit - max(MIB, int(limit * device.reserve / 2))
        if verdict.peak_bytes is not None and verdict.peak_bytes > safe:
            return device.budget + max(verdict.peak_bytes - safe, MIB // 4)
        return min(verdict.peak_bytes or device.budget, device.budget)
    return device.budget + max((verdict.need_bytes or 0) - limit, MIB, limit // 50)


def for_stand_in(prepared: Prepared, stand_in=None) -> Prepared:
    """The step as the CPU stand-in GPU of ``lms verify --gpu-mem`` runs it: the kernel scratch of
    this machine's CPU kernels, the CPU executor's order and the CPU's op times, all observed in
    one traced step on the stand-in itself (see :mod:`lmscli.prove.scratch`); plans for it are
    judged by real runs there (:func:`stand_in_need`). For plans meant to be proven on the
    stand-in (with the stand-in's link: :data:`lmscli.device.STAND_IN_LINK`). ``stand_in``: the
    :class:`~lmscli.prove.standin.StandIn` to use (default: one shared by the process, stopped
    at exit)."""
    from lmscli.prove.standin import shared

    stand_in = stand_in or shared()
    meta = with_graph_def(prepared.model.meta_graph, prepared.graph_def)
    seen = stand_in.observe(meta, prepared.model.fetches, batch_size=prepared.batch_size or 1)
    return replace(prepared.observed(seen.order, seen.scratch, seen.micros), stand_in=stand_in)


def tune(prepared: Prepared, device: Device, options: TuneOptions = TuneOptions(), check: bool = True,
         host_device: str = DEFAULT_HOST_DEVICE, guard: bool = True) -> TuneResult:
    """Plan with the simulator, then check the plan twice, replanning until both agree (see
    :func:`checked_tune`). When the simulator finds no plan, TFLMS's parameter sets are tried
    with Grappler's estimate as the judge (:func:`reordering_fallback`)."""
    try:
        try:
            result = checked_tune(prepared, device, options, check, host_device, guard)
            return _or_swap_plan(prepared, device, options, check, host_device, guard, result)
        except NoFitError as exc:
            if strategy_name(options.strategy) != "hybrid" or timing.out_of_time() or (
                    exc.bound_bytes is not None and exc.bound_bytes > device.budget):
                raise
            # The judge turned down every plan the hybrid chose (each the fastest of its round), and
            # a swap-only plan may still pass: the hybrid reaches every budget the swap planner does.
            try:
                result = checked_tune(prepared, device, replace(options, strategy="swap"), check, host_device, guard)
            except NoFitError:
                raise exc from None
            line = ("[LMS] no plan with recomputations passed the judge at this budget; the swap-only planner's "
                    "plan does")
            return replace(result, log=result.log + (line,))
    except NoFitError as exc:
        if not check or options.tflms is not None or prepared.schedule.memory_model != "grappler":
            raise
        if timing.out_of_time():
            raise
        if exc.bound_bytes is not None and device.budget < FALLBACK_SHARE * exc.bound_bytes:
            raise  # reordering has won 8-13% below the bound on the graphs tried, never this much
        if len(prepared.schedule) > TFLMS_SEARCH_MAX_OPS:
            raise  # eight guarded, Grappler-judged probes cost minutes on graphs this large
        fallback = reordering_fallback(prepared, device, options, host_device, guard)
        if fallback is None:
            raise
        return fallback


def _or_swap_plan(prepared: Prepared, device: Device, options: TuneOptions, check: bool, host_device: str,
                  guard: bool, result: TuneResult) -> TuneResult:
    """The hybrid's plan, or the swap planner's if that is predicted faster. Both searches move the
    planning margin until the judge accepts a plan, and they take different paths (the hybrid keeps
    the fastest candidate of each round, the swap planner the one moving the fewest bytes), so the
    swap planner's search can end on a faster plan; the hybrid must never be slower than it."""
    if (strategy_name(options.strategy) != "hybrid" or not result.necessary or timing.out_of_time()
            or result.result.step_time <= result.baseline.step_time or len(prepared.schedules) > 1):
        return result
    try:
        swap = checked_tune(prepared, device, replace(options, strategy="swap"), check, host_device, guard)
    except NoFitError:
        return result
    if not swap.fits or swap.result.step_time >= result.result.step_time:
        return result
    line = "[LMS] the swap planner's own search found a faster plan than the hybrid's; using it"
    return replace(swap, log=swap.log + (line,))


@timed("reordering fallback")
def reordering_fallback(prepared: Prepared, device: Device, options: TuneOptions, host_device: str = DEFAULT_HOST_DEVICE,
                        guard: bool = True) -> TuneResult | None:
    """TFLMS's parameter sets judged by Grappler's estimate of the rewritten graph, for budgets the
    simulator finds no plan for. The simulator keeps the step's order, and the lower bound is that
    order's; the control edges of synchronous swaps and shared swap-ins make Grappler's scheduler
    order the step differently, which can fit where that order cannot. Of the plans that fit, the
    one that swaps the fewest bytes wins; its swapout_threshold is then raised while it still fits.
    None when none fits."""
    from lmscli.planner import TflmsParams

    def attempt(params):
        try:
            result = checked_tune(prepared, device, replace(options, strategy="tflms", tflms=params), True,
                                  host_device, guard)
        except NoFitError:
            return None
        return result if result.plan.grappler.get("fits") else None

    found = [r for r in (attempt(TflmsParams(1, 1, groupby, sync)) for sync in range(4) for groupby in (0, 5)) if r]
    if not found:
        return None
    def params_of(result) -> TflmsParams:
        return TflmsParams(**{k: result.plan.parameters[k] for k in TflmsParams.__dataclass_fields__})

    best = min(found, key=lambda r: (r.plan.swap_out_bytes, r.plan.predicted["step_time_s"]))
    params = params_of(best)
    threshold = 2
    while threshold < max(prepared.schedule.levels, default=0):
        better = attempt(replace(params, swapout_threshold=threshold))
        if better is None or better.plan.swap_out_bytes >= best.plan.swap_out_bytes:
            break
        best, threshold = better, threshold * 2
    line = (f"[LMS] the simulator keeps the step's order and finds no plan in it; with TFLMS parameters "
            f"{params_of(best).line()} Grappler's scheduler "
            f"orders the step differently and its estimate fits ({best.plan.grappler['peak_bytes']:,} bytes)")
    return replace(best, log=best.log + (line,), judge="grappler")


@timed("tune")
def checked_tune(prepared: Prepared, device: Device, options: TuneOptions = TuneOptions(), check: bool = True,
                 host_device: str = DEFAULT_HOST_DEVICE, guard: bool = True) -> TuneResult:
    """Plan with the simulator, then check the plan twice, replanning until both agree:

    * the optimizer guard: Grappler's default optimizations must treat the rewritten graph as they
      treat the original (else training is not bit-identical); swaps that change them are
      forbidden and the graph replanned;
    * the judge: under the executor model (the default) the executor model's peak of the graph
      TensorFlow runs (the Grappler-optimized rewrite, :func:`run_peak`) must meet the budget; the
      planning margin moves by the difference (:class:`_RunSearch`) and Grappler's estimate is
      recorded as a second opinion. With ``--judge grappler`` (a schedule counted by Grappler's
      memory model), Grappler's estimate must fit (per GPU, for graphs placed on several); while
      it does not, the budget is tightened by the overshoot.

    ``check=False`` skips the estimate, ``guard=False`` the guard. Grappler's figures are stored in
    ``plan.grappler``, with the tensors the guard left alone."""
    from lmscli import optguard
    from lmscli.planner import tune as plan_tune

    margins: dict[str, int] = {}
    forbidden: set[str] = set()
    start = _run_margin(prepared, device, options)
    if start:
        margins[prepared.schedule.device] = start
    manual = options.strategy == "tflms" and options.tflms is not None
    try:
        result = plan_tune(prepared, device, options, margin=dict(margins))
    except NoFitError:
        run = prepared.run_peak_bytes if prepared.schedule.memory_model == "executor" and not manual else None
        if run is None or run > device.budget or len(prepared.schedules) > 1:
            raise
        # The graph as written is over the budget and below it nothing fits, but the graph
        # TensorFlow runs fits as it is (the judge below says so): plan nothing.
        from lmscli.simulator import simulate

        margins[prepared.schedule.device] = device.budget - simulate(prepared.schedule, detail=False).peak_bytes
        result = plan_tune(prepared, device, options, margin=dict(margins))
    if not (check or guard):
        return result
    estimate_rounds = guard_rounds = 0

    def noted(result):
        if not forbidden:
            return result
        line = (f"[LMS] left {len(forbidden)} tensor(s) unswapped: a swap node there changes what Grappler's "
                f"optimizations do to the graph, and with it the last bits of the results ({guard_rounds} round(s))")
        return replace(result, log=result.log + (line,))

    executor = prepared.schedule.memory_model == "executor"
    search = _RunSearch(device.budget, margins.get(prepared.schedule.device, 0), prepared.schedule.resident_bytes)
    rounds = 0
    while True:
        rounds += 1
        timing.step(f"round {rounds}: checking a plan of {len(result.plan.swaps)} swap(s)"
                    + (f" and {len(result.plan.recomputes)} recomputation(s)" if result.plan.recomputes else ""))
        meta, _ = rewrite(prepared, result.plan, host_device=host_device, force=True)
        optimized = None
        if guard or (executor and result.plan.changes):
            from lmscli import grappler

            optimized = grappler.optimize(meta, prepared.model.fetches)
        tensors, _ops = optimizer_culprits(prepared, result.plan, meta, optimized) if guard else ((), ())
        if tensors:
            forbidden.update(tensors)
            guard_rounds += 1
            if search.found and timing.out_of_time():  # a judged, guarded plan is at hand: settle for it
                search.timed_out = True
                result = search.settle(rounds)
                continue
            if guard_rounds <= GUARD_ROUNDS:  # plan again without them ...
                timing.step(f"round {rounds}: {len(tensors)} swap(s) change Grappler's optimizations; replanning")
                options = replace(options, forbidden=frozenset(forbidden))
                try:
                    result = plan_tune(prepared, device, options, margin=dict(margins))
                except NoFitError:
                    if not search.found:
                        raise
                    result = search.settle(rounds)  # judged and guarded already: settle for it
                continue
            else:  # ... or, after that many rounds, just drop them from the plan
                result = _resimulated(prepared, replace(result, plan=optguard.without(result.plan, tensors, ())))
                continue
        if executor and not manual and len(prepared.schedules) <= 1 and prepared.run_peak_bytes is not None:
            # The judge: the executor model on the graph the Session runs (Grappler-optimized).
            # (On the stand-in the step is run even when nothing is planned: the truth, not a model.)
            peak = (run_peak(prepared, meta, optimized, device.link_bandwidth, device)
                    if result.plan.changes or prepared.stand_in is not None else prepared.run_peak_bytes)
            if peak is not None and not result.plan.changes and peak <= device.budget:
                line = ("[LMS] [Simulator] LMS is not necessary: the graph TensorFlow runs after its optimizations "
                        f"needs {peak:,} bytes <= {device.budget:,}")
                result = replace(result, necessary=False, log=result.log + (line,),
                                 plan=replace(result.plan, predicted=dict(result.plan.predicted, run_peak_bytes=peak)))
            elif peak is not None:
                figures = dict(result.plan.predicted, run_peak_bytes=peak)
                verdict = prepared.stand_in.last_verdict if prepared.stand_in is not None else None
                if verdict is not None:  # what the judge's real runs showed (run_peak_bytes: fits or not)
                    figures["stand_in"] = {"limit_bytes": verdict.limit_bytes, "runs": verdict.runs,
                                           "steps": STAND_IN_JUDGE_STEPS, "fits": verdict.fits,
                                           "peak_in_use_bytes": verdict.peak_bytes, "failure": verdict.message}
                    search.note = verdict.message
                    if verdict.fits and peak > device.budget and verdict.peak_bytes and verdict.limit_bytes:
                        search.note = (f"trained, but with only {format_size(verdict.limit_bytes - verdict.peak_bytes)}"
                                       f" free at its peak under {format_size(verdict.limit_bytes)} (too little "
                                       "to hold in every run)")
                result = replace(result, plan=replace(result.plan, predicted=figures))
                step = search.judged(result, peak)
                timing.step(f"round {rounds}: the graph TensorFlow runs needs {format_size(peak)} "
                            f"(budget {format_size(device.budget)})")
                if step is not None and search.found and timing.out_of_time():
                    step = None  # refining further would pass --time-limit
                    search.timed_out = True
                if step is not None and not result.plan.changes:
                    # Nothing was planned (the graph as written fits the planning budget): plan for
                    # less than the graph as written needs, or the next round plans nothing again.
                    written = result.baseline.peak_bytes
                    step = search.margin = max(step, device.budget - written + device.budget // 200)
                replanned = False
                while step is not None:
                    margins[prepared.schedule.device] = step
                    try:
                        result = plan_tune(prepared, device, options, margin=dict(margins))
                        replanned = True
                        break
                    except NoFitError:
                        step = search.backoff()  # planned for too little: try half as far
                        if step is None and not search.found:
                            raise
                if replanned:
                    continue
                best = search.settle(rounds)
                if best is not result:
                    result = best
                    meta, _ = rewrite(prepared, result.plan, host_device=host_device, force=True)
        if not check:
            return noted(replace(result, plan=replace(result.plan, grappler={"left_alone": sorted(forbidden)}
                                                      if forbidden else {})))
        figures = check_with_grappler(prepared, result.plan, host_device, rewritten=meta)
        estimate_rounds += 1
        figures["rounds"] = estimate_rounds
        figures["margin_bytes"] = max(margins.values(), default=0)
        figures["left_alone"] = sorted(forbidden)
        result = replace(result, plan=replace(result.plan, grappler=figures))
        if figures["fits"] or manual or prepared.schedule.memory_model != "grappler":
            return noted(result)  # under the executor model, Grappler's estimate is a second opinion
        if estimate_rounds >= GRAPPLER_ROUNDS or timing.out_of_time():
            break
        per_device = figures.get("per_device") or {prepared.schedule.device: figures}
        for name, f in per_device.items():
            if not f["fits"]:
                margins[name] = margins.get(name, 0) + max(f["peak_bytes"] - device.budget, device.budget // 200)
        result = plan_tune(prepared, device, options, margin=dict(margins))
    raise NoFitError(f"the simulator found plans, but Grappler's estimate stayed over the budget after "
                     f"{GRAPPLER_ROUNDS} rounds (last {figures['peak_bytes']:,} bytes > {device.budget:,}); "
                     "try a slightly larger --gpu-mem", budget_bytes=device.budget)


def _resimulated(prepared: Prepared, result: TuneResult) -> TuneResult:
    """``result`` with its figures simulated again for the plan it now holds (after the guard took
    swaps or recomputations out of it); the judge then judges it again."""
    if len(prepared.schedules) > 1:
        return result
    from lmscli.plan import simulated
    from lmscli.planner import predicted
    from lmscli.simulator import simulate

    device = Device.from_dict(result.plan.device)
    sim = simulate(*simulated(result.plan, prepared.schedule, prepared.view), device.link_bandwidth)
    return replace(result, result=sim, plan=replace(result.plan, predicted=predicted(result.baseline, sim, result.budget)))


def _run_margin(prepared: Prepared, device: Device, options: TuneOptions) -> int:
    """The planning margin to start from under the executor judge: when Grappler's optimizations
    shrink the step (the optimized graph's peak below the peak as written), plan for the budget
    scaled up by that ratio, so that the graph the Session runs lands near the budget."""
    if (prepared.schedule.memory_model != "executor" or len(prepared.schedules) > 1
            or (options.strategy == "tflms" and options.tflms is not None)):
        return 0
    from lmscli.simulator import simulate

    written = simulate(prepared.schedule, detail=False).peak_bytes
    runs = prepared.run_peak_bytes
    if runs is None or written <= 0 or runs >= written:
        return 0
    return device.budget - int(device.budget * written / runs)


class _RunSearch:
    """The planning budget that makes the optimized graph's peak meet the real budget.

    The planner works on the graph as written; the Session runs what Grappler's optimizations make
    of it, which may need less (folded and fused subgraphs) or more. Each round the planning
    margin moves by the difference between the judged peak and the budget; the fitting plan that
    swaps the fewest bytes is kept, and the search stops once a fitting plan is within 2% of the
    budget or after :data:`RUN_ROUNDS` rounds."""

    def __init__(self, budget: int, margin: int, floor: int = 0):
        self.budget, self.margin = budget, margin
        self.floor = floor  # planning below this (what stays resident) cannot be right: stop instead
        self.rounds = 0
        self.found: list = []
        self.last = None
        self.done = False  # settled on the best plan found
        self.note = None  # what the stand-in said of the last plan it ran
        self.previous = margin  # the margin before the last step (see backoff)
        self.timed_out = False  # settled because --time-limit passed

    def judged(self, result, peak: int) -> int | None:
        """Record a judged plan; the next margin to plan with, or None to stop."""
        if self.done:
            return None
        self.rounds += 1
        self.last = result
        if peak <= self.budget:
            self.found.append(result)
            if peak >= 0.97 * self.budget:
                return None
        if self.rounds >= RUN_ROUNDS:
            return None
        step = peak - self.budget
        if step > 0:
            step = max(step, self.budget // 200)
            # Plan the graph as written for less than this plan needs as written (its peak may sit
            # well under the planning budget: a larger margin alone would give the same plan).
            written = getattr(getattr(result, "result", None), "peak_bytes", None)
            if written is not None:
                step = max(step, self.budget - written + step - self.margin)
        if self.budget - (self.margin + step) <= self.floor:
            return None  # the graph as written would be planned for less than stays resident
        self.previous = self.margin
        self.margin += step
        return self.margin

    def backoff(self) -> int | None:
        """The planner found nothing at the last margin: half-way back to the one before, or None
        once the two are within 0.5% of the budget."""
        if self.margin - self.previous <= self.budget // 200:
            return None
        self.margin = (self.margin + self.previous) // 2
        return self.margin

    def best(self):
        if not self.found:
            peak = self.last.plan.predicted.get("run_peak_bytes")
            if self.note:
                raise NoFitError(f"no plan made held on the stand-in after {self.rounds} round(s); the last one: "
                                 f"{self.note}; try a slightly larger --gpu-mem or leave more room (--reserve)",
                                 budget_bytes=self.budget)
            raise NoFitError(f"planned for the graph as written, but the graph TensorFlow runs after its optimizations "
                             f"still needs {peak:,} bytes > {self.budget:,} after {self.rounds} round(s); try a "
                             "slightly larger --gpu-mem", budget_bytes=self.budget)
        if self.found[0].plan.strategy in ("hybrid", "recompute"):  # a short step, then the least moved
            from lmscli.planner import STEP_TOLERANCE

            fastest = min(r.plan.predicted["step_time_s"] for r in self.found)
            fast = [r for r in self.found if r.plan.predicted["step_time_s"] <= fastest * (1 + STEP_TOLERANCE) + 1e-6]
            return min(fast, key=lambda r: (r.plan.swap_out_bytes + r.plan.recompute_bytes,
                                            r.plan.predicted["step_time_s"], r.plan.predicted["run_peak_bytes"]))
        return min(self.found, key=lambda r: (r.plan.swap_out_bytes, r.plan.predicted["run_peak_bytes"]))

    def settle(self, rounds: int):
        """Stop searching: the best plan found, marked when --time-limit stopped the search (the
        mark is kept with the plan, so settling again returns the same marked plan)."""
        self.done = True
        best = self.best()
        if self.timed_out and not best.time_limited:
            line = (f"[LMS] stopped at --time-limit after {rounds} round(s): the best fitting plan found by then "
                    "(more time may find one that swaps less)")
            marked = replace(best, time_limited=True, log=best.log + (line,))
            self.found = [marked if r is best else r for r in self.found]
            best = marked
        return best


RUN_ROUNDS = 5


@timed("largest batch search")
def find_max_batch(model: Model, device: Device, options: TuneOptions = TuneOptions(), limit: int = 1 << 16,
                   cost_model: str = "grappler", judge: str = "executor"):
    """The largest batch size for which a plan fits ``device`` (exponential then binary search).
    Returns ``(batch_size, TuneResult, Prepared)``; raises NoFitError if batch 1 does not fit."""
    def attempt(batch: int):
        prepared = prepare(model, batch_size=batch, cost_model=cost_model, judge=judge)
        if not prepared.batched_placeholders:
            raise InputError("--find-max-batch needs a graph whose placeholders have an unknown batch dimension")
        try:
            return tune(prepared, device, options, check=False, guard=False), prepared
        except NoFitError:
            return None

    first = attempt(1)
    if first is None:
        raise NoFitError("even batch size 1 does not fit this device")
    best = (1,) + first
    lo, hi = 1, None
    batch = 2
    stopped = False
    while hi is None and batch <= limit:
        if timing.out_of_time():
            stopped = True
            break
        timing.step(f"batch size {batch}")
        got = attempt(batch)
        if got is None:
            hi = batch
        else:
            best, lo = (batch,) + got, batch
            batch *= 2
    if hi is None:
        hi = limit + 1
    while hi - lo > 1 and not stopped:
        if timing.out_of_time():
            stopped = True
            break
        mid = (lo + hi) // 2
        timing.step(f"batch size {mid}")
        got = attempt(mid)
        if got is None:
            hi = mid
        else:
            best, lo = (mid,) + got, mid
    batch, _result, prepared = best
    result = tune(prepared, device, options, check=True)
    if stopped:
        untried = (f"{hi} does not fit, sizes between were not tried" if hi is not None
                   else "larger sizes were not tried")
        line = f"[LMS] stopped the batch-size search at --time-limit: {batch} fits ({untried})"
        result = replace(result, time_limited=True, log=result.log + (line,))
    return batch, result, prepared


@timed("write")
def save(model: Model, meta_graph, path: str) -> str:
    """Write ``meta_graph`` to ``path`` in the input's format, atomically; never over the input."""
    if os.path.exists(path) and os.path.exists(model.path) and os.path.samefile(path, model.path):
        raise InputError(f"{path}: refusing to overwrite the input; write to another file")
    fmt = model.format
    if fmt == "savedmodel":
        fmt = "metagraph"  # the rewritten graph of a SavedModel is written as a MetaGraphDef
    atomic_write(path, serialize(meta_graph, fmt))
    return fmt


def with_link_predictions(prepared: Prepared, result: TuneResult) -> TuneResult:
    """Add the plan's predicted step time on each named link to ``plan.predicted['per_link']``
    (for graphs on several GPUs: the slowest GPU's step)."""
    from lmscli.device import LINKS
    from lmscli.plan import simulated
    from lmscli.simulator import simulate

    per_link = {}
    for name in ("nvlink2", "pcie3"):
        base = step = 0.0
        peak = 0
        for schedule in prepared.schedules or (prepared.schedule,):
            sim = simulate(*simulated(result.plan, schedule, prepared.view), LINKS[name], detail=False)
            base = max(base, simulate(schedule, (), LINKS[name], detail=False).step_time)
            step, peak = max(step, sim.step_time), max(peak, sim.peak_bytes)
        per_link[name] = {"step_time_s": step, "overhead": round(step / base - 1.0, 6) if base else 0.0,
                          "peak_bytes": peak}
    predicted = dict(result.plan.predicted, per_link=per_link)
    return replace(result, plan=replace(result.plan, predicted=predicted))


def replay(prepared: Prepared, plan: Plan) -> TuneResult:
    """Simulate a given plan (e.g. one read with --plan) as a TuneResult, for reports and plots; for
    a graph on several GPUs, as seen by the GPU that needs the most memory with the plan."""
    from lmscli.device import NO_BUDGET, Device
    from lmscli.plan import simulated
    from lmscli.planner import predicted
    from lmscli.simulator import simulate

    device = Device.from_dict(plan.device) if plan.device else Device(gpu_mem=NO_BUDGET)
    replays = []
    for schedule in prepared.schedules or (prepared.schedule,):
        baseline = simulate(schedule, (), device.link_bandwidth)
        result = simulate(*simulated(plan, schedule, prepared.view), device.link_bandwidth)
        replays.append((result.peak_bytes, schedule.device, baseline, result))
    _peak, _name, baseline, result = max(replays, key=lambda r: r[0])
    filled = replace(plan, predicted=predicted(baseline, result, device.budget))
    return TuneResult(filled, baseline, result, device.budget, plan.changes, ())
