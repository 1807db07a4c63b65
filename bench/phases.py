"""Tool speed by phase: where `lms rewrite --gpu-mem 50%` and `lms analyze` / `lms tune` spend time.

Every figure is a whole CLI command run in a fresh process, as a user runs it, timed from outside
(interpreter start, TensorFlow's import and all), with the command's own per-phase profile
(``--profile-out``). TensorFlow's import time (``python -c "import tensorflow"``) is measured in
the same run, between the commands (median of its runs), and every command is given as a multiple
of it: the machine's load moves both alike.

    python bench/phases.py [--quick]     # writes bench/SPEED.md and bench/out/phases.json

Graphs: every sample graph (``analyze``; ``rewrite --gpu-mem 50%``, the issue's command, which on
most samples answers "no plan" because 50% less the default 10% reserve is below their lower bound;
and ``rewrite`` at a budget halfway between the lower bound and the peak, where a plan is made,
checked and written); tf_keras ResNet-50 (batch 8, 128x128) and DenseNet-121 (batch 4,
128x128) when tf_keras is installed (``make bench`` installs it with ``--no-deps``); synthetic
graphs from 5,000 to 60,000 nodes for ``analyze`` and ``tune`` (budget halfway between the lower
bound and the peak that ``analyze`` reports).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import keras_graphs  # noqa: E402

LMS = [sys.executable, "-m", "lmscli"]
SAMPLES = [  # (label, file, extra arguments)
    ("mlp", "mlp.meta", ()), ("cnn", "cnn.meta", ()), ("resnet50", "resnet50.meta", ()),
    ("unet3d", "unet3d.meta", ()), ("unknown_batch", "unknown_batch.meta", ("--batch-size", "32")),
    ("while_rnn", "while_rnn.meta", ()), ("cond_cnn", "cond_cnn.meta", ()),
    ("two_gpu_cnn", "two_gpu_cnn.meta", ()), ("mlp_savedmodel", "mlp_savedmodel", ()),
    ("frozen_cnn", "frozen_cnn.pb", ()),
]
SYNTHETIC = (5000, 20000, 60000)
QUICK_SYNTHETIC = (5000,)
# Phase groups shown as columns (the first matching path prefix wins); the rest is "other".
COLUMNS = (
    ("import", ("load", "import TensorFlow")),
    ("load", ("load",)),
    ("shapes", ("prepare", "shape inference")),
    ("Grappler sched.", ("prepare", "Grappler's scheduler")),
    ("Grappler opt.", ("prepare", "Grappler's optimizations")),
    ("Grappler opt. (2nd proc.)", ("prepare", "Grappler's optimizations (second process)")),
    ("analyze", ("analyze",)),
    ("plan", ("tune", "plan")),
    ("guard: Grappler opt.", ("tune", "Grappler's optimizations")),
    ("judge", ("tune", "judge")),
    ("Grappler estimate", ("tune", "Grappler's estimate")),
    ("emit+write", ("emit",)),
)


def import_seconds() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tensorflow"], check=True, capture_output=True,
                   env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return time.perf_counter() - t


def run(args: list[str]) -> dict:
    """One CLI command in a fresh process: wall seconds, exit code, its profile and its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        prof = os.path.join(tmp, "profile.json")
        t = time.perf_counter()
        out = subprocess.run(LMS + args + ["--profile-out", prof, "--json"], capture_output=True, text=True,
                             cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        wall = time.perf_counter() - t
        profile = json.loads(Path(prof).read_text()) if os.path.exists(prof) else {"phases": []}
    try:
        doc = json.loads(out.stdout) if out.stdout.strip() else {}
    except json.JSONDecodeError:
        doc = {}
    return {"wall_s": wall, "exit": out.returncode, "profile": profile, "doc": doc,
            "error": out.stderr.strip().splitlines()[-1] if out.returncode not in (0, 3) and out.stderr.strip() else ""}


def columns(profile: dict) -> dict:
    """Seconds per column: the top-level time of each phase group (nested phases inside the
    group are part of it), "emit" summed wherever it ran, "write" added to it."""
    got = {name: 0.0 for name, _ in COLUMNS}
    for p in profile.get("phases", []):
        path = tuple(p["phase"].split(" / "))
        for name, prefix in COLUMNS:
            if name == "emit+write":
                if path[-1] in ("emit", "write") and len(path) <= 2:
                    got[name] += p["seconds"]
                    break
                continue
            if path == prefix:
                got[name] += p["seconds"]
                break
    got["load"] -= got["import"]
    return got


def outcome(result: dict) -> str:
    if result["exit"] == 3:
        no_fit = result["doc"].get("no_fit") or {}
        bound, budget = no_fit.get("lower_bound_bytes"), no_fit.get("budget_bytes")
        return "no plan (budget below the lower bound)" if bound and budget and budget < bound else "no plan"
    if result["exit"] != 0:
        return f"failed: {result['error']}"
    doc = result["doc"]
    plan = doc.get("plan") or {}
    if "swaps" not in plan:
        return "analyzed"
    swaps, recomputes = len(plan["swaps"]), len(plan.get("recomputes", ()))
    if not swaps and not recomputes:
        return "fits without swapping"
    return f"{swaps} swaps" + (f", {recomputes} recomputations" if recomputes else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="re-render SPEED.md from bench/out/phases.json")
    parser.add_argument("--quick", action="store_true", help="three samples and one small synthetic graph")
    args = parser.parse_args(argv)
    if args.report_only:
        data = json.loads((HERE / "out" / "phases.json").read_text())
        for row in data["rows"]:
            row["outcome"] = outcome(row)
        (HERE / "SPEED.md").write_text(render(data["meta"], data["rows"]))
        return 0
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    imports = [import_seconds()]
    rows = []

    def measure(label: str, kind: str, cmd: list[str]) -> None:
        result = run(cmd)
        imports.append(import_seconds())
        rows.append({"graph": label, "command": kind, "args": cmd, **result, "columns": columns(result["profile"]),
                     "outcome": outcome(result)})
        print(f"  {label:<28} {kind:<22} {result['wall_s']:6.2f} s  {outcome(result)}", flush=True)

    samples = SAMPLES[:3] if args.quick else SAMPLES
    with tempfile.TemporaryDirectory() as tmp:
        print("lms analyze, lms rewrite --gpu-mem 50% and at a budget halfway between the lower bound and the peak",
              flush=True)
        graphs = [(label, str(ROOT / "sample_graphs" / f), list(extra)) for label, f, extra in samples]
        if keras_graphs.available() and not args.quick:
            graphs += [(f"tf_keras {keras_graphs.GRAPHS[s][0]} b{keras_graphs.GRAPHS[s][1]} "
                        f"{keras_graphs.GRAPHS[s][2]}²", str(keras_graphs.build(s)), []) for s in keras_graphs.GRAPHS]
        for label, path, extra in graphs:
            out = os.path.join(tmp, "out" + ("" if os.path.isdir(path) else Path(path).suffix))
            measure(label, "analyze", ["analyze", path, *extra])
            facts = rows[-1]["doc"]
            measure(label, "rewrite --gpu-mem 50%", ["rewrite", path, out, "--gpu-mem", "50%", *extra])
            if facts.get("lower_bound_bytes") and facts.get("peak_bytes"):
                budget = (facts["lower_bound_bytes"] + facts["peak_bytes"]) // 2
                measure(label, "rewrite (budget: halfway)",
                        ["rewrite", path, out, "--gpu-mem", str(budget), "--reserve", "0", *extra])
        print("analyze and tune on synthetic graphs", flush=True)
        from common import ensure_generated, synthetic

        for n in (QUICK_SYNTHETIC if args.quick else SYNTHETIC):
            path = str(ensure_generated(synthetic(n))[0])  # cached in bench/out/
            label = f"synthetic {n:,} nodes"
            measure(label, "analyze", ["analyze", path])
            facts = rows[-1]["doc"]
            budget = (facts["lower_bound_bytes"] + facts["peak_bytes"]) // 2
            measure(label, "tune (budget: halfway)", ["tune", path, "--gpu-mem", str(budget), "--reserve", "0"])
    median_import = statistics.median(imports)
    for row in rows:
        row["x_import"] = row["wall_s"] / median_import
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "import_s": imports, "median_import_s": median_import,
            "load": [load_start, os.getloadavg()[0]], "minutes": (time.perf_counter() - started) / 60}
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / "phases.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    if not args.quick:
        (HERE / "SPEED.md").write_text(render(meta, rows))
        print(f"wrote {HERE / 'SPEED.md'}")
    return 0


