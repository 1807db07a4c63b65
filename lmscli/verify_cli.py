"""``lms verify ORIGINAL REWRITTEN``: prove a rewrite on CPU (identical results, measured memory).

Registered on the ``lms`` group with ``cli.add_command(verify)``. Exit codes: 0 identical, 1 a graph
that fails to run (:class:`~lmscli.errors.LmsError`), 4 different results
(:class:`~lmscli.verify.DifferentResults`).
"""

from __future__ import annotations

import json
import os
import sys

import click


def _console(no_color: bool):
    from rich.console import Console

    color = not no_color and "NO_COLOR" not in os.environ
    return Console(no_color=not color, color_system="auto" if color else None, highlight=False,
                   soft_wrap=not sys.stdout.isatty())


def _render(console, result) -> None:
    from rich.table import Table

    from lmscli.units import format_size

    def size(value):
        return "-" if value is None else format_size(value)

    def change(a, b):
        if a is None or b is None or not a:
            return "-"
        return f"{(b - a) / a:+.1%}"

    a, b = result.original, result.rewritten
    table = Table(title="Peak memory on the stand-in device (variables included)", title_justify="left")
    table.add_column("")
    table.add_column("original", justify="right")
    table.add_column("rewritten", justify="right")
    table.add_column("change", justify="right")
    rows = [("measured", a.measured.peak_bytes if a.measured else None, b.measured.peak_bytes if b.measured else None),
            ("simulated", a.simulated_peak_bytes, b.simulated_peak_bytes),
            ("Grappler", a.grappler_peak_bytes, b.grappler_peak_bytes)]
    for label, x, y in rows:
        table.add_row(label, size(x), size(y), change(x, y))
    table.add_row("swap nodes", str(a.swap_nodes), str(b.swap_nodes), "")
    console.print(table)
    what = f"loss and {result.variables} variables" if result.loss else f"{result.variables} variables"
    if result.outputs:
        what = f"{result.outputs} fetched output tensor(s)"
    if result.identical:
        console.print(f"[bold green]identical[/]: {what} bit-identical after {result.steps} "
                      f"step{'s' if result.steps != 1 else ''}")
    else:
        console.print(f"[bold red]different[/]: {result.difference.message}")
    for note in result.notes:
        console.print(f"[dim]note: {note}[/]")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("original", type=click.Path())
@click.argument("rewritten", type=click.Path())
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Training steps to run and compare.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Set unknown batch dimensions to N.")
@click.option("--fetch", "fetch", metavar="NAME[,NAME]",
              help="Ops a training step runs (default: the original's train_op collection, else its sinks).")
@click.option("--loss", metavar="TENSOR", help="Loss tensor to compare (default: loss:0, else the losses collection).")
@click.option("--no-measure", is_flag=True, help="Only compare results; skip measuring memory.")
@click.option("--tf-order", is_flag=True,
              help="Measure in the order TensorFlow's executor picks (changes per session; host copies lag) "
                   "instead of the simulator's schedule.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--no-color", is_flag=True, help="Plain output without colours.")
def verify(original, rewritten, steps, batch_size, fetch, loss, no_measure, tf_order, as_json, no_color):
    """Prove on CPU that REWRITTEN trains bit-identically to ORIGINAL, and measure both peaks.

    Both graphs run on two logical CPUs (the model on /device:CPU:1 standing in for the GPU, swap
    nodes on /device:CPU:0) with the same seeds and feeds. Exit code 4 when results differ.
    """
    from lmscli import api
    from lmscli import verify as verifier

    fetches = fetch.split(",") if fetch else None
    model_a = api.load(original, fetch=fetches)
    model_b = api.load(rewritten, fetch=list(model_a.fetches))
    result = verifier.verify(model_a, model_b, steps=steps, batch_size=batch_size, measure=not no_measure,
                             loss=loss, tf_order=tf_order)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _render(_console(no_color), result)
    if not result.identical:
        raise verifier.DifferentResults(f"{rewritten} computes different results from {original}: "
                                        f"{result.difference.message}")
