"""RESULTS.md and the plots, written from the measured data only (the run's JSON)."""

from __future__ import annotations

import statistics
from pathlib import Path

from common import CONTENDERS, NAMES, SHORT
from lmscli.units import format_size

SERIES_ORDER = ("resnet-res", "unet-res", "resnet-batch")
SERIES_LABEL = {
    "resnet-res": ("ResNet-50 batch 1, image size", "resolution"),
    "unet-res": ("3D U-Net batch 1, volume", "volume"),
    "resnet-batch": ("ResNet-50 224\u00b2, batch size", "batch"),
}
X = "\u00d7"
PEAK_MARGIN = 0.005  # a lower peak counts when it is lower by more than this share
SEARCHES = ("noswap", "grappler-swap", "grappler-heur", "tflms", "lms", "lower-bound")


def headline_rows(quick: bool):
    if quick:
        return [("ResNet-50 500\u00b2 b1", "50%"), ("3D U-Net 64\u00b3 b1", "75%")]
    return [("ResNet-50 7500\u00b2 b1", "32 GiB"), ("3D U-Net 192\u00b3 b1", "16 GiB"),
            ("ResNet-50 224\u00b2 b128", "16 GiB"), ("3D U-Net 256\u00b3 b4", "75%")]


def chart_rows(quick: bool):
    if quick:
        return [("cnn (sample)", "75%"), ("3D U-Net 64\u00b3 b1", "75%"), ("ResNet-50 500\u00b2 b1", "50%"),
                ("ResNet-50 500\u00b2 b1", "75%")]
    return [("ResNet-50 2000\u00b2 b1", "50%"), ("ResNet-50 4000\u00b2 b1", "50%"), ("ResNet-50 7500\u00b2 b1", "32 GiB"),
            ("ResNet-50 224\u00b2 b128", "16 GiB"), ("ResNet-50 224\u00b2 b512", "32 GiB"),
            ("3D U-Net 192\u00b3 b1", "75%"), ("3D U-Net 256\u00b3 b4", "75%"), ("synthetic 60,000 nodes", "75%")]


# ---------------------------------------------------------------- small formatters
def pct(x) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def sec(x) -> str:
    if x is None:
        return ""
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def times(x) -> str:
    return "" if x is None else f"{x:.2f}\u00d7"


def budget_text(row) -> str:
    if row["budget_label"].endswith("%"):
        return f"{row['budget_label']} ({format_size(row['budget'])})"
    return row["budget_label"]


def outcome(row, contender):
    for o in row["outcomes"]:
        if o["contender"] == contender:
            return o
    return None


def ratio_to_grappler(row, o):
    g = outcome(row, "grappler-swap")
    if o is None or o.get("seconds") is None or g is None or g["status"] != "ran" or not g["seconds"]:
        return None
    return o["seconds"] / g["seconds"]


def peak_cell(o, lb: int, short: bool = False) -> str:
    if o is None:
        return "\u2014"
    if o["status"] == "ran":
        fits = "fits" if o["fits"] else "**does not fit**"
        return f"{format_size(o['peak'])}, {fits}, {o['peak'] / lb:.2f}\u00d7"
    if o["status"] == "no plan":
        return "no plan" + ("" if short else f" ({o['note']})")
    if o["status"] == "not run":
        return "not run (time cap)"
    return f"error: {o['note']}"


def graph_facts(data) -> dict:
    return {g["label"]: g for g in data["graphs"]}


# ---------------------------------------------------------------- sections
def _header(data) -> list[str]:
    m = data["machine"]
    minutes = data["seconds"] / 60
    phases = ", ".join(f"{k} {v / 60:.1f}" for k, v in data["phases"].items())
    scaling = data.get("scaling_seconds")
    lines = [
        "# Benchmark results" + (" (quick smoke run)" if data["quick"] else ""),
        "",
        f"Made by `{data['command']}` (`make bench{'-quick' if data['quick'] else ''}`) on {data['date']}: "
        f"{m['cpu']} ({m['arch']}), {m['cores']} cores, {m['system']} {m['release']}, Python {m['python']}, "
        f"TensorFlow {m['tensorflow']}; no GPU. **{minutes:.1f} minutes in all** (minutes: {phases}"
        + (f"; the scaling searches took {scaling / 60:.1f} in "
           + ("a second process beside the main table" if data["jobs"] > 1 else "this process") if scaling else "")
        + "). " + _load_text(data),
        "",
    ]
    return lines


