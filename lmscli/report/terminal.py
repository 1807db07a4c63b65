"""Rendering for people: Rich tables, a terminal memory chart and ``[LMS]`` log lines.

Nothing here computes a figure; :func:`plan_details` only names what the simulator found (the
largest tensors at the peak, the levels of the ops a plan names) for the terminal, ``--json``
and ``--report``.
"""

from __future__ import annotations

from typing import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from lmscli.report import parameters_line, termchart
from lmscli.device import NO_BUDGET
from lmscli.units import format_flops, format_size

CHART_STYLES = {"main": "blue", "over": "bold red", "behind": "grey50", "budget": "red", "axis": "dim", "label": ""}
CHART_MAX_WIDTH = 100
TOP_ROWS = 8


def plan_details(prepared, result, limit: int = 10) -> dict:
    """Plain data for the reports of a plan: ``top_live_at_peak`` (the largest tensors live at the
    peak with the plan) and ``op_levels`` (the level of every op the plan names)."""
    sched, view = prepared.schedule, prepared.view
    if result.device:  # on several GPUs: the schedule of the GPU the result was simulated for
        sched = next(s for s in prepared.schedules if s.device == result.device)
    if result.plan.host_stacks:  # the schedule the plan was simulated on: its stacks' tensors left out
        from lmscli.plan.document import simulated

        sched = simulated(result.plan, sched, view)[0]
    named = set()
    for swap in result.plan.swaps:
        named.add(swap.tensor.rsplit(":", 1)[0])
        named.update(swap.near)
        named.update(swap.waiters)
        for group in swap.swap_ins:
            named.update(group.consumers)
            named.add(group.trigger)
    for rec in result.plan.recomputes:
        named.add(rec.tensor.rsplit(":", 1)[0])
        for group in rec.groups:
            named.update(group.consumers)
            named.add(group.trigger)
    for chain in result.plan.serialize:
        named.update(chain)
    top = []
    for kind, tid, num_bytes in result.result.live_at_peak[:limit]:
        t = sched.tensors[tid]
        top.append({"name": sched.label(t.id), "type": sched.ops[t.producer],
                    "bytes": num_bytes, "swap_in": kind == "swapin"})
    return {"top_live_at_peak": top,
            "op_levels": {name: view.levels[view.index[name]] for name in sorted(named) if name in view.index}}


def render_chart(console: Console, title: str, main, behind=None, budget: int | None = None) -> None:
    """A compact memory-over-time chart (``termchart.Series`` curves), as wide as the console allows."""
    width = min(console.width, CHART_MAX_WIDTH)
    rows = termchart.chart(main, width, behind=behind, budget=budget)
    if not rows:
        return
    console.print(Text(title, style="bold"))
    for row in rows + [termchart.legend(main, behind, budget)]:
        console.print(Text.assemble(*((text, CHART_STYLES[kind]) for text, kind in row)), no_wrap=True,
                      overflow="crop")


def _series(label: str, sim) -> termchart.Series:
    return termchart.Series(label, sim.curve, sim.resident_bytes)


def _top_table(title: str, items) -> Table:
    top = Table(title=title, title_justify="left")
    top.add_column("tensor", overflow="fold")
    top.add_column("op")
    top.add_column("size", justify="right")
    for item in items[:TOP_ROWS]:
        size = format_size(item["bytes"]) + (" (swap-in)" if item.get("swap_in") else "")
        top.add_row(Text(item["name"]), Text(item["type"]), size)
    return top


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    return table


