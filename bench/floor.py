"""The floor under `lms analyze` and `lms tune` on a large graph: TensorFlow's own passes they need.

Both commands run TensorFlow's passes whose time lms cannot change: shape inference (importing
the graph), Grappler's virtual scheduler (the op order and times) and Grappler's default
optimizations (what a Session runs: dead ops, fused tensors), and `tune` runs the optimizations
once more on the rewritten graph (the bit-identity guard). This script times each alone, in one
process, and adds them up as the commands must:

* analyze >= load + max(optimizations, shape inference + scheduler), the optimizations running
  in a second process beside the other two, each of which holds Python's lock;
* tune >= analyze + plan + emit + optimizations of the rewrite (which depends on the plan).

It also times one run of the scheduler alone (``DeterminePeakMemoryUsage``): the only Python
entry point that returns the scheduler's timeline (``MeasureCosts``) runs it twice.

    python bench/floor.py [GRAPH]      # default: the synthetic 60,000-node graph; writes bench/out/floor.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _timed(func, *args):
    started = time.perf_counter()
    value = func(*args)
    return value, time.perf_counter() - started


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        path = argv[0]
    else:
        from common import ensure_generated, synthetic

        path = str(ensure_generated(synthetic(60000))[0])
    started = time.perf_counter()
    import tensorflow  # noqa: F401  (the import is not part of the floor: the speed targets count beyond it)

    from lmscli import api, grappler
    from lmscli.graph import shapes
    from lmscli.plan.planner import tune as plan_tune
    from lmscli.emit.rewriter import emit

    seconds = {}
    model, seconds["load"] = _timed(api.load, path)
    _, seconds["shape inference"] = _timed(shapes.infer, model.graph_def)
    _, seconds["Grappler's scheduler (MeasureCosts, as lms calls it)"] = _timed(grappler.trace, model.meta_graph,
                                                                             model.fetches)
    _, seconds["Grappler's scheduler, one run (DeterminePeakMemoryUsage)"] = _timed(
        grappler.estimate_peak, model.meta_graph, model.fetches)
    _, seconds["Grappler's optimizations"] = _timed(grappler.optimize, model.meta_graph, model.fetches)
    prepared = api.prepare(model)
    facts = api.analyze(prepared)
    budget = (facts.lower_bound_bytes + facts.peak_bytes) // 2
    result, seconds["plan"] = _timed(plan_tune, prepared, api.make_device(gpu_mem=budget, reserve=0.0))
    (meta, _report), seconds["emit"] = _timed(lambda: emit(prepared, result.plan, force=True))
    _, seconds["Grappler's optimizations of the rewrite"] = _timed(grappler.optimize, meta, model.fetches)
    beside = seconds["shape inference"] + seconds["Grappler's scheduler (MeasureCosts, as lms calls it)"]
    analyze = seconds["load"] + max(seconds["Grappler's optimizations"], beside)
    tune = analyze + seconds["plan"] + seconds["emit"] + seconds["Grappler's optimizations of the rewrite"]
    doc = {"graph": path, "nodes": len(model.graph_def.node), "swaps": len(result.plan.swaps), "seconds": seconds,
           "analyze_floor_s": analyze, "tune_floor_s": tune, "minutes": (time.perf_counter() - started) / 60}
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "floor.json").write_text(json.dumps(doc, indent=1))
    for name, value in seconds.items():
        print(f"{name:<58} {value:6.2f} s")
    print(f"analyze needs at least {analyze:.1f} s beyond the import; tune at least {tune:.1f} s "
          f"({len(result.plan.swaps)} swaps)")
    return 0


def render(doc: dict) -> list[str]:
    """SPEED.md's lines on the floor (from bench/out/floor.json)."""
    s = doc["seconds"]
    return [
        "",
        f"## The floor on the {doc['nodes']:,}-node graph (`python bench/floor.py`)",
        "",
        "TensorFlow's own passes that `analyze` and `tune` need, each timed alone in one process:",
        "",
        "| pass | seconds |",
        "| --- | --- |",
        *(f"| {name} | {value:.2f} |" for name, value in s.items()),
        "",
        f"`analyze` needs at least load + max(optimizations, shape inference + scheduler) = "
        f"**{doc['analyze_floor_s']:.1f} s** beyond the import (the optimizations run in a second process "
        "beside the other two); `tune` at least that plus plan, emit and the optimizations of the rewrite "
        f"(the bit-identity guard, which needs the plan) = **{doc['tune_floor_s']:.1f} s**. The scheduler's "
        "only Python entry point with a timeline runs it twice (`MeasureCosts`: once to estimate costs, once "
        "for the timeline); one run alone takes the time in the row below it.",
    ]


if __name__ == "__main__":
    sys.exit(main())
