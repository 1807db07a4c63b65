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
from contextlib import contextmanager
from dataclasses import replace

from lmscli.analysis import Analysis, Prepared, analyze, prepare, with_graph_def
from lmscli.plan.candidates import Filters
from lmscli.device import Device, make_device
from lmscli.errors import InputError, NoFitError
from lmscli.plan.judge import STAND_IN_JUDGE_RUNS, check_with_grappler, optimizer_culprits
from lmscli.loader import Model, atomic_write, load, serialize
from lmscli.plan.document import Plan
from lmscli.plan.planner import TflmsParams, TuneOptions, TuneResult, serialization_chains
from lmscli.emit.rewriter import DEFAULT_HOST_DEVICE, RewriteReport, emit
from lmscli.timing import timed
from lmscli.plan.tuning import checked_tune, find_max_batch, reordering_fallback, tune

__all__ = [
    "Analysis", "Device", "Filters", "Model", "Plan", "Prepared", "RewriteReport", "TflmsParams", "TuneOptions",
    "TuneResult", "analyze", "check_with_grappler", "find_max_batch", "load", "make_device", "prepare",
    "rewrite", "save", "serialization_chains", "serialize", "tune",
    # the tune loop's and the judge's own steps (lmscli.plan.tuning, lmscli.plan.judge), for scripts
    "NoFitError", "STAND_IN_JUDGE_RUNS", "checked_tune", "optimizer_culprits", "reordering_fallback",
]


def rewrite(prepared: Prepared, plan: Plan, host_device: str = DEFAULT_HOST_DEVICE, force: bool = False):
    """Emit the plan into a copy of the prepared graph: ``(meta_graph, RewriteReport)``."""
    with _stand_in_hint(prepared, plan):
        return emit(prepared, plan, host_device=host_device, force=force)


@contextmanager
def _stand_in_hint(prepared: Prepared, plan: Plan):
    """A PlanError raised applying a stand-in plan (:attr:`Plan.stand_in`) to a step not prepared
    for the stand-in says so: its triggers follow the order the stand-in ran the step in."""
    from lmscli.errors import PlanError

    try:
        yield
    except PlanError as exc:
        if not plan.stand_in or prepared.stand_in is not None:
            raise
        raise PlanError(f"{exc} (this plan was made for the stand-in GPU, in the order its traced steps ran: apply it "
                        "with --stand-in, or to a step prepared with api.for_stand_in)") from None


def stand_in_step(model: Model) -> Model:
    """``model`` fetching what a step on the stand-in runs (its fetches and the loss: see
    :func:`lmscli.prove.steps.step_fetches`); ``model`` itself when that is the same. Prepare
    this for :func:`for_stand_in`, which otherwise prepares the step again."""
    from lmscli.prove.steps import step_fetches

    fetches = step_fetches(model.meta_graph, model.fetches)
    return model if fetches == tuple(model.fetches) else replace(model, fetches=fetches)