def render(meta: dict, rows: list[dict]) -> str:
    import tensorflow as tf

    imp = meta["median_import_s"]
    lines = [
        "# Tool speed by phase",
        "",
        f"Made by `python bench/phases.py` (part of `make bench`) on {meta['date']}: {meta['machine']}, Python "
        f"{meta['python']}, TensorFlow {tf.__version__}, no GPU; {meta['minutes']:.1f} minutes. Load average (1 min) "
        f"{meta['load'][0]:.1f} at the start, {meta['load'][1]:.1f} at the end.",
        "",
        f"Each command runs in a fresh process as a user runs it (`python -m lmscli ... --json`), timed from "
        f"outside: interpreter start, TensorFlow's import and everything else. **× import** divides that by the "
        f"median time of `python -c \"import tensorflow\"`, measured between the commands of this run: "
        f"{imp:.2f} s (runs: {', '.join(f'{s:.1f}' for s in meta['import_s'])}). The phase columns come from the "
        "command's own profile (`--profile-out`): seconds at the top level of each phase; *Grappler opt. (2nd "
        "proc.)* is the wait for Grappler's default optimizations running in a forked second process beside shape "
        "inference and Grappler's scheduler (`lmscli.grappler.optimize_in_parallel`); *guard: Grappler opt.* is the "
        "same optimizations of each rewritten candidate (the bit-identity guard and the judge share it); *judge* "
        "prepares and simulates the optimized rewrite.",
        "",
    ]
    names = [name for name, _ in COLUMNS]
    lines.append("| graph | command | wall s | × import | result | " + " | ".join(names) + " | other |")
    lines.append("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- |")
    for row in rows:
        cols = row["columns"]
        other = max(0.0, row["wall_s"] - sum(cols.values()))
        lines.append(f"| {row['graph']} | `{row['command']}` | {row['wall_s']:.2f} | {row['x_import']:.1f}× | "
                     f"{row['outcome']} | " + " | ".join(f"{cols[n]:.2f}" if cols[n] >= 0.005 else "" for n in names)
                     + f" | {other:.2f} |")
    lines += ["", "*other*: interpreter start and what no phase covers (argument parsing, reports, JSON).", ""]
    rewrites = [r for r in rows if r["command"].startswith("rewrite")]
    worst = max(rewrites, key=lambda r: r["x_import"]) if rewrites else None
    if worst:
        lines.append(f"Slowest rewrite relative to the import: {worst['graph']}, {worst['x_import']:.1f}× "
                     f"({worst['wall_s']:.1f} s).")
    for row in rows:
        if row["graph"].startswith("synthetic 60,000"):
            lines.append(f"{row['graph']}, `{row['command']}`: {row['wall_s'] - imp:.1f} s beyond the import.")
    floor = HERE / "out" / "floor.json"  # (bench/floor.py, which make bench-speed runs first)
    if floor.exists():
        import floor as floor_bench

        lines += floor_bench.render(json.loads(floor.read_text()))
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
