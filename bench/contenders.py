"""The contenders on one (graph, budget), each judged by Grappler's estimate.

original          the graph as it is
grappler-swap     Grappler's memory optimizer, SWAPPING_HEURISTICS, virtual GPU of the budget's size
grappler-heur     the same with HEURISTICS (recomputation and swapping)
tflms             ``api.tune`` with ``TuneOptions(strategy='tflms')`` (lms --strategy tflms)
lms               ``api.tune`` with the default options (lms)

Budgets are plain GPU sizes with no reserve: the virtual GPU of Grappler's optimizer has exactly
the budget, and ``lms`` plans for ``make_device(gpu_mem=budget, reserve=0)``. A contender fits
when its judged peak (Grappler's estimate plus resident bytes) is at most the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grappler_opt
from common import CONTENDERS, SHORT, GraphSpec, load

LEVEL = {"grappler-swap": "SWAPPING_HEURISTICS", "grappler-heur": "HEURISTICS"}

# Grappler's optimizer and its judge take about a minute per budget on the 60,000-node graph; on
# graphs this large it is not run at budgets below the lower bound (the row says so).
GRAPPLER_CAP_NODES = 20000


@dataclass
class Outcome:
    contender: str
    status: str  # ran | no plan | error | not run
    peak: int | None = None  # judged: Grappler's estimate plus resident bytes
    fits: bool | None = None
    swapped: int | None = None  # bytes copied to the host
    nvlink2: float | None = None  # predicted step-time overhead
    pcie3: float | None = None
    seconds: float | None = None  # wall time of the tool
    note: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class Row:
    graph: str
    budget_label: str
    budget: int
    kind: str  # fits (without swapping) | below-resident | swap
    outcomes: list = field(default_factory=list)

    def get(self, contender: str) -> Outcome | None:
        for o in self.outcomes:
            if o.contender == contender:
                return o
        return None


@dataclass
class GraphFacts:
    label: str
    group: str
    nodes: int
    sim_peak: int  # our simulator's no-swap peak (analysis)
    judged_peak: int  # Grappler's estimate of the original plus resident bytes
    lower_bound: int
    resident: int
    gen_s: float
    load_s: float
    prepare_s: float
    analyze_s: float
    estimate_s: float
    notes: tuple = ()


def budgets_for(sim_peak: int) -> list[tuple[str, int]]:
    return [("16 GiB", 16 << 30), ("32 GiB", 32 << 30), ("75%", int(sim_peak * 0.75)),
            ("50%", int(sim_peak * 0.50)), ("35%", int(sim_peak * 0.35))]


def _plan_template(prepared) -> dict:
    """Schema, version and graph fields of an lms plan for this graph (from an empty plan)."""
    from lmscli import api

    result = api.tune(prepared, api.make_device(gpu_mem=1 << 50, reserve=0.0), check=False)
    data = result.plan.to_dict()
    data["swaps"] = []
    return data


def reason(exc) -> str:
    """The first line of an lms error, without its advice to the user."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split("; try ")[0]


def run_lms(prepared, budget: int, strategy: str, lower_bound: int) -> Outcome:
    from lmscli import api
    from lmscli.errors import LmsError, NoFitError

    device = api.make_device(gpu_mem=budget, reserve=0.0)
    t = time.perf_counter()
    try:
        result = api.tune(prepared, device, api.TuneOptions(strategy=strategy))
    except NoFitError as exc:
        seconds = time.perf_counter() - t
        why = "below the lower bound" if lower_bound > budget else reason(exc)
        return Outcome(strategy, "no plan", fits=False, seconds=seconds, note=why)
    except LmsError as exc:
        return Outcome(strategy, "error", seconds=time.perf_counter() - t, note=reason(exc))
    tune_s = time.perf_counter() - t
    t = time.perf_counter()
    api.rewrite(prepared, result.plan)
    rewrite_s = time.perf_counter() - t
    judged = result.plan.grappler
    links = api.with_link_predictions(prepared, result).plan.predicted["per_link"]
    return Outcome(strategy, "ran", peak=int(judged["peak_bytes"]), fits=bool(judged["fits"]),
                   swapped=result.plan.swap_out_bytes, nvlink2=links["nvlink2"]["overhead"],
                   pcie3=links["pcie3"]["overhead"], seconds=tune_s + rewrite_s,
                   extra={"tune_s": tune_s, "rewrite_s": rewrite_s, "swaps": len(result.plan.swaps),
                          "predicted_peak": result.plan.predicted.get("peak_bytes"),
                          "rounds": judged.get("rounds")})


