"""Real memory: the smallest limit under which one training step really runs, on the stand-in GPU.

For each graph, three graphs are measured by bisection on the stand-in (a TensorFlow server
process whose BFC allocator, the one GPUs use, has a hard limit; swaps go to a second process):

* the original;
* lms's plan at the smallest ``--gpu-mem`` at which ``lms rewrite --stand-in`` finds one (searched
  upwards from the lower bound to the original's need in 15 even steps, then three bisections
  below the first step with a plan; default reserve): planned in the order and
  with the kernel scratch observed on the stand-in, and judged by real runs there at that limit;
* the TFLMS-style plan (``--strategy tflms``) at that limit, or the smallest above it it accepts.

Beside each measured limit: what lms predicts for it (the executor model of the graph TensorFlow
runs, with the CPU scratch) and Grappler's static estimate (plus variables). The lower bound is
that of the executor model with scratch. Writes bench/REAL-MEMORY.md and bench/out/realmem.json.

    python bench/realmem.py            # the graphs below (about 55 minutes on 2 cores)
    python bench/realmem.py --quick    # the residual MLP only (a few minutes)
    python bench/realmem.py --share    # ResNet-50 384² b2 alone (bench/REAL-MEMORY-SHARE.md)

``--share`` measures ResNet-50 where a plan under 0.4x the original's need can exist at all: at
64² the variables, their momentum and the weight gradients are most of its need, and 0.4x of it
is below the lower bound; at 384² batch 2 the activations dominate.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass

from common import BENCH, OUT, generated, load, sup

GRAPHS = {
    "full": [
        ("residual MLP b4096 w512 (synthetic)", generated("synthetic", nodes=600, batch=4096, width=512)),
        ("ResNet-50 64" + sup(2) + " b2 (sample)", generated("resnet50", image_size=64, batch=2)),
        ("DenseNet-style b8 64" + sup(2), generated("densenet", batch=8, image_size=64, growth=24, blocks=3,
                                                    layers_per_block=4)),
        ("3D U-Net 64" + sup(3) + " b1", generated("unet3d", volume=64, batch=1)),
        ("transformer b4 s128 d128 2 layers", generated("transformer", batch=4, seq=128, d_model=128, heads=4,
                                                         ffn=512, layers=2)),
        ("tanh RNN b64 h256, 128 steps (stack_rnn sample)", generated("stack_rnn")),
    ],
    "quick": [
        ("residual MLP b4096 w512 (synthetic)", generated("synthetic", nodes=600, batch=4096, width=512)),
    ],
}
SHARE_GRAPH = ("ResNet-50 384" + sup(2) + " b2", generated("resnet50", image_size=384, batch=2))
SHARE = 0.4  # --share: the target share of the original's need, where lms's scan starts
MAX_TRIES = 15  # limits tried: from the lower bound to the original's need in this many even steps
REFINE = 3  # then bisections between the last step without a plan and the first with one


@dataclass
class Measured:
    what: str
    min_limit_bytes: int | None
    predicted_bytes: int | None  # executor model of the optimized graph, CPU scratch included
    predicted_gpu_bytes: int | None  # the same without CPU scratch (what a GPU would need)
    grappler_bytes: int | None
    swapped_bytes: int = 0
    recomputed_bytes: int = 0
    hosted_bytes: int = 0  # what gradient stacks kept on the host hold
    budget_bytes: int | None = None
    probes: int = 0
    varies: bool = False
    seconds: float = 0.0
    note: str = ""


def _measure(stand_in, model, label: str, observation, extra: dict) -> Measured:
    from lmscli.prove import realmem

    need, = realmem.measure_need([model], runs=3, stand_in=stand_in, observation=observation)
    p = need.prediction
    return Measured(label, need.min_limit_bytes, p.predicted_standin_bytes, p.predicted_bytes, p.grappler_bytes,
                    probes=len(need.probes), varies=need.varies, seconds=need.seconds, **extra)


def _smallest_plan(prepared, bound: int, need: int, strategy: str, limit_from: int | None = None,
                   log=lambda text: None, refine: int = REFINE):
    """(limit, TuneResult): the smallest limit, from the lower bound (or ``limit_from``) up to the
    original's ``need`` in :data:`MAX_TRIES` even steps, then ``refine`` bisections below it,
    at which ``lms rewrite --stand-in --gpu-mem LIMIT`` (default reserve) finds a plan: each plan
    is judged by real runs on the stand-in under that limit. (Steps of 10% of the bound stopped
    short of the need once a larger set of swappable tensors lowered the bound; the even steps of
    a residual MLP were 14.5 MiB, and its plan was made at 66 MiB where 59 also plans.) The tune is
    ``lms rewrite``'s (:func:`lmscli.api.tune`: the strategy's search, then the others' when the
    judge turns all its plans down)."""
    from lmscli import api
    from lmscli.device import STAND_IN_LINK
    from lmscli.errors import NoFitError

    def plan(limit: int):
        t = time.perf_counter()
        try:
            result = api.tune(prepared, api.make_device(gpu_mem=limit, link=STAND_IN_LINK),
                              api.TuneOptions(strategy=strategy))
        except NoFitError:
            result = None
        log(f"  {strategy} at {limit / 2**20:.0f} MiB: {'plan' if result else 'no plan'} "
            f"({time.perf_counter() - t:.0f} s)")
        return result

    start = limit_from or bound
    below = None  # the last limit without a plan
    for k in range(MAX_TRIES):
        limit = int(start + (need - start) * k / MAX_TRIES) // 2**20 * 2**20
        result = plan(limit)
        if result is None:
            below = limit
            continue
        # Between the step without a plan and this one, bisect (at most REFINE more tunes).
        for _ in range(refine if below is not None else 0):
            mid = (below + limit) // 2 // 2**20 * 2**20
            if mid <= below:
                break
            found = plan(mid)
            if found is None:
                below = mid
            else:
                limit, result = mid, found
        return limit, result
    return None, None


def evaluate(label: str, spec, stand_in, log, from_share: float | None = None) -> dict:
    """The rows of one graph. ``from_share`` (``--share``): lms's scan starts at that share of the
    original's need instead of the lower bound, bisects once below its first plan, and the
    TFLMS-style row is left out (at 384², each judged plan costs minutes of real runs: one tune at
    407 MiB took 17 minutes, and three bisections and TFLMS's scan did not end in 55 minutes)."""
    import os
    import tempfile

    from lmscli import api

    model, _ = load(spec)
    from lmscli.prove.scratch import Observation

    prepared = api.for_stand_in(api.prepare(model), stand_in)
    observation = Observation(dict(prepared.scratch or {}), prepared.observed_order,
                              dict(prepared.observed_micros or {}), scratch_first=prepared.scratch_first)
    bound = api.analyze(prepared).lower_bound_bytes
    rows = [_measure(stand_in, model, "original", observation, {})]
    log(f"{label}: original needs {rows[0].min_limit_bytes:,} (predicted {rows[0].predicted_bytes:,})")
    need = rows[0].min_limit_bytes
    limit, lms_result = _smallest_plan(prepared, bound, need, "hybrid",
                                       max(bound, int(need * from_share)) if from_share else None, log,
                                       refine=1 if from_share else REFINE)
    plans = [("lms", limit, lms_result)]
    if lms_result is not None and not from_share:
        plans.append(("lms --strategy tflms", *_smallest_plan(prepared, bound, need, "tflms", limit, log)))
    with tempfile.TemporaryDirectory() as tmp:
        for what, limit, result in plans:
            if result is None:
                rows.append(Measured(what, None, None, None, None, note="no plan below the original's need"))
                continue
            path = os.path.join(tmp, f"{what.split()[-1]}.meta")
            api.save(model, api.rewrite(prepared, result.plan)[0], path)
            rewritten = api.load(path, fetch=list(model.fetches))
            row = _measure(stand_in, rewritten, what, observation,
                           {"swapped_bytes": result.plan.swap_out_bytes,
                            "recomputed_bytes": result.plan.recompute_bytes,
                            "hosted_bytes": sum(h.bytes for h in result.plan.on_host),
                            "budget_bytes": limit})
            rows.append(row)
            log(f"{label}: {what} made at {row.budget_bytes:,} needs {row.min_limit_bytes:,} "
                f"(predicted {row.predicted_bytes:,})")
    return {"graph": label, "lower_bound_bytes": bound, "rows": [asdict(r) for r in rows]}


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f} MiB"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def markdown(results: list, seconds: float, quick: bool) -> str:
    lines = ["# Real memory on the stand-in GPU", "",
             f"Made by `python bench/realmem.py{' --quick' if quick else ''}` on {time.strftime('%Y-%m-%d')} "
             f"({platform.machine()}, Python {platform.python_version()}), {seconds / 60:.1f} minutes. "
             "Each *measured* figure is the smallest limit, to 1 MiB, under which one training step ran in three "
             "runs out of three on the stand-in GPU (TensorFlow's BFC allocator with a hard limit, in a server "
             "process; swaps to a second process; TensorFlow's optimizations on). *Predicted* is lms's executor "
             "model of the graph TensorFlow runs, in the orders and with the CPU kernels' scratch buffers traced "
             "steps on the stand-in showed (the largest over their orders; a GPU would need the *GPU* figure, "
             "in Grappler's order and without them; the stand-in runs convolution gradients with Eigen kernels, "
             "which take no col buffer). "
             "*Grappler* is TensorFlow's static estimate plus "
             "variables. lms's plan is made by `lms rewrite --stand-in --gpu-mem LIMIT` (default reserve) at the "
             "smallest LIMIT it accepts, from the lower bound up to the original's need in 15 even steps and three "
             "bisections below the first step with a plan (its "
             "judge ran each plan five times under LIMIT on the stand-in, and five more under LIMIT less half "
             "the reserve); the TFLMS-style plan "
             "(`--strategy tflms`) at that limit or the smallest above it that it accepts. *(varies)*: the "
             "search saw a limit fit once and fail when confirmed (the executor's order differs between runs).", "",
             ] + table(results)
    return "\n".join(lines) + "\n"


