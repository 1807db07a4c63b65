"""``--report FILE.html``: one self-contained HTML page for people and CI artifacts.

:func:`render` takes plain data: the document ``--json`` prints (``lms.analysis``, ``lms.tune`` or
``lms.rewrite``) and the memory plot as SVG text, and returns the page. Inline CSS, inline SVG, no
scripts, no fonts or anything else fetched. Every string that comes from a graph is escaped.
"""

from __future__ import annotations

from html import escape

from lmscli import __version__
from lmscli.errors import InputError
from lmscli.report import parameters_line
from lmscli.units import format_flops, format_size

INLINE_LIST = 4  # consumers shown before the rest folds into <details>

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
 color:#1f2328;background:#fff;margin:0 auto;padding:24px 32px;max-width:1200px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.sub{color:#59636e;margin:0 0 16px}
table{border-collapse:collapse;margin:4px 0 8px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
table.kv th{width:240px}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;word-break:break-all}
.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}.warn{color:#9a6700}
.verdict{display:inline-block;padding:6px 12px;border-radius:6px;font-weight:600;margin:4px 0 8px}
.verdict.ok{background:#dafbe1;color:#116329}.verdict.bad{background:#ffebe9;color:#a40e26}
.plot{border:1px solid #d0d7de;border-radius:6px;padding:8px;background:#fff}
.plot svg{width:100%;height:auto;display:block}
details summary{cursor:pointer;color:#0969da}
footer{margin-top:32px;color:#59636e;font-size:12px}
"""


def _e(value) -> str:
    return escape("" if value is None else str(value), quote=True)


def _size(value) -> str:
    return _e(format_size(value)) if value is not None else "unknown"


def _pct(value) -> str:
    return f"{value * 100:.1f}%"


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _kv(rows) -> str:
    """A two-column table; values are HTML already (escaped by the caller)."""
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _table(headers, rows, numeric=()) -> str:
    head = "".join(f'<th class="num">{_e(h)}</th>' if i in numeric else f"<th>{_e(h)}</th>"
                   for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _code(name) -> str:
    return f"<code>{_e(name)}</code>"


def _names(names, levels) -> str:
    """Op names with their levels; past INLINE_LIST the rest folds into a <details>."""
    items = [_code(n) + (f" (L{levels[n]})" if n in levels else "") for n in names]
    if len(items) <= INLINE_LIST:
        return "<br>".join(items) or "-"
    shown, rest = items[:INLINE_LIST], items[INLINE_LIST:]
    return ("<br>".join(shown) + f"<details><summary>{len(rest)} more</summary>" + "<br>".join(rest) + "</details>")


def _plot(svg: str | None) -> str:
    if not svg:
        return "<p class=\"warn\">No plot: install matplotlib (<code>pip install 'lmscli[plot]'</code>).</p>"
    return f'<div class="plot">{svg}</div>'


def _top(items, title: str) -> str:
    if not items:
        return ""
    rows = [(_code(t["name"]), _e(t["type"]), _size(t["bytes"]) + (" (swap-in)" if t.get("swap_in") else ""))
            for t in items]
    return f"<h2>{_e(title)}</h2>" + _table(("tensor", "op", "size"), rows, numeric=(2,))


# ---------------------------------------------------------------- analysis
def _analysis(doc: dict, svg: str | None) -> str:
    edges = doc.get("edges", {})
    largest = doc.get("largest_op") or {}
    rows = [
        ("model", _e(doc.get("model"))), ("file", _code(doc.get("path"))), ("format", _e(doc.get("format"))),
        ("fetches", ", ".join(_code(f) for f in doc.get("fetches", ())) + f" (from {_e(doc.get('fetch_source'))})"),
        ("batch size", _e(doc.get("batch_size") if doc.get("batch_size") is not None else "as in the graph")),
        ("vertices", f"{doc['vertices']:,} ({doc['active_vertices']:,} run in a step)"),
        ("edges", f"{edges.get('total', 0):,} ({edges.get('data', 0):,} data, {edges.get('control', 0):,} control)"),
        ("levels", f"{doc['levels']:,} (categorized topological sort)"),
        ("learning parameters", _size(doc["parameter_bytes"])),
        ("all variables", _size(doc["variable_bytes"]) + " (with optimizer slots)"),
        ("largest operation", (_code(largest.get("name")) + f" ({_e(largest.get('type'))}) "
                               + _size(largest.get("bytes"))) if largest else "-"),
        ("peak memory, no swapping", f"<b>{_size(doc['peak_bytes'])}</b> ({_size(doc['activation_peak_bytes'])} tensors + "
                                     f"{_size(doc['peak_bytes'] - doc['activation_peak_bytes'])} resident)"),
        ("peak reached at", _code(doc.get("peak_op"))),
        ("lower bound with swapping", _size(doc["lower_bound_bytes"]) + f" (at {_code(doc.get('lower_bound_op'))})"),
        ("swappable tensors", f"{doc['swappable_tensors']:,} ({_size(doc['swappable_bytes'])})"),
        ("control flow", f"{doc.get('while_loops', 0)} while loop(s), {doc.get('conds', 0)} cond switch(es); at the "
                         f"peak {_size(doc.get('peak_in_branches', 0))} made in cond branches, "
                         f"{_size(doc.get('peak_in_loops', 0))} in while loops ("
                         f"{_size(doc.get('peak_in_host_stacks', 0))} in gradient stacks lms can keep on the host), "
                         f"{_size(doc.get('peak_from_calls', 0))} returned by function calls"),
        ("tensors of the step of unknown size", f"{doc.get('unknown_tensors', 0)}"),
    ]
    parts = [_notes(doc.get("notes", ())), "<h2>Graph</h2>", _kv(rows),
             "<h2>Memory over one step</h2>", _plot(svg),
             _top(doc.get("top_live_at_peak", ()), "Largest tensors live at the peak")]
    unknown = doc.get("largest_unknown") or ()
    if unknown:
        parts.append("<h2>Tensors of unknown size (largest known part first)</h2>")
        parts.append(_table(("tensor", "shape", "dtype"),
                            [(_code(u["name"]), _e(u["shape"]), _e(u["dtype"])) for u in unknown]))
    return "".join(parts)


def _notes(notes) -> str:
    return "".join(f'<p class="warn">note: {_e(n)}</p>' for n in notes)


# ---------------------------------------------------------------- plan
def _plan(doc: dict, svg: str | None) -> str:
    plan = doc["plan"]
    pred = plan.get("predicted", {})
    dev = plan.get("device", {})
    levels = doc.get("op_levels", {})
    budget = pred.get("budget_bytes", dev.get("budget_bytes"))
    fits = doc.get("fits", pred.get("peak_bytes", 0) <= (budget or 0))
    parts = [f'<div class="verdict {"ok" if fits else "bad"}">'
             f'{"fits" if fits else "does not fit"}: predicted peak {_size(pred.get("peak_bytes"))} '
             f'under a budget of {_size(budget)}</div>']
    if doc.get("max_batch_size") is not None:
        parts.append(f"<p>largest batch size that fits: <b>{_e(doc['max_batch_size'])}</b></p>")
    link_rate = dev.get("link_bytes_per_second")
    device_rows = [
        ("model", _e(plan.get("model"))),
        ("device", f"{_e(dev.get('name'))}: {_size(dev.get('gpu_mem_bytes'))} GPU, "
                   f"{dev.get('reserve', 0) * 100:.0f}% reserved"),
        ("budget", _size(budget)),
        ("link", f"{_e(dev.get('link'))}" + (f" ({link_rate / 1e9:.0f} GB/s per direction)" if link_rate else "")),
        ("host memory for swapped tensors", f"{_size(pred.get('host_peak_bytes'))} of {_size(dev.get('host_mem_bytes'))}"),
        ("strategy", _e(plan.get("strategy"))
         + (f" ({_e(parameters_line(plan['parameters']))})" if plan.get("parameters") else "")),
        ("swapping", "necessary" if doc.get("necessary", True) else "not necessary: the graph fits without it"),
        ("graph fingerprint", _code(plan.get("graph_sha256"))),
    ]
    parts += ["<h2>Device and budget</h2>", _kv(device_rows)]

    before, after = pred.get("peak_bytes_without_plan"), pred.get("peak_bytes")
    t0, t1 = pred.get("step_time_without_plan_s"), pred.get("step_time_s")
    memory_rows = [("simulated peak", _size(before), _size(after), _change(before, after))]
    grappler = plan.get("grappler") or {}
    if grappler.get("peak_bytes") is not None:
        verdict = '<span class="ok">fits</span>' if grappler.get("fits") else '<span class="bad">does not fit</span>'
        memory_rows.append(("Grappler's estimate", "-", f"{_size(grappler.get('peak_bytes'))} {verdict}", "-"))
    memory_rows.append(("swapped out / in", "-", f"{pred.get('swap_outs', 0)} / {pred.get('swap_ins', 0)} "
                        f"({_size(pred.get('swap_out_bytes'))} / {_size(pred.get('swap_in_bytes'))})", "-"))
    if plan.get("recomputes"):
        memory_rows.append(("recomputed", "-", f"{pred.get('recomputes', 0)} ({_size(pred.get('recompute_bytes'))}, "
                            f"{format_flops(pred.get('recompute_flops', 0))}, "
                            f"{_ms(pred.get('recompute_time_s', 0.0))} of GPU time)", "-"))
    on_host = [h for h in plan.get("host_stacks", ()) if not h.get("dropped")]
    dropped = [h for h in plan.get("host_stacks", ()) if h.get("dropped")]
    if on_host:
        memory_rows.append(("loop stacks on the host", "-", f"{len(on_host)} "
                            f"({_size(sum(h['bytes'] for h in on_host))} kept off the GPU, "
                            f"{_size(pred.get('stack_copy_bytes', 0) // 2)} copied each way)", "-"))
    if dropped:
        memory_rows.append(("accumulators dropped", "-", f"{len(dropped)} no op reads "
                            f"({_size(sum(h['bytes'] for h in dropped))} in all no longer held to their loops' ends)", "-"))
    if plan.get("serial_loops"):
        memory_rows.append(("serial loops", "-", f"{len(plan['serial_loops'])} while loop(s) run one iteration at "
                            "a time (parallel_iterations 1)", "-"))
    if t0 is not None and t1 is not None:
        memory_rows.append(("step time", _ms(t0), _ms(t1), _pct(pred.get("overhead", 0.0))))
    parts += ["<h2>Memory before and after</h2>",
              _table(("", "without the plan", "with the plan", "change"), memory_rows, numeric=(1, 2, 3))]
    per_link = pred.get("per_link") or {}
    if per_link:
        rows = [(_e(name), _ms(f["step_time_s"]), _pct(f["overhead"]), _size(f.get("peak_bytes")))
                for name, f in sorted(per_link.items())]
        parts += ["<h2>Predicted overhead per link</h2>",
                  _table(("link", "step time", "overhead", "peak"), rows, numeric=(1, 2, 3))]
    parts += ["<h2>Memory over one step</h2>", _plot(svg),
              _top(doc.get("top_live_at_peak", ()), "Largest tensors live at the peak, with the plan")]
    parts.append(_swaps(plan.get("swaps", ()), levels) if plan.get("swaps") or not plan.get("host_stacks") else "")
    if on_host:
        rows = [(_code(h["stack"]), _size(h["bytes"]), str(h["trips"]), _names(h["ops"], levels)) for h in on_host]
        parts.append(f"<h2>Gradient stacks kept on the host ({len(rows)})</h2>"
                     + _table(("stack", "kept per step", "iterations", "ops moved with it"), rows, numeric=(1, 2)))
    if dropped:
        rows = [(_code(h["stack"]), _size(h["bytes"]), str(h["trips"])) for h in dropped]
        parts.append(f"<h2>Loop accumulators no op reads, their pushes taken out ({len(rows)})</h2>"
                     + _table(("list", "no longer held to its loop's end", "iterations"), rows, numeric=(1, 2)))
    if plan.get("recomputes"):
        parts.append(_recomputes(plan["recomputes"], levels))
    chains = plan.get("serialize") or ()
    if chains:
        parts.append(f"<h2>Serialized chains ({len(chains)})</h2>")
        parts.append(_table(("#", "ops run one after another"),
                            [(str(i + 1), _names(chain, levels)) for i, chain in enumerate(chains)], numeric=(0,)))
    return "".join(parts)


def _change(a, b) -> str:
    if not a or b is None:
        return "-"
    return f"{(b - a) / a:+.1%}"


def _swaps(swaps, levels) -> str:
    if not swaps:
        return "<h2>Swapped tensors</h2><p>None: nothing is swapped.</p>"
    ordered = sorted(swaps, key=lambda s: (-s["bytes"], s["tensor"]))
    rows = []
    for i, s in enumerate(ordered, 1):
        producer = s["tensor"].rsplit(":", 1)[0]
        swap_ins = "<hr>".join(
            _names(g["consumers"], levels) + f"<br>trigger {_code(g['trigger'])}"
            + (f" (L{levels[g['trigger']]})" if g["trigger"] in levels else "")
            for g in s.get("swap_ins", ()))
        rows.append((str(i), _code(s["tensor"]), _size(s["bytes"]),
                     f"L{levels[producer]}" if producer in levels else "-",
                     _names(s.get("near", ()), levels), swap_ins or "-"))
    total = sum(s["bytes"] for s in swaps)
    return (f"<h2>Swapped tensors ({len(swaps)}, {_size(total)}, largest first)</h2>"
            + _table(("#", "tensor", "size", "produced at", "near consumers (GPU copy)",
                      "swap-in consumers and trigger (level)"), rows, numeric=(0, 2)))


def _recomputes(recomputes, levels) -> str:
    ordered = sorted(recomputes, key=lambda r: (-r["bytes"], r["tensor"]))
    rows = []
    for i, r in enumerate(ordered, 1):
        producer = r["tensor"].rsplit(":", 1)[0]
        groups = "<hr>".join(
            _names(g["consumers"], levels) + f"<br>after {_code(g['trigger'])}"
            + (f" (L{levels[g['trigger']]})" if g["trigger"] in levels else "")
            for g in r.get("groups", ()))
        rows.append((str(i), _code(r["tensor"]), _size(r["bytes"]),
                     f"L{levels[producer]}" if producer in levels else "-",
                     _names(r.get("ops", ()), levels), groups or "-"))
    total = sum(r["bytes"] for r in recomputes)
    return (f"<h2>Recomputed tensors ({len(recomputes)}, {_size(total)}, largest first)</h2>"
            + _table(("#", "tensor", "size", "produced at", "ops cloned", "consumers of the clone, and the op "
                      "the clones run after"), rows, numeric=(0, 2)))


# ---------------------------------------------------------------- rewrite
def _rewrite(doc: dict, svg: str | None) -> str:
    rows = [
        ("output", _code(doc.get("output")) if doc.get("output") else "none (dry run)"),
        ("format", _e(doc.get("format") or "-")),
        ("added operations", f"{doc['swap_outs'] + doc['swap_ins']} ({doc['swap_outs']} swap-out, "
                             f"{doc['swap_ins']} swap-in)"),
        ("bytes swapped out / in", f"{_size(doc['swap_out_bytes'])} / {_size(doc['swap_in_bytes'])}"),
        ("recomputations", f"{doc.get('recomputes', 0)} ({_size(doc.get('recompute_bytes', 0))})"),
        ("control edges added", str(doc.get("control_edges", 0))),
    ]
    if doc.get("tensorboard_event_file"):
        rows.append(("TensorBoard event file", _code(doc["tensorboard_event_file"])))
    return "<h2>Rewrite</h2>" + _kv(rows) + _plan(doc, svg)


TITLES = {"lms.analysis": "analysis", "lms.tune": "plan", "lms.rewrite": "rewrite"}


def render(doc: dict, svg: str | None = None) -> str:
    """The HTML page for ``doc`` (an ``lms.analysis``, ``lms.tune`` or ``lms.rewrite`` document)."""
    schema = doc.get("schema")
    if schema == "lms.analysis":
        model, body = doc.get("model"), _analysis(doc, svg)
    elif schema == "lms.tune":
        model, body = doc["plan"].get("model"), _plan(doc, svg)
    elif schema == "lms.rewrite":
        model, body = doc["plan"].get("model"), _rewrite(doc, svg)
    else:
        raise InputError(f"no HTML report for a {schema!r} document (expected lms.analysis, lms.tune or lms.rewrite)")
    title = f"lms {TITLES[schema]}: {model}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{_e(title)}</h1><p class=\"sub\">{_e(schema)} version {_e(doc.get('version'))}, "
            f"written by lms {_e(__version__)}</p>{body}"
            f"<footer>Simulated figures for one step; sizes in binary units (KiB, MiB, GiB).</footer>"
            "</body></html>\n")
