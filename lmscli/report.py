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
              f"({format_size(a.activation_peak_bytes)} tensors + {format_size(a.peak_bytes - a.activation_peak_bytes)} resident)")
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