def for_stand_in(prepared: Prepared, stand_in=None, judge_runs: int | None = None,
                 feed_values: dict | None = None) -> Prepared:
    """The step as the CPU stand-in GPU of ``lms verify --gpu-mem`` runs it: the kernel scratch of
    this machine's CPU kernels, the CPU executor's order and the CPU's op times, all observed in
    traced steps on the stand-in itself (see :mod:`lmscli.prove.scratch`); plans for it are
    judged by real runs there (:func:`stand_in_need`). For plans meant to be proven on the
    stand-in (with the stand-in's link: :data:`lmscli.device.STAND_IN_LINK`). ``stand_in``: the
    :class:`~lmscli.prove.standin.StandIn` to use (default: one shared by the process, stopped
    at exit); ``judge_runs``: the judge's fresh runs under each of its two limits (default
    :data:`STAND_IN_JUDGE_RUNS`; fewer: a faster tune, less evidence against a run that varies);
    ``feed_values``: values for placeholders the steps there are fed (``--feed``; a StandIn of
    its own then)."""
    if judge_runs is not None and judge_runs < 1:
        raise InputError(f"the stand-in's judge needs at least one run per limit, not {judge_runs}")
    from lmscli.prove.standin import StandIn, shared

    if len(prepared.devices) > 1:
        raise InputError(
            f"the graph places ops on {len(prepared.devices)} GPUs ({', '.join(prepared.devices)}), and the stand-in "
            "GPU runs all of them in one process under one limit, so it cannot judge plans made per GPU: plan "
            "without --stand-in (every GPU against the budget) and prove the rewrite with `lms verify ORIGINAL "
            "REWRITTEN`; `lms measure` gives the graph's need on the stand-in, all GPUs together")
    step = stand_in_step(prepared.model)
    stand_in = stand_in or (StandIn(feed_values=feed_values) if feed_values else shared())
    # What Grappler fuses decides which ops may take a control edge (a fused kernel's root may not):
    # the stand-in's sessions run it without oneDNN, which fuses no batch norm with its ReLU on a CPU
    # (bench-real: a DenseNet's stand-in plans needed 1.7x the lower bound, no batch norm
    # waiting for a swap-out, as if fused, though the stand-in ran them unfused).
    optimizer = stand_in.optimizer if prepared.optimized is not None else None
    fed = stand_in.feed_values
    if step is not prepared.model or optimizer is not None or fed != prepared.view.fed:
        # (the loss's ops are part of the step the stand-in runs; loops bounded by fed values counted by them)
        prepared = prepare(step, batch_size=prepared.batch_size, judge=prepared.schedule.memory_model,
                           optimizer=optimizer, feed_values=fed)
    meta = with_graph_def(prepared.model.meta_graph, prepared.graph_def)
    seen = stand_in.observe(meta, prepared.model.fetches, batch_size=prepared.batch_size or 1)
    return replace(_in_the_worst_order(prepared, seen), stand_in=stand_in, judge_runs=judge_runs)


def _in_the_worst_order(prepared: Prepared, seen) -> Prepared:
    """``prepared`` in the traced order (of ``seen``'s steps) that needs the most by the executor
    model: a plan must hold in every order the executor was seen to use, and they can differ much
    (QA: the two micro-batches of a gradient accumulation net ran one after the other in two traced
    steps, 10.1 MiB, and interleaved in the third, 14.2; planned in the first, the step "fitted"
    under 12 MiB and every judged run ran out of memory)."""
    from lmscli.model.simulator import simulate

    orders = [seen.order] + [o for o in seen.orders if o]
    worst, peak = None, -1
    for k, order in enumerate(orders):
        others = tuple(o for j, o in enumerate(orders) if j != k)
        observed = prepared.observed(order, seen.scratch, seen.micros, others, seen.scratch_first)
        need = simulate(observed.schedule, detail=False).peak_bytes
        if need > peak:
            worst, peak = observed, need
    return worst


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
    from lmscli.plan.document import simulated
    from lmscli.model.simulator import simulate

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
    from lmscli.plan.document import recompute_flops, simulated
    from lmscli.plan.planner import predicted
    from lmscli.model.simulator import simulate

    device = Device.from_dict(plan.device) if plan.device else Device(gpu_mem=NO_BUDGET)
    replays = []
    for schedule in prepared.schedules or (prepared.schedule,):
        baseline = simulate(schedule, (), device.link_bandwidth)
        with _stand_in_hint(prepared, plan):
            result = simulate(*simulated(plan, schedule, prepared.view), device.link_bandwidth)
        replays.append((result.peak_bytes, schedule.device, baseline, result))
    _peak, name, baseline, result = max(replays, key=lambda r: r[0])
    filled = replace(plan, predicted=predicted(baseline, result, device.budget,
                                               recompute_flops(plan.recomputes, prepared.view)))
    return TuneResult(filled, baseline, result, device.budget, plan.changes, (),
                      device=name if len(replays) > 1 else "")
