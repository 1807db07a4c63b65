"""Benchmarks: plans of both strategies at standard budgets, judged by Grappler, and tool speed.

    python bench/run.py            # full run, writes bench/RESULTS.md
    python bench/run.py --quick    # a smoke run in a few minutes

For each graph and each budget (75%, 50% and 35% of the no-swap peak, when at least the lower
bound) it plans with the default strategy and with the TFLMS-style search, rewrites the graph,
and asks Grappler's VirtualCluster whether the result fits (variables added). It prints one
table row per (graph, budget, strategy) and the timing figures, and writes them to RESULTS.md.
Nothing here is a test: these are measurements.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from lmscli import api, grappler  # noqa: E402
from lmscli.errors import NoFitError  # noqa: E402
from lmscli.planner import TuneOptions  # noqa: E402
from lmscli.units import format_size  # noqa: E402


def generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "sample_graphs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRAPHS_FULL = [
    ("mlp (sample)", None, {}),
    ("cnn (sample)", None, {}),
    ("unet3d (sample)", None, {}),
    ("resnet50 (sample)", None, {}),
    ("while_rnn (sample)", None, {}),
    ("cond_cnn (sample)", None, {}),
    ("resnet50 2000^2", "resnet50", {"image_size": 2000, "batch": 1}),
    ("unet3d 128^3", "unet3d", {"volume": 128, "batch": 1}),
    ("unet3d 192^3", "unet3d", {"volume": 192, "batch": 1}),
]
GRAPHS_QUICK = [
    ("cnn (sample)", None, {}),
    ("unet3d 64^3", "unet3d", {"volume": 64, "batch": 1}),
    ("resnet50 500^2", "resnet50", {"image_size": 500, "batch": 1}),
]


def load_graph(label, model, kwargs, gen):
    if model is None:
        name = label.split()[0]
        return api.load(str(ROOT / "sample_graphs" / f"{name}.meta"))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / (label.replace(" ", "_").replace("^", "") + ".meta")
    if not path.exists():
        gen.write(model, str(path), **kwargs)
    return api.load(str(path))


def judge(prepared, plan):
    """Grappler's peak for the rewritten graph, variables added."""
    figures = api.check_with_grappler(prepared, plan)
    return figures["peak_bytes"], figures["fits"]


def bench_graph(label, model, rows, timings):
    t0 = time.perf_counter()
    prepared = api.prepare(model)
    facts = api.analyze(prepared)
    t_prepare = time.perf_counter() - t0
    base_g = grappler.estimate_peak(api.with_graph_def(model.meta_graph, prepared.graph_def), model.fetches)
    timings.append((label, facts.vertices, t_prepare))
    print(f"\n{label}: {facts.vertices} nodes, peak {format_size(facts.peak_bytes)} "
          f"(Grappler {format_size(base_g.gpu_peak_bytes + prepared.schedule.variable_bytes)}), "
          f"lower bound {format_size(facts.lower_bound_bytes)}, prepared in {t_prepare:.2f}s", flush=True)
    for share in (0.75, 0.5, 0.35):
        budget = int(facts.peak_bytes * share)
        if budget < facts.lower_bound_bytes:
            rows.append((label, share, budget, "-", "below the lower bound", "", "", "", "", "", ""))
            print(f"  {share:.0%}: {format_size(budget)} is below the lower bound", flush=True)
            continue
        device = api.make_device(gpu_mem=budget, reserve=0.0)
        for strategy in ("lms", "tflms"):
            t = time.perf_counter()
            try:
                result = api.tune(prepared, device, TuneOptions(strategy=strategy), check=False)
            except NoFitError:
                rows.append((label, share, budget, strategy, "no plan", "", "", "", "", "", f"{time.perf_counter() - t:.2f}"))
                print(f"  {share:.0%} {strategy}: no plan", flush=True)
                continue
            elapsed = time.perf_counter() - t
            result = api.with_link_predictions(prepared, result)
            g_peak, g_fits = judge(prepared, result.plan)
            pred = result.plan.predicted
            links = pred["per_link"]
            row = (label, share, budget, strategy, "yes" if g_fits else "NO", format_size(g_peak),
                   format_size(pred["peak_bytes"]), format_size(pred["swap_out_bytes"]),
                   f"{links['nvlink2']['overhead'] * 100:.1f}%", f"{links['pcie3']['overhead'] * 100:.1f}%",
                   f"{elapsed:.2f}")
            rows.append(row)
            print(f"  {share:.0%} {strategy}: fits per Grappler {row[4]} ({row[5]}), predicted {row[6]}, "
                  f"swapped {row[7]}, overhead nvlink2 {row[8]} pcie3 {row[9]}, tuned in {row[10]}s", flush=True)