def render_analysis(console: Console, a, baseline=None) -> None:
    """The analysis as a summary table, a memory chart (given the no-swap ``baseline`` SimResult),
    the largest consumers at the peak, and unknown tensors."""
    for note in a.notes:
        console.print(f"[yellow]note:[/] {note}")
    t = _table(f"{a.model} ({a.format})")
    t.add_row("fetches", f"{', '.join(a.fetches[:4])}{' ...' if len(a.fetches) > 4 else ''} (from {a.fetch_source})")
    if a.batch_size is not None:
        t.add_row("batch size", str(a.batch_size))
    t.add_row("vertices", f"{a.vertices:,} ({a.active_vertices:,} run in a step)")
    t.add_row("edges", f"{a.edges:,} ({a.data_edges:,} data, {a.control_edges:,} control)")
    t.add_row("levels", f"{a.levels:,} (categorized topological sort)")
    t.add_row("learning parameters", format_size(a.parameter_bytes))
    t.add_row("all variables", f"{format_size(a.variable_bytes)} (with optimizer slots)")
    if a.constant_bytes:
        t.add_row("constants", format_size(a.constant_bytes))
    if a.largest_op:
        t.add_row("largest operation", f"{a.largest_op.name} ({a.largest_op.type}) {format_size(a.largest_op.bytes)}")
    t.add_row("peak memory, no swapping", f"[bold]{format_size(a.peak_bytes)}[/] "
              f"({format_size(a.activation_peak_bytes)} tensors + "
              f"{format_size(a.peak_bytes - a.activation_peak_bytes)} resident)")
    if a.run_peak_bytes is not None:
        t.add_row("as TensorFlow runs it", f"{format_size(a.run_peak_bytes)} (after Grappler's optimizations)")
    if a.grappler_model_peak_bytes is not None:
        t.add_row("Grappler's accounting", f"{format_size(a.grappler_model_peak_bytes)} (every output a tensor of its "
                  "own; a static estimate's view)")
    if a.peak_op:
        t.add_row("peak reached at", a.peak_op)
    t.add_row("lower bound with swapping", f"{format_size(a.lower_bound_bytes)} (at {a.lower_bound_op}"
              + (", with the loops' gradient stacks on the host)" if a.host_stacks else ")"))
    t.add_row("swappable tensors", f"{a.swappable_tensors:,} ({format_size(a.swappable_bytes)})")
    if a.while_loops or a.conds:
        t.add_row("control flow", f"{a.while_loops} while loop(s), {a.conds} cond switch(es)")
    if a.while_loops or a.conds or a.peak_from_calls:
        t.add_row("at the peak", f"{format_size(a.peak_in_branches)} made in cond branches (swapped there), "
                  f"{format_size(a.peak_in_loops)} in while loops ("
                  + (f"{format_size(a.peak_in_host_stacks)} of it in gradient stacks lms can keep on the host, "
                     "the rest not swapped), " if a.peak_in_host_stacks else "not swapped), ")
                  + f"{format_size(a.peak_from_calls)} returned by function calls (their bodies not counted)")
    if a.unread_accumulators:
        t.add_row("unread accumulators", f"{a.unread_accumulators} loop accumulator(s) no op reads, "
                  f"{format_size(a.unread_accumulator_bytes)} in all, each held to its loop's end, not all at once "
                  "(a rewrite takes out their pushes)")
    if a.unknown_tensors:
        t.add_row("unknown sizes",
                  f"[yellow]{a.unknown_tensors} tensor(s) of the step with unknown shape (counted as 0 bytes)[/]")
    console.print(t)
    if baseline is not None:
        render_chart(console, "Memory over one step (simulated)",
                     _series(f"no swapping (peak {format_size(baseline.peak_bytes)})", baseline))
    if a.top_live_at_peak:
        items = [{"name": i.name, "type": i.type, "bytes": i.bytes} for i in a.top_live_at_peak]
        console.print(_top_table("Largest tensors live at the peak", items))
    if a.largest_unknown:
        unk = Table(title="Tensors of unknown size (largest known part first)", title_justify="left")
        unk.add_column("tensor", overflow="fold")
        unk.add_column("shape")
        unk.add_column("dtype")
        for u in a.largest_unknown:
            unk.add_row(u.name, u.shape, u.dtype)
        console.print(unk)
        if a.batch_size is None and a.unknown_batch:  # (else the sizes depend on the data, not the batch)
            console.print("[yellow]hint:[/] give --batch-size N to fix unknown batch dimensions")


