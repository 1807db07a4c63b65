"""Scaling: the largest resolution or batch that fits a budget, without swapping and with each contender.

Each probe regenerates the graph at one size with the sample generator (cached in bench/out/).
Sizes live on a grid (ResNet-50 resolution in steps of 250 px, 3D U-Net volume in steps of 16
voxels, batch in steps of 1). A search keeps the largest size known to fit and the smallest known
not to, and proposes the next size by interpolating a memory figure that grows with the size as a
power law (Grappler's estimate of the original for "no swapping", our lower bound, the judged
peak of Grappler's optimizer), so most searches end after two or three probes; when proposals only
creep one grid step at a time it falls back to doubling and bisection. Fitting is assumed to be
monotone in the size.

- no swapping: Grappler's estimate of the original plus resident bytes <= budget;
- lower bound: the largest size whose lower bound is within the budget; no swap plan, ours or
  anyone's that only swaps, fits beyond it;
- a contender: its output, judged by Grappler, fits. Every contender fits at sizes that fit
  without swapping (there is nothing to do), so its search starts there; lms and lms tflms
  cannot pass the lower bound, so theirs ends there.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import grappler_opt
from common import GraphSpec, load, resnet_batch, resnet_res, unet
from contenders import LEVEL, diagnose_lms, reason


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    what: str  # resolution | volume | batch
    make: Callable[[int], GraphSpec]
    step: int
    lo: int
    hi: int
    exponent: float  # prior growth of memory with the size (area, volume, batch)
    anchors: tuple
    tolerance: float = 0.0  # a search may stop when the bracket is within this share of the size

    def snap(self, v: float) -> int:
        """The grid value at or below ``v`` (within the grid)."""
        k = math.floor((v - self.lo) / self.step + 1e-9)
        return int(min(max(self.lo + k * self.step, self.lo), self.hi))

    def show(self, v: int | None) -> str:
        if v is None:
            return "none"
        if self.what == "resolution":
            return f"{v}\u00b2"
        if self.what == "volume":
            return f"{v}\u00b3"
        return f"batch {v}"


SERIES = {
    "resnet-res": Series("resnet-res", "ResNet-50, batch 1: image size", "resolution", resnet_res, 250, 250, 20000, 2.0,
                         (2000, 4000, 7500)),
    "unet-res": Series("unet-res", "3D U-Net, batch 1: volume", "volume", unet, 16, 32, 1024, 3.0, (128, 192, 256)),
    "resnet-batch": Series("resnet-batch", "ResNet-50 224\u00b2: batch", "batch", resnet_batch, 1, 1, 8192, 1.0,
                           (32, 128, 512), tolerance=0.03),
}
SEARCHED = ("noswap", "lower-bound", "grappler-swap", "grappler-heur", "tflms", "lms")
# "grappler": every figure is Grappler's estimate (the main table's judge). "executor": lms's
# executor model (what a real run allocates, checked on the stand-in): the original's peak as
# TensorFlow runs it, the executor lower bound and lms's own plans, judged by that model
# (``--judge executor``; Grappler's optimizer and the TFLMS-style search are Grappler-judged only).
JUDGE = "grappler"
GRAPPLER_CONTENDERS = {"grappler": ("grappler-swap", "grappler-heur"), "executor": ()}
LMS_CONTENDERS = {"grappler": ("lms", "tflms"), "executor": ("lms",)}
MAX_EVALS = 8


def inverse(points: dict, target: float, exponent: float) -> float | None:
    """The size at which a figure growing as a power law of the size reaches ``target``,
    interpolated (or extrapolated) from ``points`` {size: figure}."""
    pts = sorted((v, s) for v, s in points.items() if s and s > 0)
    if not pts:
        return None
    below = [p for p in pts if p[1] <= target]
    above = [p for p in pts if p[1] > target]
    if below and above:
        (v1, s1), (v2, s2) = below[-1], above[0]
    elif len(pts) >= 2:
        (v1, s1), (v2, s2) = (pts[-2], pts[-1]) if not above else (pts[0], pts[1])
    else:
        (v1, s1), (v2, s2) = pts[0], (None, None)
    k = exponent
    if v2 is not None and v2 != v1 and s2 != s1:
        k = math.log(s2 / s1) / math.log(v2 / v1)
        if not (0.2 < k < 10):
            k = exponent
    return v1 * (target / s1) ** (1.0 / k)


@dataclass
class Probe:
    value: int
    model: object = None
    orig_tensor_peak: int | None = None
    sim_peak: int | None = None
    lower_bound: int | None = None
    results: dict = field(default_factory=dict)  # (contender, budget) -> (fits, judged peak or None, why not)


class SeriesRun:
    """Probes of one series, shared by every search on it."""

    def __init__(self, series: Series, log=print):
        self.s = series
        self.log = log
        self.probes: dict[int, Probe] = {}
        self.resident: int | None = None
        self._prepared: OrderedDict = OrderedDict()
        self.rho: dict[str, float] = {}  # contender -> budget / lower bound where it last reached
        self.counts = {"generated": 0, "estimated": 0, "prepared": 0, "lms-runs": 0, "grappler-runs": 0}
        self.seconds = 0.0

    # ------------------------------------------------------------------ probes
    def probe(self, v: int) -> Probe:
        if v not in self.probes:
            self.probes[v] = Probe(v)
        return self.probes[v]

    def model(self, v: int):
        p = self.probe(v)
        if p.model is None:
            p.model, gen_s = load(self.s.make(v))
            self.counts["generated"] += gen_s > 0
        return p.model

    def prepared(self, v: int):
        from lmscli import api

        if v in self._prepared:
            self._prepared.move_to_end(v)
            return self._prepared[v]
        prepared = api.prepare(self.model(v), judge=JUDGE)
        facts = api.analyze(prepared)
        self.counts["prepared"] += 1
        p = self.probe(v)
        p.sim_peak, p.lower_bound = facts.peak_bytes, facts.lower_bound_bytes
        if self.resident is None:
            self.resident = prepared.schedule.resident_bytes
        self._prepared[v] = prepared
        while len(self._prepared) > 10:
            self._prepared.popitem(last=False)
        return prepared

    def ensure_resident(self):
        if self.resident is None:
            self.prepared(self.s.anchors[0])

    def original(self, v: int) -> int:
        """Judged peak of the original: Grappler's estimate plus resident bytes (the same for
        every size of a series: variables do not depend on the shape)."""
        p = self.probe(v)
        if p.orig_tensor_peak is None and JUDGE == "executor":
            prepared = self.prepared(v)
            p.orig_tensor_peak = (prepared.run_peak_bytes or p.sim_peak) - prepared.schedule.resident_bytes
        if p.orig_tensor_peak is None:
            from lmscli import grappler

            model = self.model(v)
            p.orig_tensor_peak = grappler.estimate_peak(model.meta_graph, model.fetches).gpu_peak_bytes
            self.counts["estimated"] += 1
        self.ensure_resident()
        return p.orig_tensor_peak + self.resident

    def lower_bound(self, v: int) -> int:
        p = self.probe(v)
        if p.lower_bound is None:
            self.prepared(v)
        return p.lower_bound

    def contender(self, v: int, contender: str, budget: int) -> tuple[bool, int | None]:
        p = self.probe(v)
        key = (contender, budget)
        if key in p.results:
            return p.results[key]
        if contender in LEVEL:
            self.ensure_resident()
            model = self.model(v)
            run = grappler_opt.optimize(model.meta_graph, model.fetches, budget, LEVEL[contender])
            self.counts["grappler-runs"] += 1
            if run.error:
                out = (False, None, run.error)
            else:
                peak = grappler_opt.judge_graph_def(model.meta_graph, grappler_opt.judgeable(run.graph_def),
                                                    model.fetches, self.resident)
                out = (peak <= budget, peak, None if peak <= budget else "judged over the budget")
        else:
            from lmscli import api
            from lmscli.errors import LmsError

            prepared = self.prepared(v)
            self.counts["lms-runs"] += 1
            try:
                result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0),
                                  api.TuneOptions(strategy=contender))
                if JUDGE == "executor":  # the plan's peak as TensorFlow runs the rewrite, by the executor model
                    peak = int(result.plan.predicted.get("run_peak_bytes") or result.result.peak_bytes)
                else:
                    peak = int(result.plan.grappler["peak_bytes"])
                fits = peak <= budget if JUDGE == "executor" else bool(result.plan.grappler["fits"])
                out = (fits, peak, None if fits else "judged over the budget")
            except LmsError as exc:
                out = (False, None, reason(exc))
        p.results[key] = out
        return out

    # ------------------------------------------------------------------ search
    def search(self, lo: int | None, hi: int | None, fits: Callable[[int], bool],
               propose: Callable[[int | None, int | None], float | None]) -> tuple:
        """The largest grid size that fits, knowing ``lo`` fits and ``hi`` does not (either may be
        None). Returns (largest size found to fit or None, bracketed, probes made, smallest size
        found not to fit or None); bracketed means no untried size lies between the two beyond
        the series' tolerance."""
        s = self.s
        evals, creep = 0, 0
        while True:
            if lo is not None and hi is not None and hi - lo <= max(s.step, s.tolerance * lo):
                return lo, True, evals, hi
            if lo is not None and lo >= s.hi:
                return lo, True, evals, hi
            if hi is not None and hi <= s.lo:
                return None, True, evals, hi
            if evals >= MAX_EVALS:
                return lo, False, evals, hi
            low = s.lo if lo is None else lo + s.step
            high = s.hi if hi is None else hi - s.step
            guess = propose(lo, hi) if creep == 0 else None
            v = s.snap(guess) if guess is not None else None
            if v is None:  # no useful proposal, or the last one only crept by one step: bisect or gallop
                jump = s.step * 2 ** (creep + 1)
                if lo is not None and hi is not None:
                    v = s.snap((lo + hi) / 2)
                elif lo is not None:
                    v = lo + jump
                elif hi is not None:
                    v = hi - jump
                else:
                    v = s.anchors[0]
            v = min(max(v, low), high)
            ok = fits(v)
            evals += 1
            creep = creep + 1 if v == (low if ok else high) else 0
            if ok:
                lo = v
            else:
                hi = v

    def run(self, budgets, log=print) -> dict:
        """Every search of this series at each budget: {budget: {what: (largest size that fits,
        bracketed, probes, smallest size found not to fit[, why lms or tflms did not fit there])}}."""
        from lmscli.units import format_size

        t0 = time.perf_counter()
        out = {}
        for budget in budgets:
            out[budget] = self.at_budget(budget)
            log(f"  {self.s.label} within {format_size(budget)}: " + ", ".join(
                f"{k} {self.s.show(v[0])}{'' if v[1] else ' (search capped)'}" for k, v in out[budget].items()),
                flush=True)
        self.seconds += time.perf_counter() - t0
        return out

    def _known(self, key) -> dict:
        return {v: p.results[key] for v, p in self.probes.items() if key in p.results}

    def at_budget(self, budget: int) -> dict:
        s = self.s
        res = {}
        self.ensure_resident()

        # no swapping: interpolate Grappler's estimate of the original
        def origs():
            return {v: p.orig_tensor_peak + self.resident for v, p in self.probes.items()
                    if p.orig_tensor_peak is not None}

        known = origs()
        lo = max((v for v, x in known.items() if x <= budget), default=None)
        hi = min((v for v, x in known.items() if x > budget), default=None)
        res["noswap"] = self.search(lo, hi, lambda v: self.original(v) <= budget,
                                    lambda lo, hi: inverse(origs(), budget, s.exponent))
        floor = res["noswap"][0]

        # the lower bound
        def lbs():
            return {v: p.lower_bound for v, p in self.probes.items() if p.lower_bound is not None}

        known = lbs()
        lo = max([v for v, x in known.items() if x <= budget] + ([floor] if floor else []), default=None)
        hi = min((v for v, x in known.items() if x > budget), default=None)
        res["lower-bound"] = self.search(lo, hi, lambda v: self.lower_bound(v) <= budget,
                                         lambda lo, hi: inverse(lbs(), budget, s.exponent))
        ceiling = res["lower-bound"][0]

        # Grappler's optimizer: interpolate its judged peak at this budget (the original's
        # estimate, scaled, until it has two points of its own)
        for c in GRAPPLER_CONTENDERS[JUDGE]:
            def grappler_proposal(lo, hi, c=c):
                own = {v: r[1] for v, r in self._known((c, budget)).items() if r[1]}
                if len(own) >= 2:
                    return inverse(own, budget, s.exponent)
                base = origs()
                if own:
                    (v1, peak1), = own.items()
                    ratio = peak1 / self.original(v1)
                    base = {v: x * ratio for v, x in base.items()}
                return inverse(base, budget, s.exponent)

            known = self._known((c, budget))
            lo = max([v for v, r in known.items() if r[0]] + ([floor] if floor else []), default=None)
            hi = min((v for v, r in known.items() if not r[0] and (lo is None or v > lo)), default=None)
            res[c] = self.search(lo, hi, lambda v, c=c: self.contender(v, c, budget)[0], grappler_proposal)

        # lms and lms tflms: between no swapping and the lower bound. Their reachable peak is some
        # ratio rho >= 1 of the lower bound; each probe narrows rho, and the next size is where the
        # lower bound is budget / rho. lms first tries the lower bound itself (or the rho it reached at the
        # previous budget), tflms where lms ended.
        for c in LMS_CONTENDERS[JUDGE]:
            known = self._known((c, budget))
            lo = max([v for v, r in known.items() if r[0]] + ([floor] if floor else []), default=None)
            if ceiling is None or (lo is not None and ceiling <= lo):
                res[c] = (lo, True, 0, None)
                continue
            hi = min([v for v, r in known.items() if not r[0] and (lo is None or v > lo)] + [ceiling + s.step])
            if c == "tflms" and res["lms"][0]:
                first = res["lms"][0]
            elif self.rho.get(c):
                first = inverse(lbs(), budget / self.rho[c], s.exponent)
            else:
                first = ceiling

            def lms_proposal(lo, hi, c=c, first=first):
                tried = self._known((c, budget))
                if not tried:
                    return first
                fit_r = [budget / self.probes[v].lower_bound for v, r in tried.items()
                         if r[0] and self.probes[v].lower_bound]
                fail_r = [budget / self.probes[v].lower_bound for v, r in tried.items()
                          if not r[0] and self.probes[v].lower_bound and self.probes[v].lower_bound <= budget]
                r_hi = min(fit_r + [1.5])  # rho <= budget / lb at a size that fits
                r_lo = max(fail_r + [1.0])  # rho > budget / lb at a size that does not
                rho = math.sqrt(r_lo * max(r_hi, r_lo))
                return inverse(lbs(), budget / rho, s.exponent)

            res[c] = self.search(lo, hi, lambda v, c=c: self.contender(v, c, budget)[0], lms_proposal)
        # Where a search stopped within the tolerance, each of the two is tried at the other's
        # largest size, so that a difference between them is a measured one.
        for a, b in (("lms", "tflms"), ("tflms", "lms")):
            if a not in res or b not in res:
                continue
            va, vb, hi_a = res[a][0], res[b][0], res[a][3]
            if vb is None or (va is not None and vb <= va) or (hi_a is not None and hi_a <= vb):
                continue
            ok = self.contender(vb, a, budget)[0]
            found = list(res[a])
            found[2] += 1
            if ok:
                found[0] = vb
            else:
                found[3] = vb
            found[1] = found[3] is None or found[3] - found[0] <= max(s.step, s.tolerance * found[0])
            res[a] = tuple(found)
        for c in LMS_CONTENDERS[JUDGE]:
            first_fail = res[c][3]
            if first_fail is not None and (c, budget) in self.probe(first_fail).results:
                why = self.probe(first_fail).results[(c, budget)][2]
                beaten = any(res[o][0] is not None and res[o][0] >= first_fail
                             for o in ("grappler-swap", "grappler-heur", "tflms", "lms") if o != c and o in res)
                if c == "lms" and beaten and why and why != "judged over the budget":
                    why = diagnose_lms(self.prepared(first_fail), budget, why)
                res[c] = res[c] + (why,)
            top = res[c][0]
            if top and self.probe(top).lower_bound:
                self.rho[c] = budget / self.probe(top).lower_bound  # the next budget starts from here
        return res


QUICK = (("unet-res", (256 << 20, 512 << 20)),)
FULL = tuple((key, (16 << 30, 32 << 30)) for key in ("resnet-res", "unet-res", "resnet-batch"))


def run_all(plan, log=print) -> dict:
    """Run the searches of ``plan`` ((series key, budgets), ...): a JSON-ready dict."""
    out = {}
    for key, budgets in plan:
        run = SeriesRun(SERIES[key], log)
        found = run.run(budgets, log)
        out[key] = {"budgets": {str(b): {w: list(r) for w, r in found[b].items()} for b in budgets},
                    "counts": dict(run.counts), "seconds": run.seconds, "step": run.s.step,
                    "tolerance": run.s.tolerance}
    return out


def main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="the scaling searches of the benchmark, as JSON")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--judge", choices=("grappler", "executor"), default="grappler",
                        help="grappler: Grappler's estimate judges every contender; executor: lms's executor model "
                             "judges no swapping, the lower bound and lms's plans")
    args = parser.parse_args(argv)
    global JUDGE
    JUDGE = args.judge
    t = time.perf_counter()
    out = run_all(QUICK if args.quick else FULL)
    out["_seconds"] = time.perf_counter() - t
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    import os

    os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
