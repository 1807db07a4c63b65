"""Benchmarks against the peers: Grappler's memory optimizer, a TFLMS-style plan, and the lower bound.

    python bench/run.py                 # full run (make bench), writes bench/RESULTS.md and bench/*.png
    python bench/run.py --quick         # smoke run (make bench-quick), writes bench/out/RESULTS-quick.md
    python bench/run.py --report-only   # re-render RESULTS.md from the last run's bench/out/results.json

For every graph (each committed sample, and large shapes generated on demand) and every budget
(16 GiB, 32 GiB, and 75%, 50% and 35% of the graph's no-swap peak) it runs the contenders side by
side: the original graph, Grappler's memory optimizer (SWAPPING_HEURISTICS and HEURISTICS against
a virtual GPU of the budget's size), ``lms --strategy tflms`` and ``lms``, and judges each result
with Grappler's estimate (variables added). Then it searches for the largest resolution and batch
that fit 16 and 32 GiB with and without each contender, and times the tool on graphs of 1,000 to
60,000 nodes. It prints the figures as it goes and writes them to RESULTS.md with plots. These are
measurements, not tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import report  # noqa: E402
from common import BENCH, OUT  # noqa: E402


def machine() -> dict:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import tensorflow as tf

    return {"arch": platform.machine(), "cpu": model, "cores": os.cpu_count(), "system": platform.system(),
            "release": platform.release(), "python": platform.python_version(), "tensorflow": tf.__version__}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of every contender on small graphs")
    parser.add_argument("--jobs", type=int, default=None,
                        help="2: run the scaling searches in a second process beside the main table "
                             "(default for the full run); 1: one after the other")
    parser.add_argument("--no-write", action="store_true", help="print only; write neither RESULTS.md nor plots")
    parser.add_argument("--report-only", action="store_true", help="re-render from the last run's JSON")
    args = parser.parse_args(argv)
    quick = args.quick
    data_path = OUT / ("results-quick.json" if quick else "results.json")
    md_path = OUT / "RESULTS-quick.md" if quick else BENCH / "RESULTS.md"
    plot_dir = OUT if quick else BENCH
    if args.report_only:
        data = json.loads(data_path.read_text())
        report.write(data, md_path, plot_dir)
        print(f"wrote {md_path}")
        return 0

    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    OUT.mkdir(parents=True, exist_ok=True)
    jobs = args.jobs if args.jobs is not None else (1 if quick else 2)
    t = time.perf_counter()
    info = machine()  # imports TensorFlow
    print(f"{info['cpu']}, {info['cores']} cores; TensorFlow {info['tensorflow']} imported in "
          f"{time.perf_counter() - t:.1f}s", flush=True)

    scaling_json = OUT / ("scaling-quick.json" if quick else "scaling.json")
    child = None
    if jobs > 1:
        log = open(OUT / "scaling.log", "w")
        cmd = [sys.executable, str(BENCH / "scaling.py"), "--json", str(scaling_json)] + (["--quick"] if quick else [])
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"scaling searches started in process {child.pid} (log: bench/out/scaling.log)", flush=True)

    import contenders  # noqa: E402

    phases = {}
    specs = common.QUICK if quick else common.SAMPLES + common.LARGE
    headline = report.headline_rows(quick)
    t = time.perf_counter()
    graphs, rows = [], []
    by_label = {}
    for spec in specs:
        literal = tuple(b for g, b in headline if g == spec.label)
        gf, graph_rows = contenders.evaluate_graph(spec, literal_budgets=literal)
        graphs.append(gf)
        rows += graph_rows
        by_label[spec.label] = (gf, graph_rows)
    phases["main table"] = time.perf_counter() - t

    import scaling  # noqa: E402

    t = time.perf_counter()
    if child is not None:
        print("\nwaiting for the scaling searches ...", flush=True)
        code = child.wait()
        if code != 0:
            print(f"the scaling process failed (exit {code}); see bench/out/scaling.log", file=sys.stderr)
            return 1
        found = json.loads(scaling_json.read_text())
        print((OUT / "scaling.log").read_text(), end="", flush=True)
        phases["waiting for scaling"] = time.perf_counter() - t
    else:
        print("\nscaling searches", flush=True)
        found = scaling.run_all(scaling.QUICK if quick else scaling.FULL)
        found["_seconds"] = time.perf_counter() - t
        phases["scaling"] = time.perf_counter() - t

    import speed  # noqa: E402

    print("\ntool speed against graph size", flush=True)
    t = time.perf_counter()
    points = [speed.measure(n) for n in (speed.QUICK_SIZES if quick else speed.FULL_SIZES)]
    for gf, graph_rows in by_label.values():
        if gf.group == "synthetic":
            point = speed.from_main_table(gf, graph_rows)
            if point is not None:
                points.append(point)
    points.sort(key=lambda p: p.nodes)
    phases["tool speed"] = time.perf_counter() - t

    elapsed = time.perf_counter() - started
    data = {
        "quick": quick, "command": "python bench/run.py" + (" --quick" if quick else ""),
        "date": datetime.date.today().isoformat(), "machine": info, "seconds": elapsed, "jobs": jobs,
        "phases": phases, "scaling_seconds": found.get("_seconds"),
        "graphs": [asdict(g) for g in graphs], "rows": [asdict(r) for r in rows],
        "scaling": {k: v for k, v in found.items() if not k.startswith("_")},
        "speed": [asdict(p) for p in points], "load": [load_start, os.getloadavg()[0]],
    }
    print(f"\nall done in {elapsed / 60:.1f} minutes", flush=True)
    if not args.no_write:
        data_path.write_text(json.dumps(data, indent=1, sort_keys=True))
        report.write(data, md_path, plot_dir)
        print(f"wrote {md_path.relative_to(common.ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