def diagnose_lms(prepared, budget: int, message: str) -> str:
    """Why lms found no plan, when the reason is not the lower bound: whether its planner found a
    plan that fits our simulator (which Grappler's check then turned down) or got stuck."""
    from lmscli import api
    from lmscli.errors import LmsError
    from lmscli.units import format_size

    try:
        result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0), check=False)
    except LmsError:
        return f"its planner gets stuck: {message}"
    return (f"its plan fits our simulator ({format_size(result.plan.predicted.get('peak_bytes'))}, "
            f"{format_size(result.plan.swap_out_bytes)} swapped) but Grappler's check judged it over the budget, "
            f"and planning again under a margin found nothing: {message}")


def _replay(prepared, plan_dict: dict):
    """Our simulator's replay of Grappler's swaps: (swapped bytes, nvlink2, pcie3, note)."""
    from lmscli import api
    from lmscli.errors import LmsError

    def attempt(swaps):
        data = dict(plan_dict, swaps=swaps)
        result = api.replay(prepared, api.Plan.from_dict(data))
        result = api.with_link_predictions(prepared, result)
        links = result.plan.predicted["per_link"]
        # One Grappler pair is one swap-in group: it copies the tensor out and back once.
        return result.plan.predicted["swap_in_bytes"], links["nvlink2"]["overhead"], links["pcie3"]["overhead"]

    swaps = plan_dict["swaps"]
    if not swaps:
        return 0, 0.0, 0.0, ""
    try:
        return attempt(swaps) + ("",)
    except LmsError:
        kept = []
        for swap in swaps:
            try:
                attempt([swap])
                kept.append(swap)
            except LmsError:
                pass
        if not kept:
            return None, None, None, "its swaps could not be replayed"
        return attempt(kept) + (f"{len(swaps) - len(kept)} of {len(swaps)} swapped tensors not replayed",)


def run_grappler(model, prepared, budget: int, contender: str, resident: int, template: dict,
                 literal: bool = False) -> Outcome:
    from lmscli import api
    from lmscli.errors import LmsError

    meta = api.with_graph_def(model.meta_graph, prepared.graph_def)
    run = grappler_opt.optimize(meta, model.fetches, budget, LEVEL[contender])
    if run.error:
        return Outcome(contender, "error", seconds=run.seconds, note=run.error)
    try:
        peak = grappler_opt.judge_graph_def(model.meta_graph, grappler_opt.judgeable(run.graph_def),
                                            model.fetches, resident)
    except LmsError as exc:
        return Outcome(contender, "error", seconds=run.seconds, note=f"judge: {str(exc)[:160]}")
    extra = {"swap_pairs": run.swap_pairs, "recomputed": run.recomputed}
    if literal and run.swap_pairs:
        extra["literal_peak"] = grappler_opt.judge_graph_def(
            model.meta_graph, grappler_opt.judgeable(run.graph_def, swap_out_on_host=False), model.fetches, resident)
    swapped, nv, pc, note = _replay(prepared, grappler_opt.swap_plan(prepared.graph_def, run.graph_def, template))
    notes = [note] if note else []
    if run.recomputed:
        notes.append(f"{run.recomputed} nodes added for recomputation (not in the step-time model)")
    return Outcome(contender, "ran", peak=peak, fits=peak <= budget, swapped=swapped, nvlink2=nv, pcie3=pc,
                   seconds=run.seconds, note="; ".join(notes), extra=extra)