def analysis_log_lines(a) -> Iterable[str]:
    """The facts as the ``[LMS]`` lines TFLMS users know."""
    yield f"[LMS] The graph has {a.vertices} vertices and {a.edges} edges."
    yield f"[LMS] The graph has {a.parameter_bytes / (1 << 20):.2f} MiB of learning parameters."
    if a.largest_op:
        yield f"[LMS] The largest operation is {a.largest_op.name} consuming {format_size(a.largest_op.bytes)}"
    yield f"[LMS] Original categorized topological sort has {a.levels} levels"
    yield f"[LMS] Simulated peak memory without swapping: {format_size(a.peak_bytes)}"
    yield f"[LMS] No swap plan can go below {format_size(a.lower_bound_bytes)}"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _unbounded(plan) -> bool:
    """Manual TFLMS parameters: the plan was applied as given, with no budget to meet."""
    return plan.device.get("gpu_mem_bytes", 0) >= NO_BUDGET


def render_tune(console: Console, result, details: dict | None = None) -> None:
    """The chosen plan: device, budget, memory before and after (a table and a chart), traffic,
    predicted overhead per link, the largest tensors at the peak and the swapped tensors with their
    levels (``details`` from :func:`plan_details`)."""
    plan = result.plan
    pred = plan.predicted
    dev = plan.device
    t = _table(f"Plan for {plan.model} ({plan.strategy} strategy)")
    budget = None if _unbounded(plan) else result.budget
    gpu = f"{format_size(dev['gpu_mem_bytes'])} GPU, {dev['reserve'] * 100:.0f}% reserved, " if budget else "GPU, "
    t.add_row("device", f"{gpu}link {dev['link']} ({dev['link_bytes_per_second'] / 1e9:.0f} GB/s per direction)")
    t.add_row("budget", format_size(budget) if budget else "none: TFLMS parameters applied as given")
    t.add_row("peak without swapping", format_size(pred["peak_bytes_without_plan"]))
    verdict = "[green]fits[/]" if result.fits else "[red]does not fit[/]"
    if result.judge == "grappler":
        verdict = "over, in the original op order; the plan's control edges reorder the step: see Grappler's estimate"
    run = pred.get("run_peak_bytes")
    real = pred.get("stand_in")
    if real:  # judged by real runs on the stand-in
        t.add_row("judged on the stand-in", _stand_in_line(real))
        t.add_row("predicted peak with plan", f"[bold]{format_size(pred['peak_bytes'])}[/] (the graph as written, in "
                  "the original's observed order: what the plan was made with; the runs above decide)")
    elif run is not None:  # the executor judge: the graph the Session runs, after Grappler's optimizations
        t.add_row("predicted peak with plan", f"[bold]{format_size(run)}[/] ({verdict}; the graph TensorFlow runs, "
                  f"optimized; {format_size(pred['peak_bytes'])} as written)")
    else:
        t.add_row("predicted peak with plan", f"[bold]{format_size(pred['peak_bytes'])}[/] ({verdict})")
    if plan.grappler.get("peak_bytes") is not None:
        g = plan.grappler
        ok = "[green]fits[/]" if g.get("fits") else "[red]does not fit[/]"
        second = "; a second opinion" if run is not None else ""
        t.add_row("Grappler's estimate", f"{format_size(g['peak_bytes'])} ({ok}; {g.get('rounds', 1)} round(s){second})")
    if getattr(result, "time_limited", False):
        t.add_row("time limit", "[yellow]reached: the best fitting plan found by then; more time may swap less[/]")
    if plan.grappler.get("left_alone"):
        t.add_row("left unswapped", f"{len(plan.grappler['left_alone'])} tensor(s) where a swap node would change what "
                  "Grappler's optimizations do (bit-identity)")
    if not result.necessary:
        t.add_row("swapping", "not necessary: the graph fits without it")
    t.add_row("swap-outs", f"{pred['swap_outs']} ({format_size(pred['swap_out_bytes'])})")
    t.add_row("swap-ins", f"{pred['swap_ins']} ({format_size(pred['swap_in_bytes'])})")
    if plan.recomputes:
        t.add_row("recomputations", f"{pred.get('recomputes', 0)} ({format_size(pred.get('recompute_bytes', 0))} made "
                  f"again by {sum(len(r.ops) * len(r.groups) for r in plan.recomputes)} cloned op(s), "
                  f"{format_flops(pred.get('recompute_flops', 0))}, "
                  f"{pred.get('recompute_time_s', 0.0) * 1e3:.3f} ms of GPU time)")
    if plan.on_host:
        t.add_row("loop stacks on the host", f"{len(plan.on_host)} gradient stack(s) of while loops "
                  f"({format_size(sum(h.bytes for h in plan.on_host))} kept off the GPU; their pushes and pops "
                  f"copy {format_size(pred.get('stack_copy_bytes', 0) // 2)} each way per step)")
    if plan.dropped:
        t.add_row("accumulators dropped", f"{len(plan.dropped)} loop accumulator(s) no op reads, their pushes taken "
                  f"out ({format_size(sum(h.bytes for h in plan.dropped))} in all no longer held to their loops' ends, "
                  "nothing copied)")
    if plan.serial_loops:
        parallel = pred.get("peak_bytes_with_parallel_loops")
        t.add_row("serial loops", f"{len(plan.serial_loops)} while loop(s) run one iteration at a time "
                  "(parallel_iterations 1, as the prediction counts them; --keep-loop-parallelism leaves them)"
                  + (f"; the graph as written, its iterations running at once as the stand-in's traced steps "
                     f"showed, needs {format_size(parallel)}" if parallel else ""))
    held = f"{format_size(pred['host_peak_bytes'])} at most at once"
    if plan.on_host:  # (QA: 11.25 MiB pinned beside 16.88 MiB of stacks read as a contradiction)
        held += " (each stack or swapped tensor from its first copy out to its last copy back)"
    t.add_row("host memory (pinned)", held)
    if pred["host_peak_bytes"] > dev["host_mem_bytes"]:
        t.add_row("", f"[yellow]warning: more than --host-mem {format_size(dev['host_mem_bytes'])}[/]")
    t.add_row("predicted step time", f"{pred['step_time_without_plan_s'] * 1e3:.2f} ms -> {pred['step_time_s'] * 1e3:.2f} ms "
              f"(overhead {_pct(pred['overhead'])})")
    for name, figures in sorted(pred.get("per_link", {}).items()):
        t.add_row(f"  on {name}", f"{figures['step_time_s'] * 1e3:.2f} ms (overhead {_pct(figures['overhead'])}, "
                  f"peak {format_size(figures['peak_bytes'])})")
    if plan.parameters:
        t.add_row("parameters", parameters_line(plan.parameters))
    console.print(t)
    details = details or {}
    if plan.changes:
        render_chart(console, "Memory over one step (simulated)",
                     _series(f"with lms (peak {format_size(result.result.peak_bytes)})", result.result),
                     _series(f"without (peak {format_size(result.baseline.peak_bytes)})", result.baseline), budget)
    else:
        render_chart(console, "Memory over one step (simulated)",
                     _series(f"no swapping (peak {format_size(result.baseline.peak_bytes)})", result.baseline),
                     budget=budget)
    if details.get("top_live_at_peak"):
        console.print(_top_table("Largest tensors live at the peak, with the plan", details["top_live_at_peak"]))
    if plan.swaps:
        console.print(_swap_table(plan, details.get("op_levels", {})))
    if plan.recomputes:
        console.print(_recompute_table(plan, details.get("op_levels", {})))