def _load_text(data) -> str:
    load = data.get("load")
    text = ("Other engineers' jobs may share the machine, so wall times are indicative; the times compared "
            "within a row are measured back to back.")
    if load:
        text = (f"Load average (1 min) {load[0]:.1f} at the start and {load[1]:.1f} at the end, on "
                f"{data['machine']['cores']} cores. " + text)
    return text


def _method(data) -> list[str]:
    return [
        "## How it is measured",
        "",
        "- **One judge for all.** Every contender's output graph is scored by Grappler's own estimate "
        "(`lmscli.grappler.estimate_peak`: the VirtualCluster's peak on a virtual V100-like GPU) plus the "
        "bytes that stay resident (variables, optimizer slots, constants), which Grappler does not count. "
        "For lms that is the check `api.tune` runs on the rewritten graph (`api.check_with_grappler`). "
        "A contender *fits* when that peak is at most the budget.",
        "- **Budgets** are plain GPU sizes without reserve: 16 GiB, 32 GiB, and 75%, 50% and 35% of the "
        "graph's no-swap peak (our simulator's, as `--gpu-mem 75%` means). A budget at or above the no-swap "
        "peak is one row, *fits without swapping*; a budget below the resident bytes is one row too (nothing "
        "can fit). Every other budget runs every contender, also below the lower bound.",
        "- **Contenders.** *original*: the graph as is. *Grappler SWAPPING_HEURISTICS / HEURISTICS*: "
        "`tf_optimizer.OptimizeGraph` with only the memory optimizer on (`memory_optimization` set, every "
        "other optimizer off, model pruning off, `min_graph_nodes = -1`), against a virtual cluster whose GPU "
        "has exactly the budget (built like `lmscli/grappler.py`'s). HEURISTICS adds recomputation (and "
        "scheduling) to swapping. *lms --strategy tflms*: `api.tune` with `TuneOptions(strategy='tflms')`. "
        "*lms*: `api.tune` with the defaults. Both lms contenders plan with `make_device(gpu_mem=budget, "
        "reserve=0)`.",
        "- **Grappler's swap nodes.** Grappler places both `_CopyFromGpuToHost` and `_CopyFromHostToGpu` on "
        "the GPU; the first one's output is allocated in host memory by its kernel. The CPU build of "
        "TensorFlow has no such kernels, so for the judge the pair becomes two Identity nodes, the swap-out "
        "on the host (where its output lives, as the judge sees an lms swap-out) and the swap-in on the GPU. "
        "Judged literally, with the swap-out's output on the GPU, Grappler's plans come out worse (figures "
        "in the headline notes).",
        "- **Lower bound** (`api.analyze`): at the binding instant, the inputs and outputs of the ops "
        "running then, every live tensor that cannot be swapped, and everything resident. No plan that only "
        "swaps goes below it in our simulator; recomputation can. Peaks are also given as a multiple of it. "
        "The judge is Grappler's estimate, not our simulator, so a judged peak can come out slightly below the "
        "bound (a multiple under 1.00\u00d7) where the two account a graph differently.",
        "- **Predicted step-time overhead** on NVLink 2.0 (150 GB/s per direction) and PCIe 3 (16 GB/s): our "
        "simulator with Grappler's op times (`api.with_link_predictions`). Grappler's swaps are replayed in "
        "the same simulator (each of its swap pairs as one swap-in group, triggered by the pair's control "
        "input); its recomputation is not in that model. *Swapped* is the bytes copied to the host; "
        "Grappler copies a tensor once per swap pair.",
        "- **Wall time** of each tool in this run: Grappler's optimizer call (cluster included); lms: "
        "`api.tune` (planning and its Grappler check) plus `api.rewrite`. The graph's preparation (shapes, "
        "Grappler's schedule) is done once per graph for all budgets and listed in the graph table. The "
        "ratio is to Grappler's SWAPPING_HEURISTICS run on the same row.",
        "- **Determinism.** Graphs, budgets, lms plans and the table layout are the same on every run. "
        "Grappler's memory optimizer is not deterministic: on the same input it can pick a different set of "
        "swaps from one process to the next (seen while building this benchmark on ResNet-50 7500\u00b2 at "
        "32 GiB: 18 or 19 swap pairs from one run to the next), so its rows can move a little between runs.",
        "",
    ]


