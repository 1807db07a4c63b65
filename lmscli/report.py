"""Rendering for people: Rich tables and ``[LMS]`` log lines. Nothing here computes a figure."""

from __future__ import annotations

from typing import Iterable

from rich.console import Console
from rich.table import Table

from lmscli.units import format_size


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    return table


def render_analysis(console: Console, a) -> None:
    """The analysis as a summary table, the largest consumers at the peak, and unknown tensors."""
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
    if a.peak_op:
        t.add_row("peak reached at", a.peak_op)
    t.add_row("lower bound with swapping", f"{format_size(a.lower_bound_bytes)} (at {a.lower_bound_op})")
    t.add_row("swappable tensors", f"{a.swappable_tensors:,} ({format_size(a.swappable_bytes)})")
    if a.while_loops or a.conds:
        t.add_row("control flow", f"{a.while_loops} while loop(s), {a.conds} cond switch(es)")
    if a.unknown_tensors:
        t.add_row("unknown sizes", f"[yellow]{a.unknown_tensors} tensor(s) with unknown shape (counted as 0 bytes)[/]")
    console.print(t)
    if a.top_live_at_peak:
        top = Table(title="Largest tensors live at the peak", title_justify="left")
        top.add_column("tensor", overflow="fold")
        top.add_column("op")
        top.add_column("size", justify="right")
        for item in a.top_live_at_peak:
            top.add_row(item.name, item.type, format_size(item.bytes))
        console.print(top)
    if a.largest_unknown:
        unk = Table(title="Tensors of unknown size (largest known part first)", title_justify="left")
        unk.add_column("tensor", overflow="fold")
        unk.add_column("shape")
        unk.add_column("dtype")
        for u in a.largest_unknown:
            unk.add_row(u.name, u.shape, u.dtype)
        console.print(unk)
        if a.batch_size is None:
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


def render_tune(console: Console, result, analysis=None) -> None:
    """The chosen plan: device, budget, memory before and after, traffic, predicted overhead."""
    plan = result.plan
    pred = plan.predicted
    dev = plan.device
    t = _table(f"Plan for {plan.model} ({plan.strategy} strategy)")
    t.add_row("device", f"{format_size(dev['gpu_mem_bytes'])} GPU, {dev['reserve'] * 100:.0f}% reserved, "
              f"link {dev['link']} ({dev['link_bytes_per_second'] / 1e9:.0f} GB/s per direction)")
    t.add_row("budget", format_size(result.budget))
    t.add_row("peak without swapping", format_size(pred["peak_bytes_without_plan"]))
    verdict = "[green]fits[/]" if result.fits else "[red]does not fit[/]"
    t.add_row("predicted peak with plan", f"[bold]{format_size(pred['peak_bytes'])}[/] ({verdict})")
    if plan.grappler:
        g = plan.grappler
        ok = "[green]fits[/]" if g.get("fits") else "[red]does not fit[/]"
        t.add_row("Grappler's estimate", f"{format_size(g['peak_bytes'])} ({ok}; {g.get('rounds', 1)} round(s))")
    if not result.necessary:
        t.add_row("swapping", "not necessary: the graph fits without it")
    t.add_row("swap-outs", f"{pred['swap_outs']} ({format_size(pred['swap_out_bytes'])})")
    t.add_row("swap-ins", f"{pred['swap_ins']} ({format_size(pred['swap_in_bytes'])})")
    t.add_row("host memory (pinned)", format_size(pred["host_peak_bytes"]))
    if pred["host_peak_bytes"] > dev["host_mem_bytes"]:
        t.add_row("", f"[yellow]warning: more than --host-mem {format_size(dev['host_mem_bytes'])}[/]")
    t.add_row("predicted step time", f"{pred['step_time_without_plan_s'] * 1e3:.2f} ms -> {pred['step_time_s'] * 1e3:.2f} ms "
              f"(overhead {_pct(pred['overhead'])})")
    for name, figures in sorted(pred.get("per_link", {}).items()):
        t.add_row(f"  on {name}", f"{figures['step_time_s'] * 1e3:.2f} ms (overhead {_pct(figures['overhead'])})")
    if plan.parameters:
        t.add_row("parameters", ", ".join(f"{k} {v}" for k, v in plan.parameters.items()))
    console.print(t)
    if plan.swaps:
        table = Table(title=f"Swapped tensors ({len(plan.swaps)}, largest first)", title_justify="left")
        table.add_column("tensor", overflow="fold")
        table.add_column("size", justify="right")
        table.add_column("near", justify="right")
        table.add_column("swap-ins", justify="right")
        table.add_column("trigger", overflow="fold")
        for swap in sorted(plan.swaps, key=lambda s: (-s.bytes, s.tensor))[:15]:
            table.add_row(swap.tensor, format_size(swap.bytes), str(len(swap.near)), str(len(swap.swap_ins)),
                          swap.swap_ins[0].trigger if swap.swap_ins else "")
        if len(plan.swaps) > 15:
            table.caption = f"... and {len(plan.swaps) - 15} more (see --plan-out)"
        console.print(table)


def tune_log_lines(result) -> Iterable[str]:
    yield from result.log
    pred = result.plan.predicted
    yield (f"[LMS] Predicted peak {format_size(pred['peak_bytes'])} under a budget of "
           f"{format_size(result.budget)}; overhead {_pct(pred['overhead'])}")


def render_rewrite(console: Console, report, output: str | None, dry_run: bool) -> None:
    line = report.summary()
    if report.control_edges:
        line += f", {report.control_edges} control edge(s)"
    console.print(("[bold]dry run:[/] would write " if dry_run else "wrote ") + (output or ""))
    console.print(line)