def _recompute_table(plan, levels: dict, limit: int = 15) -> Table:
    """Recomputed tensors, largest first: size, the ops cloned, and the levels of the producer, of
    the op the clones wait for (named under the tensor) and of the ops reading the clone."""
    table = Table(title=f"Recomputed tensors ({len(plan.recomputes)}, largest first; ↳ the op the clones wait for)",
                  title_justify="left")
    table.add_column("tensor", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("ops cloned", overflow="fold")
    table.add_column("levels", no_wrap=True)
    for rec in sorted(plan.recomputes, key=lambda r: (-r.bytes, r.tensor))[:limit]:
        producer = rec.tensor.rsplit(":", 1)[0]
        cell = Text(rec.tensor)
        for g in rec.groups:
            cell.append(f"\n↳{g.trigger}", style="dim")
        steps = [f"made  {_levels([producer], levels)}",
                 "again " + ", ".join(_levels([g.trigger], levels) for g in rec.groups),
                 "read  " + ", ".join(_levels(g.consumers, levels) for g in rec.groups)]
        table.add_row(cell, format_size(rec.bytes), str(len(rec.ops)), "\n".join(steps))
    if len(plan.recomputes) > limit:
        table.caption = f"... and {len(plan.recomputes) - limit} more (see --plan-out or --report)"
    return table


def _levels(names, levels: dict) -> str:
    known = sorted({levels[n] for n in names if n in levels})
    if not known:
        return "-"
    return f"L{known[0]}" if len(known) == 1 else f"L{known[0]}-{known[-1]}"


def _swap_table(plan, levels: dict, limit: int = 15) -> Table:
    """Swapped tensors, largest first: size, and the levels of the producer, of the op whose end
    starts each swap-in (its trigger, named under the tensor) and of the ops reading it back."""
    table = Table(title=f"Swapped tensors ({len(plan.swaps)}, largest first; ↳ swap-in trigger)",
                  title_justify="left")
    table.add_column("tensor", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("levels", no_wrap=True)
    for swap in sorted(plan.swaps, key=lambda s: (-s.bytes, s.tensor))[:limit]:
        producer = swap.tensor.rsplit(":", 1)[0]
        cell = Text(swap.tensor)
        for g in swap.swap_ins:
            cell.append(f"\n↳{g.trigger}", style="dim")
        steps = [f"made  {_levels([producer], levels)}"]
        if swap.swap_ins:
            steps.append("start " + ", ".join(_levels([g.trigger], levels) for g in swap.swap_ins))
            steps.append("read  " + ", ".join(_levels(g.consumers, levels) for g in swap.swap_ins))
        table.add_row(cell, format_size(swap.bytes), "\n".join(steps))
    if len(plan.swaps) > limit:
        table.caption = f"... and {len(plan.swaps) - limit} more (see --plan-out or --report)"
    return table


def _stand_in_line(real: dict) -> str:
    """The stand-in judge's runs in words."""
    limit = format_size(real["limit_bytes"]) if real.get("limit_bytes") else "no limit"
    runs = f"{real['runs']} run(s) of {real['steps']} step(s) under {limit}"
    if real.get("headroom_limit_bytes"):  # the judge's runs under its tighter limit first, then under the limit
        from lmscli.plan.judge import STAND_IN_JUDGE_RUNS

        first = min(real["runs"], real.get("runs_per_limit", STAND_IN_JUDGE_RUNS))
        runs = (f"{first} run(s) of {real['steps']} step(s) under {format_size(real['headroom_limit_bytes'])}"
                + (f" and {real['runs'] - first} under {limit}" if real["runs"] > first else ""))
    if real.get("feeds"):  # (--feed: prove it with the same values)
        from lmscli.graph.fed import shown

        runs += " fed " + ", ".join(f"{name}={shown(v)}" for name, v in sorted(real["feeds"].items()))
    if real["fits"]:
        peak = real.get("peak_in_use_bytes")
        return f"{runs}: trained" + (f", allocator peak {format_size(peak)} in use under {limit}" if peak else "")
    return f"{runs}: {real.get('failure') or 'out of memory'}"


def tune_log_lines(result) -> Iterable[str]:
    yield from result.log
    pred = result.plan.predicted
    if pred.get("stand_in"):
        yield f"[LMS] Judged on the stand-in GPU: {_stand_in_line(pred['stand_in'])}"
        yield f"[LMS] Predicted peak {format_size(pred['peak_bytes'])} as written; overhead {_pct(pred['overhead'])}"
        return
    budget = ("with no budget (TFLMS parameters given)" if _unbounded(result.plan) else
              f"under a budget of {format_size(result.budget)}")
    peak, written = format_size(pred["peak_bytes"]), ""
    if pred.get("run_peak_bytes") is not None:  # the judge's figure: the graph TensorFlow runs, optimized
        peak, written = format_size(pred["run_peak_bytes"]), f" (the graph TensorFlow runs; {peak} as written)"
    yield f"[LMS] Predicted peak {peak} {budget}{written}; overhead {_pct(pred['overhead'])}"


def render_rewrite(console: Console, report, output: str | None, dry_run: bool, event_file: str | None = None) -> None:
    line = report.summary()
    if report.control_edges:
        line += f", {report.control_edges} control edge(s)"
    console.print(("[bold]dry run:[/] would write " if dry_run else "wrote ") + escape(output or ""))
    console.print(Text(line))
    if event_file:
        console.print(Text(f"TensorBoard event file: {event_file}"))