def evaluate_graph(spec: GraphSpec, literal_budgets=(), log=print):
    """Analyse one graph and run every contender at every budget: ``(GraphFacts, [Row])``."""
    from lmscli import api

    t = time.perf_counter()
    model, gen_s = load(spec)
    load_s = time.perf_counter() - t - gen_s
    t = time.perf_counter()
    # One judge scores every contender in this table: Grappler's estimate (lms judged alike); the
    # real-memory table (bench/realmem.py) is where the stand-in GPU judges.
    prepared = api.prepare(model, batch_size=spec.batch_size, judge="grappler")
    prepare_s = time.perf_counter() - t
    t = time.perf_counter()
    facts = api.analyze(prepared)
    analyze_s = time.perf_counter() - t
    resident = prepared.schedule.resident_bytes
    t = time.perf_counter()
    judged = grappler_opt.judge_graph_def(model.meta_graph, prepared.graph_def, model.fetches, resident)
    estimate_s = time.perf_counter() - t
    gf = GraphFacts(spec.label, spec.group, facts.vertices, facts.peak_bytes, judged, facts.lower_bound_bytes,
                    resident, gen_s, load_s, prepare_s, analyze_s, estimate_s, tuple(model.notes))
    from lmscli.units import format_size

    log(f"\n{spec.label}: {facts.vertices:,} nodes; no-swap peak {format_size(facts.peak_bytes)} simulated, "
        f"{format_size(judged)} per Grappler; lower bound {format_size(facts.lower_bound_bytes)}; "
        f"generated {gen_s:.1f}s, prepared {prepare_s:.1f}s", flush=True)
    template = None
    rows = []
    for label, budget in budgets_for(facts.peak_bytes):
        original = Outcome("original", "ran", peak=judged, fits=judged <= budget, swapped=0, nvlink2=0.0, pcie3=0.0)
        if judged <= budget and facts.peak_bytes <= budget:
            rows.append(Row(spec.label, label, budget, "fits", [original]))
            log(f"  {label:>6} ({format_size(budget)}): fits without swapping", flush=True)
            continue
        if budget < resident:
            rows.append(Row(spec.label, label, budget, "below-resident", [original]))
            log(f"  {label:>6} ({format_size(budget)}): below the resident bytes ({format_size(resident)})", flush=True)
            continue
        row = Row(spec.label, label, budget, "swap", [original])
        outcomes = {}
        for strategy in ("tflms", "lms"):
            outcomes[strategy] = run_lms(prepared, budget, strategy, facts.lower_bound_bytes)
        for contender in ("grappler-swap", "grappler-heur"):
            if facts.vertices > GRAPPLER_CAP_NODES and facts.lower_bound_bytes > budget:
                outcomes[contender] = Outcome(contender, "not run", note=(
                    f"time cap: graphs over {GRAPPLER_CAP_NODES:,} nodes are not given to Grappler's "
                    "optimizer below the lower bound"))
                continue
            if template is None:
                template = _plan_template(prepared)
            outcomes[contender] = run_grappler(model, prepared, budget, contender, resident, template,
                                               literal=label in literal_budgets)
        lms, tfl = outcomes["lms"], outcomes["tflms"]
        if lms.status == "no plan" and lms.note != "below the lower bound" and tfl.status == "ran" and tfl.fits:
            lms.note = diagnose_lms(prepared, budget, lms.note)
        row.outcomes += [outcomes[c] for c in CONTENDERS[1:]]
        rows.append(row)
        for o in row.outcomes[1:]:
            if o.status == "ran":
                log(f"  {label:>6} ({format_size(budget)}) {SHORT[o.contender]:<20} peak {format_size(o.peak)} "
                    f"({'fits' if o.fits else 'does NOT fit'}), swapped {format_size(o.swapped)}, "
                    f"overhead nvlink2 {_p(o.nvlink2)} pcie3 {_p(o.pcie3)}, {o.seconds:.2f}s"
                    + (f"  [{o.note}]" if o.note else ""), flush=True)
            else:
                log(f"  {label:>6} ({format_size(budget)}) {SHORT[o.contender]:<20} {o.status}: {o.note}", flush=True)
    return gf, rows


def _p(x):
    return "n/a" if x is None else f"{x * 100:.1f}%"
