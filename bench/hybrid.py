"""Swap, recompute or both: lms's strategies beside Grappler's memory optimizer and the TFLMS-style
plan, at 75%, 50% and 35% of each graph's peak, on NVLink 2 and PCIe 3 (writes bench/HYBRID.md).

    python bench/hybrid.py            # the full table (about half an hour on 2 cores)
    python bench/hybrid.py --quick    # small graphs, a smoke run

Each lms strategy plans with ``api.tune(..., check=False)``: the optimizer guard and the executor
judge (the graph TensorFlow runs, after Grappler's optimizations, must meet the budget) run,
Grappler's own estimate is not asked for. The columns:

fits        the judge's peak is within the budget (``no plan``: the strategy found none)
peak        the judge's peak (the graph TensorFlow runs), resident bytes included
overhead    predicted step-time overhead on the link the plan was made for
moved       bytes copied to the host (each swap-out; swap-ins move as much back)
recomputed  bytes made again by cloned ops, and the GPU time the clones take

Grappler's memory optimizer (SWAPPING_HEURISTICS, RECOMPUTATION_HEURISTICS) runs on a virtual GPU
of exactly the budget and is judged by Grappler's estimate of its output; its recomputation is
not in our step-time model, so only its fit and peak are shown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH, GraphSpec, generated, load, resnet_batch, resnet_res, unet  # noqa: E402

STRATEGIES = ("swap", "recompute", "hybrid", "tflms")
LINKS = ("nvlink2", "pcie3")
SHARES = (0.75, 0.50, 0.35)

FULL = [
    resnet_batch(128),
    resnet_res(2000),
    unet(192),
    GraphSpec("transformer (sample shape)", model="transformer",
              shape=(("batch", 8), ("d_model", 512), ("ffn", 2048), ("heads", 8), ("layers", 6), ("seq", 512))),
    GraphSpec("DenseNet-style 224\u00b2 b32", model="densenet",
              shape=(("batch", 32), ("blocks", 3), ("growth", 32), ("image_size", 224), ("layers_per_block", 6))),
]
QUICK = [
    GraphSpec("resnet50 (sample)", sample="resnet50.meta"),
    generated("densenet", batch=8, image_size=64, growth=24, blocks=3, layers_per_block=4),
]


def plan(prepared, budget: int, link: str, strategy: str) -> dict:
    from lmscli import api
    from lmscli.errors import LmsError, NoFitError

    device = api.make_device(gpu_mem=budget, reserve=0.0, link=link)
    t = time.perf_counter()
    try:
        result = api.tune(prepared, device, api.TuneOptions(strategy=strategy), check=False)
    except NoFitError:
        return {"status": "no plan", "seconds": time.perf_counter() - t}
    except LmsError as exc:
        return {"status": "error", "note": str(exc).splitlines()[0][:160], "seconds": time.perf_counter() - t}
    pred = result.plan.predicted
    return {"status": "ran", "fits": result.fits, "peak": pred.get("run_peak_bytes") or pred["peak_bytes"],
            "overhead": pred["overhead"], "moved": pred["swap_out_bytes"], "recomputed": pred.get("recompute_bytes", 0),
            "recompute_ms": pred.get("recompute_time_s", 0.0) * 1e3, "recompute_flops": pred.get("recompute_flops", 0),
            "swaps": len(result.plan.swaps),
            "recomputes": len(result.plan.recomputes), "seconds": time.perf_counter() - t}


def grappler(model, prepared, budget: int, level: str) -> dict:
    import grappler_opt

    from lmscli import api

    meta = api.with_graph_def(model.meta_graph, prepared.graph_def)
    run = grappler_opt.optimize(meta, model.fetches, budget, level)
    if run.error:
        return {"status": "error", "note": run.error[:160]}
    peak = grappler_opt.judge_graph_def(model.meta_graph, grappler_opt.judgeable(run.graph_def), model.fetches,
                                        prepared.schedule.resident_bytes)
    return {"status": "ran", "fits": peak <= budget, "peak": peak, "swap_pairs": run.swap_pairs,
            "recomputed_nodes": run.recomputed}


def evaluate(spec: GraphSpec, log=print) -> dict:
    from lmscli import api
    from lmscli.units import format_size

    model, _ = load(spec)
    prepared = api.prepare(model, batch_size=spec.batch_size)
    facts = api.analyze(prepared)
    peak = prepared.run_peak_bytes or facts.peak_bytes
    log(f"\n{spec.label}: {facts.vertices:,} nodes, peak {format_size(peak)} (the graph TensorFlow runs), "
        f"lower bound {format_size(facts.lower_bound_bytes)}", flush=True)
    rows = []
    for share in SHARES:
        budget = int(peak * share)
        row = {"share": share, "budget": budget, "lms": {}, "grappler": {}}
        for link in LINKS:
            for strategy in STRATEGIES:
                got = plan(prepared, budget, link, strategy)
                row["lms"][f"{strategy}/{link}"] = got
                log(f"  {share:.0%} {link:<8} {strategy:<10} {_line(got)}", flush=True)
        for level in ("SWAPPING_HEURISTICS", "RECOMPUTATION_HEURISTICS"):
            if facts.vertices > 20000:
                continue
            row["grappler"][level] = got = grappler(model, prepared, budget, level)
            log(f"  {share:.0%} Grappler {level:<24} {_line(got)}", flush=True)
        rows.append(row)
    return {"graph": spec.label, "nodes": facts.vertices, "peak": peak, "lower_bound": facts.lower_bound_bytes,
            "rows": rows}


def _step_seconds(meta_graph, fetches, rounds: int = 5, steps: int = 4) -> list[float]:
    """Wall seconds of single training steps on this CPU (after two warm-up steps), ``rounds``
    blocks of ``steps``."""
    import numpy as np

    from lmscli.prove.steps import feeds, import_graph, place_on_cpu, session_config
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    g = import_graph(place_on_cpu(meta_graph).meta_graph, fetches, "loss:0")
    times = []
    with tf.compat.v1.Session(graph=g.graph, config=session_config(True)) as sess:
        sess.run(g.init)
        for step in range(2 + rounds * steps):
            feed = feeds(g.placeholders, 2, step)
            t = time.perf_counter()
            sess.run(g.targets, feed_dict=feed)
            if step >= 2:
                times.append(time.perf_counter() - t)
    return [float(np.median(times[k * steps:(k + 1) * steps])) for k in range(rounds)]


def recompute_time_check(spec: GraphSpec, shares=(0.85, 0.9, 0.95), log=print) -> dict:
    """The cost model's recompute time against the CPU: a recompute-only plan for the stand-in
    (op times observed on this CPU), its predicted extra time beside the measured difference of
    the step time of the rewrite and of the original (medians of alternating blocks)."""
    from lmscli import api
    from lmscli.device import STAND_IN_LINK

    model, _ = load(spec)
    prepared = api.for_stand_in(api.prepare(model))
    bound = api.analyze(prepared).lower_bound_bytes
    for share in shares:  # the first share (of the way from the bound to the peak) with a plan the judge takes
        budget = int(bound + share * (prepared.run_peak_bytes - bound))
        device = api.make_device(gpu_mem=budget, link=STAND_IN_LINK)  # the default reserve, as a user plans
        try:
            result = api.tune(prepared, device, api.TuneOptions(strategy="recompute"), check=False)
            break
        except Exception as exc:  # noqa: BLE001 - reported in the table
            failed = {"graph": spec.label, "status": str(exc).splitlines()[0][:120]}
    else:
        return failed
    rewritten, _ = api.rewrite(prepared, result.plan)
    original = api.with_graph_def(model.meta_graph, prepared.graph_def)
    a, b = [], []
    for _ in range(3):  # alternate, so that load on the machine falls on both
        a += _step_seconds(original, model.fetches, rounds=2)
        b += _step_seconds(rewritten, model.fetches, rounds=2)
    import numpy as np

    measured = float(np.median(b) - np.median(a))
    predicted = result.plan.predicted["recompute_time_s"]
    out = {"graph": spec.label, "status": "ran", "share": share, "recomputes": len(result.plan.recomputes),
           "predicted_s": predicted, "measured_s": measured, "step_s": float(np.median(a)),
           "spread_s": float(np.percentile(a, 75) - np.percentile(a, 25))}
    log(f"  recompute time on this CPU, {spec.label}: predicted {predicted * 1e3:.2f} ms, measured "
        f"{measured * 1e3:.2f} ms (step {out['step_s'] * 1e3:.1f} ms, spread {out['spread_s'] * 1e3:.1f} ms)", flush=True)
    return out


def _line(got: dict) -> str:
    from lmscli.units import format_size

    if got["status"] != "ran":
        return got["status"] + (f" ({got['note']})" if got.get("note") else "")
    text = f"{'fits' if got['fits'] else 'OVER'} peak {format_size(got['peak'])}"
    if "overhead" in got:
        text += (f", overhead {got['overhead']:+.1%}, moved {format_size(got['moved'])}, "
                 f"recomputed {format_size(got['recomputed'])} ({_flops(got)}, {got['recompute_ms']:.2f} ms), "
                 f"{got['seconds']:.1f}s")
    return text


def _flops(got: dict) -> str:
    from lmscli.units import format_flops

    return format_flops(got.get("recompute_flops", 0))


def render(results: list, machine: str, timing_checks=()) -> str:
    from lmscli.units import format_size

    out = ["# Swap, recompute or both", "",
           "Generated by `python bench/hybrid.py` (`make bench-hybrid`); do not edit by hand. " + machine, "",
           "Predicted step-time overhead of each plan on the link it was made for (`--link`), at a budget of "
           "75%, 50% and 35% of the peak of the graph TensorFlow runs. *no plan*: the strategy found none. "
           "*moved*: bytes swapped out (as many come back); *recomputed*: bytes made again by cloned ops, "
           "the FLOPs the clones compute (convolutions and matrix products; element-wise ops, batch norms, "
           "pooling and concatenations count 0) and the GPU time they take (the op times lms plans with: "
           "Grappler's analytical model on a V100-like virtual GPU). Grappler's memory optimizer is judged by "
           "Grappler's estimate of its output (its recomputation is not in our time model).", ""]
    for graph in results:
        out += [f"## {graph['graph']}", "",
                f"{graph['nodes']:,} nodes; peak {format_size(graph['peak'])}; lower bound "
                f"{format_size(graph['lower_bound'])}.", "",
                "| budget | link | swap | recompute | hybrid | TFLMS-style | hybrid moved / recomputed |",
                "|---|---|---|---|---|---|---|"]
        for row in graph["rows"]:
            for link in LINKS:
                cells = [_cell(row["lms"][f"{s}/{link}"]) for s in STRATEGIES]
                hybrid = row["lms"][f"hybrid/{link}"]
                detail = "-"
                if hybrid["status"] == "ran":
                    detail = (f"{format_size(hybrid['moved'])} / {format_size(hybrid['recomputed'])} "
                              f"({_flops(hybrid)}, {hybrid['recompute_ms']:.2f} ms)")
                out.append(f"| {row['share']:.0%} ({format_size(row['budget'])}) | {link} | "
                           f"{cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {detail} |")
        if any(row["grappler"] for row in graph["rows"]):
            out += ["", "| budget | Grappler SWAPPING_HEURISTICS | Grappler RECOMPUTATION_HEURISTICS |", "|---|---|---|"]
            for row in graph["rows"]:
                cells = [_gcell(row["grappler"].get(level)) for level in ("SWAPPING_HEURISTICS",
                                                                          "RECOMPUTATION_HEURISTICS")]
                out.append(f"| {row['share']:.0%} | {cells[0]} | {cells[1]} |")
        out.append("")
    out += ["## Targets (issue: swap or recompute, per tensor)", ""] + _targets(results) + [""]
    if timing_checks:
        out += ["## The recompute time against this CPU", "",
                "A recompute-only plan made for the stand-in (`--stand-in`: op times observed in a traced step "
                "on this CPU; default reserve) at 85% of the way from the lower bound to the peak (90% or 95% "
                "where the stand-in's judge takes no plan there: *at*); *predicted*: the plan's "
                "`recompute_time_s`; *measured*: median step time of the rewrite minus that of the original "
                "(6 blocks of 4 steps each, alternating, after warm-up; *spread*: the original's interquartile "
                "range, the noise of this shared 2-core machine).", "",
                "| graph | at | recomputations | predicted | measured | step | spread |", "|---|---|---|---|---|---|---|"]
        for check in timing_checks:
            if check["status"] != "ran":
                out.append(f"| {check['graph']} | | {check['status']} | | | | |")
                continue
            out.append(f"| {check['graph']} | {check.get('share', 0.85):.0%} | {check['recomputes']} | "
                       f"{check['predicted_s'] * 1e3:.2f} ms | "
                       f"{check['measured_s'] * 1e3:.2f} ms | {check['step_s'] * 1e3:.1f} ms | "
                       f"{check['spread_s'] * 1e3:.1f} ms |")
        out.append("")
    return "\n".join(out)


def _cell(got: dict) -> str:
    if got["status"] != "ran":
        return got["status"]
    return f"{got['overhead']:+.1%}" + ("" if got["fits"] else " (over)")


def _gcell(got) -> str:
    from lmscli.units import format_size

    if not got:
        return "not run"
    if got["status"] != "ran":
        return got["status"]
    return f"{'fits' if got['fits'] else 'over'}, {format_size(got['peak'])}"


def _targets(results: list) -> list[str]:
    """The issue's targets, checked on every (graph, budget) where the strategies compared found a plan."""
    lines = []
    half = worse = reach = checked_pcie = checked_nv = 0
    misses, slower = [], []
    for graph in results:
        for row in graph["rows"]:
            pc = {s: row["lms"][f"{s}/pcie3"] for s in STRATEGIES}
            nv = {s: row["lms"][f"{s}/nvlink2"] for s in STRATEGIES}
            where = f"{graph['graph']} at {row['share']:.0%}"
            if pc["swap"]["status"] == "ran" and pc["hybrid"]["status"] == "ran":
                checked_pcie += 1
                if pc["hybrid"]["overhead"] <= 0.5 * pc["swap"]["overhead"] + 1e-9:
                    half += 1
                else:
                    misses.append(f"{where} on pcie3: hybrid {pc['hybrid']['overhead']:+.1%}, "
                                  f"swap {pc['swap']['overhead']:+.1%}")
            for link, by in (("pcie3", pc), ("nvlink2", nv)):
                h = by["hybrid"]
                for other in ("swap", "recompute"):
                    o = by[other]
                    if h["status"] == "ran" and o["status"] == "ran" and h["overhead"] > o["overhead"] + 1e-9:
                        worse += 1
                        slower.append(f"{where} on {link}: hybrid {h['overhead']:+.1%} > {other} {o['overhead']:+.1%}")
                if by["swap"]["status"] == "ran" and h["status"] != "ran":
                    reach += 1
                    slower.append(f"{where} on {link}: swap-only found a plan, the hybrid none")
            if nv["swap"]["status"] == "ran" and nv["hybrid"]["status"] == "ran":
                checked_nv += 1
    lines.append(f"- On pcie3 the hybrid's predicted overhead is at most half of swap-only's at {half} of "
                 f"{checked_pcie} budgets both reach" + ("; not at:" if misses else "."))
    lines += [f"  - {m}" for m in misses]
    lines.append(f"- The hybrid is slower than a pure strategy at {worse} (budget, link) pairs, and misses a budget "
                 f"swap-only reaches at {reach}" + (":" if slower else "."))
    lines += [f"  - {m}" for m in slower]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small graphs: a smoke run")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--report-only", action="store_true", help="re-render HYBRID.md from the last run's JSON")
    parser.add_argument("--timing-only", action="store_true",
                        help="run the recompute-time check again, keep the last run's plans (and re-render)")
    args = parser.parse_args(argv)
    if args.timing_only:
        path = BENCH / "out" / "hybrid.json"
        data = json.loads(path.read_text())
        data["timing"] = [recompute_time_check(spec) for spec in QUICK]
        path.write_text(json.dumps(data, indent=1))
        args.report_only = True
    if args.report_only:
        data = json.loads((BENCH / "out" / "hybrid.json").read_text())
        (BENCH / "HYBRID.md").write_text(render(data["results"], data.get("machine", ""), data.get("timing", ())) + "\n")
        return 0
    import platform

    import tensorflow as tf

    machine = (f"Measured on {platform.machine()} with {__import__('os').cpu_count()} cores, "
               f"TensorFlow {tf.__version__}.")
    results = [evaluate(spec) for spec in (QUICK if args.quick else FULL)]
    timing_checks = [recompute_time_check(spec) for spec in QUICK]
    if not args.no_write:
        (BENCH / "out").mkdir(exist_ok=True)
        (BENCH / "out" / ("hybrid-quick.json" if args.quick else "hybrid.json")).write_text(
            json.dumps({"results": results, "timing": timing_checks, "machine": machine}, indent=1))
        if not args.quick:
            (BENCH / "HYBRID.md").write_text(render(results, machine, timing_checks) + "\n")
        else:
            print(render(results, machine, timing_checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