def rewrite_time(path: Path) -> tuple[float, float]:
    """Wall time of `lms rewrite --gpu-mem 50%` and of importing TensorFlow alone."""
    lms = [sys.executable, "-m", "lmscli"]
    out = OUT / "rewrite_timing.meta"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tensorflow"], check=True, capture_output=True)
    base = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(lms + ["rewrite", str(path), str(out), "--gpu-mem", "75%", "--reserve", "0", "-q"], check=True)
    return time.perf_counter() - t, base


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write RESULTS.md")
    parser.add_argument("--synthetic", type=int, default=None, help="also time a synthetic graph of N nodes")
    args = parser.parse_args(argv)
    gen = generator()
    graphs = GRAPHS_QUICK if args.quick else GRAPHS_FULL
    rows, timings = [], []
    started = time.perf_counter()
    for label, model_name, kwargs in graphs:
        bench_graph(label, load_graph(label, model_name, kwargs, gen), rows, timings)
    OUT.mkdir(parents=True, exist_ok=True)
    resnet = OUT / "resnet50_2000-bench.meta"
    if not resnet.exists():
        gen.write("resnet50", str(resnet), image_size=2000 if not args.quick else 500, batch=1)
    total, tf_import = rewrite_time(resnet)
    print(f"\nlms rewrite --gpu-mem 75% on ResNet-50: {total:.2f}s wall, of which importing TensorFlow "
          f"{tf_import:.2f}s: {total - tf_import:.2f}s beyond it")
    synth = None
    if args.synthetic:
        path = OUT / f"synthetic_{args.synthetic}.meta"
        if not path.exists():
            from google.protobuf import text_format  # noqa: F401  (TensorFlow is loaded by the generator)

            meta = gen.synthetic(args.synthetic)
            path.write_bytes(meta.SerializeToString(deterministic=True))
        model = api.load(str(path))
        t = time.perf_counter()
        prepared = api.prepare(model)
        t_prep = time.perf_counter() - t
        facts = api.analyze(prepared)
        t = time.perf_counter()
        try:
            api.tune(prepared, api.make_device(gpu_mem=int(facts.peak_bytes * 0.9), reserve=0.0), check=False)
            outcome = "plan"
        except NoFitError:
            outcome = "no plan"
        synth = (facts.vertices, t_prep, time.perf_counter() - t, outcome)
        print(f"synthetic {facts.vertices} nodes: prepare {t_prep:.1f}s, tune {synth[2]:.1f}s ({outcome})")
    elapsed = time.perf_counter() - started
    if not args.no_write:
        write_results(rows, timings, (total, tf_import), synth, args.quick, elapsed)
    return 0


def write_results(rows, timings, rewrite, synth, quick, elapsed):
    lines = [
        "# Benchmark results",
        "",
        f"Made by `python bench/run.py{' --quick' if quick else ''}` on {datetime.date.today().isoformat()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{elapsed / 60:.1f} minutes in all. No GPU: peaks are simulated and judged by Grappler's "
        "VirtualCluster on a virtual GPU, variables added.",
        "",
        "Budgets are 75%, 50% and 35% of each graph's simulated no-swap peak (no reserve). `fits` is "
        "Grappler's verdict on the rewritten graph; `predicted` is our simulator's peak; overheads are "
        "the predicted step-time increase on NVLink 2.0 (150 GB/s) and PCIe 3 (16 GB/s).",
        "",
        "| graph | budget | strategy | fits (Grappler) | Grappler peak | predicted peak | swapped out "
        "| overhead nvlink2 | overhead pcie3 | tuning s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, share, budget, strategy, fits, gpeak, ppeak, swapped, nv, pc, secs in rows:
        lines.append(f"| {label} | {share:.0%} ({format_size(budget)}) | {strategy} | {fits} | {gpeak} | {ppeak} | "
                     f"{swapped} | {nv} | {pc} | {secs} |")
    lines += ["", "## Speed", "", "| graph | nodes | load + shapes + schedule (s) |", "| --- | --- | --- |"]
    lines += [f"| {label} | {nodes:,} | {secs:.2f} |" for label, nodes, secs in timings]
    total, tf_import = rewrite
    lines += ["", f"`lms rewrite --gpu-mem 75%` on ResNet-50 end to end: {total:.2f} s wall, of which "
              f"{tf_import:.2f} s is importing TensorFlow: {total - tf_import:.2f} s beyond it."]
    if synth:
        lines += ["", f"Synthetic graph of {synth[0]:,} nodes: prepare {synth[1]:.1f} s, tune {synth[2]:.1f} s ({synth[3]})."]
    (ROOT / "bench" / "RESULTS.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