def _headline(data) -> list[str]:
    rows = {(r["graph"], r["budget_label"]): r for r in data["rows"]}
    facts = graph_facts(data)
    lines = ["## Headline rows", "",
             "| graph | budget | contender | peak (Grappler) | fits | \u00d7 lower bound | swapped | overhead "
             "nvlink2 | overhead pcie3 | tool s | \u00d7 Grappler's time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for graph, budget in headline_rows(data["quick"]):
        row = rows.get((graph, budget))
        if row is None:
            continue
        g = facts[graph]
        lb = g["lower_bound"]
        head = f"{graph} (lower bound {format_size(lb)})"
        if row["kind"] != "swap":
            o = outcome(row, "original")
            what = "fits without swapping" if row["kind"] == "fits" else "below the resident bytes"
            lines.append(f"| {head} | {budget_text(row)} | all | {format_size(o['peak'])} | "
                         f"{'yes' if o['fits'] else 'no'} ({what}) | {o['peak'] / lb:.2f}\u00d7 | 0 B | | | | |")
            continue
        for c in CONTENDERS:
            o = outcome(row, c)
            if o is None:
                continue
            if o["status"] != "ran":
                lines.append(f"| {head} | {budget_text(row)} | {NAMES[c]} | {o['status']} | no | | | | | "
                             f"{sec(o.get('seconds'))} | {times(ratio_to_grappler(row, o))} |")
                continue
            lines.append(
                f"| {head} | {budget_text(row)} | {NAMES[c]} | {format_size(o['peak'])} | "
                f"{'yes' if o['fits'] else '**no**'} | {o['peak'] / lb:.2f}\u00d7 | {format_size(o['swapped'])} | "
                f"{pct(o['nvlink2'])} | {pct(o['pcie3'])} | {sec(o.get('seconds'))} | "
                f"{times(ratio_to_grappler(row, o)) if c != 'original' else ''} |")
            lit = o.get("extra", {}).get("literal_peak")
            if lit:
                notes.append(f"{NAMES[c]} on {graph} at {budget_text(row)}: {format_size(lit)} when its swap-out's "
                             f"output is judged on the GPU where Grappler placed the node "
                             f"({o['extra']['swap_pairs']} swap pair{'' if o['extra']['swap_pairs'] == 1 else 's'}).")
    lines.append("")
    for n in notes:
        lines.append(f"- {n}")
    if notes:
        lines.append("")
    return lines


def _graphs(data) -> list[str]:
    lines = ["## Graphs", "",
             "| graph | nodes | no-swap peak (simulated) | no-swap peak (Grappler) | lower bound | resident | "
             "generated s | prepare s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for g in data["graphs"]:
        lines.append(f"| {g['label']} | {g['nodes']:,} | {format_size(g['sim_peak'])} | {format_size(g['judged_peak'])} "
                     f"| {format_size(g['lower_bound'])} | {format_size(g['resident'])} | "
                     f"{sec(g['gen_s']) if g['gen_s'] else 'cached' if g['group'] != 'sample' else ''} | "
                     f"{sec(g['prepare_s'])} |")
    lines += ["", "Graphs of one model differ only in shape (ResNet-50: 5,028 nodes; 3D U-Net: 1,221, 4 levels, 8 "
              "base filters, the sample generator's defaults). *generated s* is 'cached' when bench/out/ "
              "already held the graph (from an earlier run, or written by the scaling searches running beside).", ""]
    return lines


def _peaks(data) -> list[str]:
    facts = graph_facts(data)
    lines = ["## Peak per Grappler on every graph and budget", "",
             "Each cell: judged peak, whether it fits, and the peak as a multiple of the graph's lower bound.", "",
             "| graph | budget | lower bound | original | Grappler swapping | Grappler heuristics | lms tflms | lms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        lb = facts[row["graph"]]["lower_bound"]
        o = outcome(row, "original")
        first = f"| {row['graph']} | {budget_text(row)} | {format_size(lb)} | "
        if row["kind"] == "fits":
            lines.append(first + f"{format_size(o['peak'])}, {o['peak'] / lb:.2f}{X}: fits without swapping | | | | |")
        elif row["kind"] == "below-resident":
            lines.append(first + f"{format_size(o['peak'])}: budget below the resident bytes "
                         f"({format_size(facts[row['graph']]['resident'])}), nothing fits | | | | |")
        else:
            cells = [peak_cell(outcome(row, c), lb, short=True) for c in CONTENDERS]
            lines.append(first + " | ".join(cells) + " |")
    lines += ["", "*no plan*: lms refused, either because the budget is below the lower bound or because no plan it "
              "found fits Grappler's estimate (the cost table gives the reason).", ""]
    return lines


def _costs(data) -> list[str]:
    lines = ["## Cost of each plan", "",
             "Rows where the contenders ran. *swapped*: bytes copied to the host; overheads: predicted step-time "
             "increase; *tool s*: wall time of the tool; the last column is that time over Grappler's "
             "SWAPPING_HEURISTICS run on the same row.", "",
             "| graph | budget | contender | fits | swapped | overhead nvlink2 | overhead pcie3 | tool s | "
             "\u00d7 Grappler's time | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in data["rows"]:
        if row["kind"] != "swap":
            continue
        for c in CONTENDERS[1:]:
            o = outcome(row, c)
            if o is None:
                continue
            if o["status"] == "ran":
                lines.append(f"| {row['graph']} | {budget_text(row)} | {SHORT[c]} | {'yes' if o['fits'] else '**no**'} "
                             f"| {format_size(o['swapped'])} | {pct(o['nvlink2'])} | {pct(o['pcie3'])} | "
                             f"{sec(o['seconds'])} | {times(ratio_to_grappler(row, o))} | {o['note']} |")
            else:
                lines.append(f"| {row['graph']} | {budget_text(row)} | {SHORT[c]} | {o['status']} | | | | "
                             f"{sec(o.get('seconds'))} | {times(ratio_to_grappler(row, o))} | {o['note']} |")
    lines.append("")
    return lines


def _scaling(data) -> list[str]:
    sc = data["scaling"]
    lines = ["## Scaling: the largest size that fits", "",
             "Each probe regenerates the graph at one size with the sample generator; fitting is judged as above "
             "(no swapping: Grappler's estimate of the original plus resident bytes within the budget). Sizes step "
             "by 250 px (ResNet-50 image size), 16 voxels (3D U-Net volume edge) or 1 (batch). Factors are over the "
             "largest size that fits without swapping, in the quantity searched (edge length or batch). "
             "*lower bound* is the largest size whose lower bound is within the budget: no swapping plan goes "
             "further. A range a\u2013b: a fits, the next size after b does not, and the sizes between were not "
             "tried (batch searches stop within 3%). \u2265 marks a search that stopped at its probe limit.", "",
             "| series | budget | no swapping | Grappler swapping | Grappler heuristics | lms tflms | lms | lower bound |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in SERIES_ORDER:
        if key not in sc:
            continue
        label, what = SERIES_LABEL[key]
        for budget, found in sc[key]["budgets"].items():
            base = found["noswap"][0]
            cells = []
            for w in SEARCHES:
                v, exact, hi = found[w][0], found[w][1], found[w][3]
                if v is None:
                    cells.append("none")
                    continue
                shown = _show(what, v)
                if exact and hi is not None and hi - sc[key]["step"] > v:
                    shown = f"{v}\u2013{_show(what, hi - sc[key]['step'])}"  # within the tolerance
                mark = "" if exact else "\u2265 "
                factor = f" ({v / base:.2f}\u00d7)" if base and w != "noswap" else ""
                cells.append(f"{mark}{shown}{factor}")
            lines.append(f"| {label} | {format_size(int(budget))} | " + " | ".join(cells) + " |")
    lines.append("")
    for key in SERIES_ORDER:
        if key in sc:
            c = sc[key]["counts"]
            lines.append(f"- {SERIES_LABEL[key][0]}: {c['generated']} graphs generated, {c['estimated']} Grappler "
                         f"estimates of an original, {c['prepared']} prepared for lms, {c['lms-runs']} lms runs, "
                         f"{c['grappler-runs']} Grappler optimizer runs; {sc[key]['seconds'] / 60:.1f} minutes.")
    lines += ["", _seed_claims(data), ""]
    return lines


def _show(what: str, v: int) -> str:
    if what == "resolution":
        return f"{v}\u00b2"
    if what == "volume":
        return f"{v}\u00b3"
    return f"{v}"


def _factor(data, key: str, contender: str):
    sc = data["scaling"].get(key)
    if not sc:
        return []
    out = []
    for budget, found in sc["budgets"].items():
        base, v = found["noswap"][0], found[contender][0]
        if base and v:
            out.append((int(budget), v / base))
    return out


def _seed_claims(data) -> str:
    parts = []
    for key, claim in (("resnet-res", "10\u00d7 resolution for 2D models"), ("unet-res", "5\u00d7 for 3D U-Net")):
        lms = _factor(data, key, "lms")
        lb = _factor(data, key, "lower-bound")
        if not lms:
            continue
        shown = ", ".join(f"{f:.2f}{X}" for _, f in lms)
        bound = ", ".join(f"{f:.2f}{X}" for _, f in lb)
        parts.append(f"{SERIES_LABEL[key][0]}: lms {shown} (lower bound {bound}) against the seeds' {claim}")
    if not parts:
        return ""
    budgets = sorted({int(b) for key in data["scaling"] for b in data["scaling"][key]["budgets"]})
    at = " and ".join(format_size(b) for b in budgets)
    return ("The seeds claim 10\u00d7 resolution for 2D models and 5\u00d7 for 3D U-Net with TFLMS v2 (on their models, "
            f"GPUs and baselines). Here, at {at}: " + "; ".join(parts) + ". What stops every swapping "
            "plan is the lower bound: the tensors one operation reads and writes at once grow with the image like "
            "the peak does, so swapping buys a constant factor in memory (the peak over the lower bound), about "
            "its square root in image edge and its cube root in volume edge.")


def _speed(data, plot_name: str) -> list[str]:
    lines = ["## Tool speed against graph size", "",
             "Synthetic graphs (a residual stack of dense+tanh blocks, `generate.synthetic(n)`), budget 75% of the "
             "no-swap peak, or halfway between the lower bound and the peak where the lower bound is above 75%. "
             "*analyze*: load + prepare (shapes, Grappler's schedule) + analyze; *tune*: `api.tune` "
             "with its Grappler check; *rewrite*: `api.rewrite`; Grappler's memory optimizer "
             "(SWAPPING_HEURISTICS) at the same budget for scale.", "",
             "| nodes | budget | analyze s | tune s | rewrite s | Grappler's optimizer s | lms plan |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in data["speed"]:
        lines.append(f"| {p['nodes']:,} | {p['share'] * 100:.0f}% | {sec(p['analyze_s'])} | {sec(p['tune_s'])} | "
                     f"{sec(p['rewrite_s'])} | {sec(p['grappler_s'])} | {p['outcome']} |")
    pts = [p for p in data["speed"] if p["analyze_s"] and p["tune_s"]]
    if len(pts) >= 2:
        a, b = pts[0], pts[-1]
        import math

        def slope(key):
            if not a[key] or not b[key]:
                return None
            return math.log(b[key] / a[key]) / math.log(b["nodes"] / a["nodes"])

        growth = ", ".join(f"{name} n^{s:.2f}" for name, s in (("analyze", slope("analyze_s")), ("tune", slope("tune_s")),
                                                             ("rewrite", slope("rewrite_s")),
                                                             ("Grappler's optimizer", slope("grappler_s")))
                           if s is not None)
        lines += ["", f"From {a['nodes']:,} to {b['nodes']:,} nodes the times grow about as {growth} "
                  "(log-log slope between the end points)."]
    lines += ["", f"![tool speed against graph size]({plot_name})", ""]
    return lines


def losses(data) -> tuple[list[str], str]:
    """Rows where another contender beats lms: (table lines, the sentence on wall time)."""
    lines = []
    slower = []
    for row in data["rows"]:
        if row["kind"] != "swap":
            continue
        lms = outcome(row, "lms")
        if lms is None:
            continue
        g = outcome(row, "grappler-swap")
        if lms["status"] == "ran" and g is not None and g["status"] == "ran" and g["seconds"]:
            slower.append(lms["seconds"] / g["seconds"])
        for c in ("grappler-swap", "grappler-heur", "tflms"):
            o = outcome(row, c)
            if o is None or o["status"] != "ran":
                continue
            lms_fits = lms["status"] == "ran" and lms["fits"]
            what, why = None, None
            if o["fits"] and not lms_fits:
                what = f"{SHORT[c]} fits ({format_size(o['peak'])}); lms does not"
                if lms["status"] == "no plan" and lms["note"] == "below the lower bound":
                    if o["extra"].get("recomputed"):
                        why = (f"the budget is below our lower bound, which counts swapping only; {SHORT[c]} "
                               f"recomputes ({o['extra']['recomputed']} nodes added), which lms does not do")
                    else:
                        why = ("the budget is below our lower bound, yet Grappler judges this plan within it: "
                               "the bound counts some tensors Grappler's estimate does not")
                else:
                    why = f"lms: {lms['status']}" + (f" ({lms['note']})" if lms.get("note") else "")
            elif o["fits"] and lms_fits:
                parts, gains = [], []
                if o["peak"] < lms["peak"] * (1 - PEAK_MARGIN):
                    parts.append(f"lower peak {format_size(o['peak'])} vs {format_size(lms['peak'])}")
                    gains.append("a lower peak")
                faster = [(link, o[link], lms[link]) for link in ("nvlink2", "pcie3")
                          if o[link] is not None and lms[link] is not None and o[link] + 0.001 < lms[link]]
                if faster:
                    parts.append("predicted faster on " + ", ".join(f"{k} ({pct(a)} vs {pct(b)})" for k, a, b in faster))
                    gains.append("a shorter predicted step")
                if parts:
                    more = (o["swapped"] or 0) - (lms["swapped"] or 0)
                    if more > 0:
                        why = (f"by design: lms keeps the fitting plan that swaps the fewest bytes; {SHORT[c]} swaps "
                               f"{format_size(more)} more, which buys {' and '.join(gains)}")
                    else:
                        why = (f"{SHORT[c]} swaps no more bytes ({format_size(o['swapped'])} vs "
                               f"{format_size(lms['swapped'])}) and still gets {' and '.join(gains)}: lms's choice "
                               "of tensors or swap-in triggers is worse here")
                    if faster and c.startswith("grappler") and o["extra"].get("recomputed"):
                        why += " (its recomputation is not in the step-time model)"
                    what = "; ".join(parts)
            if what:
                lines.append(f"| {row['graph']} | {budget_text(row)} | {SHORT[c]} | {what} | {why} |")
    sentence = ""
    if slower:
        n_slow = sum(1 for r in slower if r > 1)
        sentence = (f"**Wall time.** lms (tune with its Grappler check, plus rewrite) took longer than Grappler's "
                    f"optimizer on {n_slow} of {len(slower)} rows where both produced a graph "
                    f"(median {statistics.median(slower):.2f}\u00d7, "
                    f"range {min(slower):.2f}\u2013{max(slower):.2f}\u00d7): lms simulates many candidate plans, rewrites "
                    "the chosen one and has Grappler estimate it (one estimate costs about as much as Grappler's whole "
                    "optimizer run, which neither checks its result nor searches).")
    return lines, sentence


def scaling_losses(data) -> list[str]:
    lines = []
    for key in SERIES_ORDER:
        sc = data["scaling"].get(key)
        if not sc:
            continue
        label, what = SERIES_LABEL[key]
        for budget, found in sc["budgets"].items():
            lms = found["lms"]
            for c in ("grappler-swap", "grappler-heur", "tflms"):
                other = found[c]
                if other[0] is None or (lms[0] is not None and other[0] <= lms[0]):
                    continue
                if lms[3] is None or lms[3] > other[0]:
                    why = (f"not measured: lms was not tried at {_show(what, other[0])} (both searches stop "
                           "within the tolerance)")
                elif len(lms) > 4 and lms[4] == "judged over the budget":
                    why = f"at {_show(what, lms[3])} lms's plan is judged over the budget"
                elif len(lms) > 4 and lms[4]:
                    why = f"at {_show(what, lms[3])} {lms[4]}"
                else:
                    why = f"lms does not fit at {_show(what, lms[3])}"
                lines.append(f"| {label} | {format_size(int(budget))} | {SHORT[c]} | {_show(what, other[0])} | "
                             f"{_show(what, lms[0]) if lms[0] else 'none'} | {why} |")
    return lines


def _losses(data) -> list[str]:
    table, sentence = losses(data)
    lines = ["## Where lms loses", "",
             "Generated from the rows above: every row where another contender fits and lms does not, or both fit "
             "and the other has a lower peak (by more than 0.5%) or a lower predicted overhead (by more than 0.1 "
             "point). The rows stay in the tables.", ""]
    if table:
        lines += ["| graph | budget | contender | what | why |", "| --- | --- | --- | --- | --- |"] + table
    else:
        lines.append("No row.")
    scal = scaling_losses(data)
    if scal:
        lines += ["", "In the scaling searches, where another contender reaches a larger size than lms:", "",
                  "| series | budget | contender | reaches | lms reaches | why lms stops |",
                  "| --- | --- | --- | --- | --- | --- |"] + scal
    lines += ["", sentence, ""] if sentence else [""]
    return lines


# ---------------------------------------------------------------- plots
def plot_speed(data, path: Path) -> bool:
    pts = [p for p in data["speed"] if p["analyze_s"]]
    if len(pts) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for key, label, style in (("analyze_s", "analyze (load + prepare + analyze)", "o-"),
                              ("tune_s", "tune (with Grappler check)", "s-"),
                              ("rewrite_s", "rewrite", "^-"), ("grappler_s", "Grappler's memory optimizer", "x--")):
        xs = [p["nodes"] for p in pts if p[key]]
        ys = [p[key] for p in pts if p[key]]
        if xs:
            ax.plot(xs, ys, style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("graph nodes")
    ax.set_ylabel("seconds")
    ax.set_title("Tool speed against graph size (synthetic graphs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return True


def plot_peaks(data, path: Path) -> bool:
    rows = {(r["graph"], r["budget_label"]): r for r in data["rows"]}
    facts = graph_facts(data)
    chosen = [(g, b) for g, b in chart_rows(data["quick"]) if (g, b) in rows and rows[(g, b)]["kind"] == "swap"]
    if not chosen:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.4, 1.35 * len(chosen) + 2), 4.6), dpi=110)
    width = 0.16
    colors = {"original": "#999999", "grappler-swap": "#e69f00", "grappler-heur": "#d55e00", "tflms": "#56b4e9",
              "lms": "#0072b2"}
    for k, c in enumerate(CONTENDERS):
        xs, ys, hatches = [], [], []
        for i, key in enumerate(chosen):
            o = outcome(rows[key], c)
            lb = facts[key[0]]["lower_bound"]
            if o is None or o["status"] != "ran":
                continue
            xs.append(i + (k - 2) * width)
            ys.append(o["peak"] / lb)
            hatches.append(not o["fits"])
        for i, key in enumerate(chosen):
            o = outcome(rows[key], c)
            if o is not None and o["status"] != "ran":
                ax.text(i + (k - 2) * width, 0.05, o["status"], rotation=90, ha="center", va="bottom", fontsize=6)
        bars = ax.bar(xs, ys, width, label=SHORT[c], color=colors[c], edgecolor="black", linewidth=0.4)
        for bar, hatch in zip(bars, hatches):
            if hatch:
                bar.set_hatch("///")
    for i, key in enumerate(chosen):
        lb = facts[key[0]]["lower_bound"]
        ax.hlines(rows[key]["budget"] / lb, i - 2.6 * width, i + 2.6 * width, colors="black", linestyles="dashed",
                  linewidth=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(chosen)))
    ax.set_xticklabels([f"{g}\n{rows[(g, b)]['budget_label']}" for g, b in chosen], fontsize=7)
    ax.set_ylabel("peak per Grappler / lower bound")
    ax.set_title("Peak as a multiple of the lower bound (dashed: budget; hatched: does not fit)")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return True


# ---------------------------------------------------------------- all
def write(data, md_path: Path, plot_dir: Path) -> None:
    speed_png = plot_dir / "speed.png"
    peaks_png = plot_dir / "peak_vs_lower_bound.png"
    have_speed = plot_speed(data, speed_png)
    have_peaks = plot_peaks(data, peaks_png)
    rel = lambda p: p.name if p.parent == md_path.parent else str(p)  # noqa: E731
    lines = _header(data) + _headline(data)
    if have_peaks:
        lines += [f"![peak as a multiple of the lower bound, per contender]({rel(peaks_png)})", ""]
    lines += _losses(data) + _scaling(data) + _peaks(data) + _costs(data) + _graphs(data)
    lines += _speed(data, rel(speed_png)) if have_speed else []
    lines += _method(data)
    md_path.write_text("\n".join(lines).rstrip() + "\n")