def table(results: list) -> list:
    """The markdown table of ``results``, one row per graph that ran."""
    lines = ["| graph | lower bound | what ran | measured | predicted | predicted vs measured | GPU "
             "figure | Grappler | × lower bound | × original |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        original = res["rows"][0]["min_limit_bytes"]
        for row in res["rows"]:
            m = row["min_limit_bytes"]
            pred = row["predicted_bytes"]
            diff = "-" if not m or not pred else f"{pred / m - 1:+.1%}"
            what = row["what"] + (f" (made at {_mib(row['budget_bytes'])}, {_mib(row['swapped_bytes'])} swapped, "
                                  f"{_mib(row.get('recomputed_bytes'))} recomputed"
                                  + (f", {_mib(row['hosted_bytes'])} of loop stacks on the host"
                                     if row.get("hosted_bytes") else "") + ")"
                                  if row["budget_bytes"] else "") + (" (varies)" if row["varies"] else "")
            if row["note"]:
                what += f": {row['note']}"
            lines.append(f"| {res['graph']} | {_mib(res['lower_bound_bytes'])} | {what} | {_mib(m)} | {_mib(pred)} | "
                         f"{diff} | {_mib(row['predicted_gpu_bytes'])} | {_mib(row['grappler_bytes'])} | "
                         f"{_ratio(m, res['lower_bound_bytes'])} | {_ratio(m, original)} |")
    return lines


def share_markdown(res: dict, seconds: float) -> str:
    lines = ["# Real memory: ResNet-50 where 0.4x of its need is above the lower bound", "",
             f"Made by `python bench/realmem.py --share` on {time.strftime('%Y-%m-%d')} ({platform.machine()}, "
             f"Python {platform.python_version()}), {seconds / 60:.1f} minutes, as REAL-MEMORY.md is made (see there "
             "for the columns). At 64" + sup(2) + " (REAL-MEMORY.md) the variables, their momentum and the weight "
             "gradients are most of ResNet-50's need, and 0.4x of it is below the lower bound; at 384" + sup(2)
             + " batch 2 the activations dominate. lms's scan starts at " + f"{SHARE}x" + " the original's need (the "
             "target), not at the lower bound, in steps of a fifteenth of the way to the need, with one bisection "
             "below its first plan; no TFLMS-style row (each judged plan costs minutes of real runs at this "
             "size).", ""] + table([res])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, a few minutes")
    parser.add_argument("--share", action="store_true", help="ResNet-50 384² b2 at 0.4x the original's need")
    args = parser.parse_args(argv)
    from lmscli.prove.standin import StandIn

    t = time.perf_counter()
    if args.share:
        with StandIn() as stand_in:
            res = evaluate(*SHARE_GRAPH, stand_in, lambda text: print(text, flush=True), from_share=SHARE)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "realmem-share.json").write_text(json.dumps(res, indent=2))
        text = share_markdown(res, time.perf_counter() - t)
        (BENCH / "REAL-MEMORY-SHARE.md").write_text(text)
        print(text)
        return 0
    results = []
    with StandIn() as stand_in:
        for label, spec in GRAPHS["quick" if args.quick else "full"]:
            results.append(evaluate(label, spec, stand_in, lambda text: print(text, flush=True)))
    seconds = time.perf_counter() - t
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / ("realmem-quick.json" if args.quick else "realmem.json")).write_text(json.dumps(results, indent=2))
    (BENCH / "REAL-MEMORY.md").write_text(markdown(results, seconds, args.quick))
    print(markdown(results, seconds, args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
