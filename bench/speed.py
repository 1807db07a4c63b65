"""Tool speed against graph size: synthetic graphs from 1,000 to 60,000 nodes.

For each size: ``analyze`` is load + prepare (shapes, Grappler's schedule) + analyze; ``tune`` is
``api.tune`` at 75% of the no-swap peak with its Grappler check (what ``lms tune`` does);
``rewrite`` is ``api.rewrite`` of that plan; Grappler's memory optimizer (SWAPPING_HEURISTICS) at
the same budget is timed beside them for scale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grappler_opt
from common import load, synthetic

FULL_SIZES = (1000, 2000, 5000, 20000)  # 60,000 comes from the main table's synthetic graph
QUICK_SIZES = (1000, 3000)
SHARE = 0.75


@dataclass
class SpeedPoint:
    nodes: int
    share: float  # budget over the no-swap peak
    generate_s: float
    analyze_s: float
    tune_s: float | None
    rewrite_s: float | None
    grappler_s: float | None
    outcome: str


def measure(n: int, log=print) -> SpeedPoint:
    from lmscli import api
    from lmscli.errors import LmsError

    spec = synthetic(n)
    t = time.perf_counter()
    model, gen_s = load(spec)
    prepared = api.prepare(model)
    facts = api.analyze(prepared)
    analyze_s = time.perf_counter() - t - gen_s
    share = SHARE
    if facts.lower_bound_bytes > facts.peak_bytes * SHARE:
        share = (facts.lower_bound_bytes + facts.peak_bytes) / 2 / facts.peak_bytes
    budget = int(facts.peak_bytes * share)
    tune_s = rewrite_s = None
    t = time.perf_counter()
    try:
        result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0))
        tune_s = time.perf_counter() - t
        t = time.perf_counter()
        api.rewrite(prepared, result.plan)
        rewrite_s = time.perf_counter() - t
        outcome = f"{len(result.plan.swaps)} swaps"
    except LmsError:
        tune_s = time.perf_counter() - t
        outcome = "no plan" + (" (the lower bound is the peak)" if facts.lower_bound_bytes >= facts.peak_bytes else "")
    meta = api.with_graph_def(model.meta_graph, prepared.graph_def)
    run = grappler_opt.optimize(meta, model.fetches, budget, "SWAPPING_HEURISTICS")
    point = SpeedPoint(facts.vertices, share, gen_s, analyze_s, tune_s, rewrite_s,
                       None if run.error else run.seconds, outcome)
    show = lambda x: "n/a" if x is None else f"{x:.2f}s"  # noqa: E731
    log(f"  {facts.vertices:>6,} nodes, budget {share:.0%}: analyze {show(analyze_s)}, tune {show(tune_s)}, "
        f"rewrite {show(rewrite_s)}, Grappler's optimizer {show(point.grappler_s)} ({outcome}); "
        f"generated in {gen_s:.1f}s", flush=True)
    return point


def from_main_table(facts, rows) -> SpeedPoint | None:
    """The same figures for a graph of the main table (its 75% row)."""
    row = next((r for r in rows if r.budget_label == "75%"), None)
    if row is None:
        return None
    lms, grap = row.get("lms"), row.get("grappler-swap")
    if lms is None or lms.status != "ran":
        return None
    return SpeedPoint(facts.nodes, SHARE, facts.gen_s, facts.load_s + facts.prepare_s + facts.analyze_s,
                      lms.extra.get("tune_s"), lms.extra.get("rewrite_s"),
                      grap.seconds if grap is not None and grap.status == "ran" else None,
                      f"{lms.extra.get('swaps')} swaps")
