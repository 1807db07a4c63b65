"""``lms verify ORIGINAL REWRITTEN`` and ``lms measure GRAPH...``: proofs by running the graphs.

``verify`` proves a rewrite on CPU (identical results, measured memory); with ``--gpu-mem SIZE``
both graphs run on the stand-in GPU under that hard limit (:mod:`lmscli.prove.realmem`).
``measure`` finds the smallest limit under which one step really runs. Registered on the ``lms``
group with ``cli.add_command``. Exit codes: 0 proven, 1 a graph that fails to run
(:class:`~lmscli.errors.LmsError`), 4 different results (:class:`~lmscli.prove.verify.DifferentResults`),
5 the rewritten graph ran out of memory at ``--gpu-mem``.
"""

from __future__ import annotations

import os

import click

from lmscli.cliopts import console as _console
from lmscli.cliopts import emit_json, feed_option, gpu_mem_text, profile_options


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
    table = Table(title="Peak memory on the stand-in device (variables included)", title_justify="left",
                  caption="measured and simulated: the graph as written, TensorFlow's optimizations off; "
                          "optimized: the graph TensorFlow runs, as lms plans for it (prove it with --gpu-mem)",
                  caption_justify="left")
    table.add_column("")
    table.add_column("original", justify="right")
    table.add_column("rewritten", justify="right")
    table.add_column("change", justify="right")
    rows = [("measured", a.measured.peak_bytes if a.measured else None, b.measured.peak_bytes if b.measured else None),
            ("simulated", a.simulated_peak_bytes, b.simulated_peak_bytes),
            ("optimized, predicted", a.run_peak_bytes, b.run_peak_bytes),
            ("Grappler", a.grappler_peak_bytes, b.grappler_peak_bytes)]
    for label, x, y in rows:
        table.add_row(label, size(x), size(y), change(x, y))
    table.add_row("swap nodes", str(a.swap_nodes), str(b.swap_nodes), "")
    if a.recompute_nodes or b.recompute_nodes:
        table.add_row("recomputing nodes", str(a.recompute_nodes), str(b.recompute_nodes), "")
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


def _render_limit(console, proof, predictions) -> None:
    from rich.table import Table

    from lmscli.units import format_size

    table = Table(title=f"One training step on the stand-in GPU at {format_size(proof.limit_bytes)}",
                  title_justify="left")
    for column in ("", "original", "rewritten"):
        table.add_column(column, justify="left" if not column else "right")

    def verdict(v):
        text = "trains" if v.fits else "[red]out of memory[/]"
        runs = "run" if v.runs == 1 else "runs"
        return text + (f" ({v.failures}/{v.runs} {runs} OOM)" if v.varies else f" ({v.runs} {runs})")

    table.add_row("result", verdict(proof.original), verdict(proof.rewritten))
    a, b = predictions
    table.add_row("predicted (GPU)", format_size(a.predicted_bytes), format_size(b.predicted_bytes))
    table.add_row("predicted on the stand-in", format_size(a.predicted_standin_bytes),
                  format_size(b.predicted_standin_bytes))
    table.add_row("Grappler's estimate", format_size(a.grappler_bytes) if a.grappler_bytes else "-",
                  format_size(b.grappler_bytes) if b.grappler_bytes else "-")
    console.print(table)
    style = "bold green" if proof.proven and not proof.original.fits else ("bold red" if not proof.proven else "bold")
    console.print(f"[{style}]{proof.line()}[/]")
    for note in proof.notes:
        console.print(f"[dim]note: {note}[/]")


def _limit(text: str, predicted_bytes: int) -> int:
    """``--gpu-mem``: a size, or N% of the original's predicted need."""
    from lmscli.device import gpu_mem_from_text

    return gpu_mem_from_text(text, predicted_bytes if text.strip().endswith("%") else None)


def _gpus(graph_def) -> set:
    """The GPUs a graph's nodes run on, placed as the graph view places them (unplaced nodes on the
    first GPU, an unplaced variable read where its variable is), as plans count them."""
    from lmscli.graph.graphview import GraphView

    return {key for key in GraphView(graph_def).gpus if key is not None}


def _made_for_stand_in(graph_def) -> bool:
    """Was this rewrite planned with ``--stand-in``? Only stand-in plans make an op of the model wait
    until a swap-in has landed (a control input from a :data:`lmscli.emit.rewriter.LANDED` node)."""
    from lmscli.emit.rewriter import LANDED, is_lms_node

    return any(text.startswith("^") and LANDED in text
               for node in graph_def.node if not is_lms_node(node.name) for text in node.input)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("original", type=click.Path())
@click.argument("rewritten", type=click.Path())
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Training steps to run and compare.")
@click.option("--batch-size", type=click.IntRange(min=1),
              help="Set unknown batch dimensions to N (default: the size a rewrite made with --batch-size set).")
@click.option("--fetch", "fetch", metavar="NAME[,NAME]",
              help="Ops a training step runs (default: the original's train_op collection, else its sinks).")
@click.option("--loss", metavar="TENSOR", help="Loss tensor to compare (default: loss:0, else the losses collection).")
@click.option("--no-measure", is_flag=True, help="Only compare results; skip measuring memory.")
@click.option("--tf-order", is_flag=True,
              help="Measure in the order TensorFlow's executor picks (changes per session; host copies lag) "
                   "instead of the simulator's schedule.")
@click.option("--gpu-mem", metavar="SIZE", callback=gpu_mem_text,
              help="Prove it under a hard memory limit: both graphs train on a stand-in GPU (a TensorFlow server "
                   "process whose allocator is limited to SIZE, swaps going to a second process); e.g. 12MiB, "
                   "or N% of the original's predicted need.")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --gpu-mem: runs per graph (the executor's order varies between runs).")
@click.option("--no-tf-optimize", is_flag=True,
              help="With --gpu-mem: turn TensorFlow's graph optimizations (Grappler) off on the stand-in.")
@feed_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--no-color", is_flag=True, help="Plain output without colours.")
@profile_options
def verify(original, rewritten, steps, batch_size, fetch, loss, no_measure, tf_order, gpu_mem, runs, no_tf_optimize,
           feed_values, as_json, no_color):
    """Prove on CPU that REWRITTEN trains bit-identically to ORIGINAL, and measure both peaks.

    Both graphs run on two logical CPUs (the model on /device:CPU:1 standing in for the GPU, swap
    nodes on /device:CPU:0) with the same seeds and feeds. Exit code 4 when results differ.

    With --gpu-mem SIZE the proof is a real run under a hard limit: "original: out of memory at
    SIZE; rewritten: trains at SIZE, bit-identical". Exit code 5 when the rewritten graph runs out
    of memory there.
    """
    from lmscli import api
    from lmscli.progress import Progress
    from lmscli.prove import verify as verifier
    from lmscli.prove.steps import rewrite_batch_size

    fetches = fetch.split(",") if fetch else None
    progress = Progress.for_output(as_json=as_json, no_color=no_color)
    with progress.phase("loading"):
        model_a = api.load(original, fetch=fetches)
        model_b = _rewrite_of(model_a, rewritten, api)
        batch_size = rewrite_batch_size(model_a.meta_graph, model_b.meta_graph, batch_size)
    _integer_note(model_a, feed_values)
    if gpu_mem is not None:
        with progress.phase("proving on the stand-in GPU"):
            _verify_at_limit(model_a, model_b, gpu_mem, steps, batch_size, loss, runs, not no_tf_optimize,
                             as_json, no_color, feed_values)
        return
    with progress.phase("training both graphs"):
        result = verifier.verify(model_a, model_b, steps=steps, batch_size=batch_size, measure=not no_measure,
                                 loss=loss, tf_order=tf_order, feed_values=feed_values)
    if as_json:
        emit_json(result.to_dict())
    else:
        _render(_console(no_color), result)
    if not result.identical:
        raise verifier.DifferentResults(f"{rewritten} computes different results from {original}: "
                                        f"{result.difference.message}")


def _rewrite_of(model_a, rewritten: str, api):
    """``rewritten`` loaded to run the step ``model_a`` runs; an input error naming both when it
    lacks one of that step's ops (QA r54: "--fetch names no node 'AdamD'" for an unrelated graph,
    where no --fetch was given)."""
    from lmscli.errors import InputError, MissingFetchError

    try:
        return api.load(rewritten, fetch=list(model_a.fetches))
    except MissingFetchError as exc:
        source = "--fetch" if model_a.fetch_source == "option" else model_a.fetch_source
        raise InputError(f"{rewritten} is not a rewrite of {model_a.path}: it has no node {exc.node!r}, which the "
                         f"original's step runs (from {source}); give an original and the graph lms rewrote from it") from None


def _verify_at_limit(model_a, model_b, gpu_mem, steps, batch_size, loss, runs, optimize, as_json, no_color,
                     feed_values=None) -> None:
    from lmscli.prove import verify as verifier
    from lmscli.prove import realmem
    from lmscli.prove.standin import StandIn

    batch_size = _run_batch([model_a, model_b], batch_size)
    with StandIn(optimize=optimize, feed_values=feed_values) as stand_in:
        prediction_a, observation = realmem.predict(model_a, batch_size, stand_in=stand_in)
        prediction_b, _ = realmem.predict(model_b, batch_size, observation, stand_in)
        limit = _limit(gpu_mem, prediction_a.predicted_bytes)
        proof = realmem.prove_at_limit(model_a, model_b, limit, steps=steps, runs=runs, batch_size=batch_size,
                                       loss=loss, optimize=optimize, stand_in=stand_in)
    if as_json:
        from lmscli.prove.steps import default_loss

        ran = proof.rewritten.result or proof.original.result  # (a run that completed: what it compared)
        doc = {"schema": "lms.verify", "version": 1, "identical": proof.identical,
               "first_difference": proof.difference, "first_different_variable": None, "steps": steps,
               "batch_size": batch_size, "loss": loss or default_loss(model_a.meta_graph),
               "variables": len(ran.variables) if ran is not None else None,
               "outputs": (len(ran.outputs[0]) if ran.outputs else 0) if ran is not None else None,
               "fetches": list(model_a.fetches), "notes": list(proof.notes), "limit": proof.to_dict(),
               "original": {"predicted_bytes": prediction_a.predicted_bytes,
                            "predicted_standin_bytes": prediction_a.predicted_standin_bytes,
                            "grappler_peak_bytes": prediction_a.grappler_bytes},
               "rewritten": {"predicted_bytes": prediction_b.predicted_bytes,
                             "predicted_standin_bytes": prediction_b.predicted_standin_bytes,
                             "grappler_peak_bytes": prediction_b.grappler_bytes}}
        emit_json(doc)
    else:
        _render_limit(_console(no_color), proof, (prediction_a, prediction_b))
    if not proof.rewritten.fits:
        from lmscli.prove.standin import in_initialisation
        from lmscli.units import format_size

        hint = ""
        gpus = _gpus(model_b.meta_graph.graph_def)
        if in_initialisation(proof.rewritten.message):  # (QA r54: blamed on the runs' variation)
            hint = (" (before any step ran: initialising the variables needs more than this limit, whatever the "
                    "plan; try a larger --gpu-mem)")
        elif len(gpus) > 1:
            hint = (f" (the graph places ops on {len(gpus)} GPUs, and the stand-in runs all of them in one process: "
                    "the limit holds for all GPUs together, where a plan for a GPU is made for each one alone)")
        elif _made_for_stand_in(model_b.meta_graph.graph_def):
            hint = (" (the plan was made for the stand-in, whose runs near a limit vary with the executor's order: "
                    "make it at a slightly larger --gpu-mem, or with more --reserve, to leave room for that)")
        elif prediction_b.predicted_standin_bytes > proof.limit_bytes:
            hint = (f" (predicted for the stand-in: {format_size(prediction_b.predicted_standin_bytes)}, in the CPU "
                    "executor's op order, where a swap-out leaves only when an op waits for it, and with its CPU "
                    "kernels' scratch; a plan for a GPU does not plan for those: make the plan to prove with "
                    "`lms rewrite --stand-in`)")
        raise realmem.RewrittenOutOfMemory(f"{model_b.path} ran out of memory on the stand-in GPU at "
                                           f"{format_size(proof.limit_bytes)}: {proof.rewritten.message}{hint}")
    if proof.identical is False:
        raise verifier.DifferentResults(f"{model_b.path} computes different results from {model_a.path} at the "
                                        f"limit: {proof.difference}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("graphs", nargs=-1, required=True, type=click.Path())
@click.option("--batch-size", type=click.IntRange(min=1),
              help="Set unknown batch dimensions to N (default: the size a rewrite given after its original was "
                   "made with).")
@click.option("--fetch", "fetch", metavar="NAME[,NAME]",
              help="Ops a training step runs (default: the first graph's train_op collection, else its sinks; a graph "
                   "without those ops runs its own).")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs that must all fit at the limit found (the executor's order varies between runs).")
@click.option("--no-tf-optimize", is_flag=True, help="Turn TensorFlow's graph optimizations (Grappler) off.")
@feed_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--no-color", is_flag=True, help="Plain output without colours.")
@profile_options
def measure(graphs, batch_size, fetch, runs, no_tf_optimize, feed_values, as_json, no_color):
    """How much memory one training step of each GRAPH really needs.

    Finds, to 1 MiB, the smallest limit under which the step runs on the stand-in GPU (a TensorFlow
    server process with a hard allocator limit), by bisection around the simulator's prediction,
    and shows the prediction and Grappler's estimate beside it. Give an original and its rewrite
    to compare them.
    """
    from lmscli import api
    from lmscli.progress import Progress
    from lmscli.prove import realmem
    from lmscli.prove.steps import rewrite_batch_size

    fetches = fetch.split(",") if fetch else None
    progress = Progress.for_output(as_json=as_json, no_color=no_color)
    with progress.phase("loading"):
        models = [api.load(graphs[0], fetch=fetches)]
        models += [_load_like(path, models[0], fetches) for path in graphs[1:]]
    # A rewrite made with --batch-size N is measured at N, and its original with it (QA: the
    # original was measured at batch 1 beside its rewrite at 32, 2 MiB against 16).
    for other in models[1:]:
        batch_size = rewrite_batch_size(models[0].meta_graph, other.meta_graph, batch_size)
    batch_size = _run_batch(models, batch_size)
    _integer_note(models[0], feed_values)
    with progress.phase("measuring on the stand-in GPU"):
        needs = realmem.measure_need(models, batch_size=batch_size, runs=runs, optimize=not no_tf_optimize,
                                     feed_values=feed_values)
    if as_json:
        emit_json({"schema": "lms.measure", "version": 1, "runs": runs, "graphs": [n.to_dict() for n in needs]})
        return
    _render_needs(_console(no_color), needs)


def _run_batch(models, batch_size):
    """:func:`lmscli.prove.realmem.run_batch`, saying on stderr when it chose batch 1."""
    from lmscli.prove import realmem

    chosen = realmem.run_batch(models, batch_size)
    if batch_size is None and chosen is not None:
        click.echo(f"note: {os.path.basename(models[0].path)} has an unknown batch dimension: its steps run, and are "
                   f"predicted, at batch {chosen} (--batch-size N for another)", err=True)
    return chosen


def _integer_note(model, feed_values=None) -> None:
    """Say on stderr which integer placeholders are fed 0 and 1 (no size they index was found, and
    no --feed): QA r47, a GRU's sequence lengths, so its loop ran once and its need was measured at
    11 MiB of 37 with no word. A --feed naming no placeholder of the step is an error here, before
    any run."""
    from lmscli.prove.steps import check_feeds, import_graph, unbounded_integers

    placeholders = import_graph(model.meta_graph, list(model.fetches)).placeholders
    check_feeds(placeholders, feed_values)
    names = unbounded_integers(placeholders, feed_values or {})
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        click.echo(f"note: integer placeholder(s) {shown} are fed 0 and 1 (lms found no size they index): "
                   "a loop or a count they bound runs at most once, and the figures are that step's; "
                   "give them values with --feed NAME=VALUE", err=True)


def _load_like(path: str, first, fetches):
    """Load ``path`` to run the step ``first`` runs (a rewrite of it), or, when it has none of
    those ops and no --fetch was given, its own step: an unrelated graph measured beside it."""
    from lmscli import api
    from lmscli.errors import MissingFetchError

    try:
        return api.load(path, fetch=list(first.fetches))
    except MissingFetchError:
        if fetches:
            raise
        return api.load(path)


def _short_paths(paths) -> tuple[str, list[str]]:
    """``(folder, names)``: the folder all ``paths`` are in (``""`` if none or ``.``) and each path
    below it, for a table whose rows the names must tell apart (QA: paths folded every 10
    characters, "/work/qa/r | ound29/out | m_70MiB.me | ta")."""

    if not paths:
        return "", []

    def shown(folder: str) -> str:
        near = os.path.relpath(folder)
        return folder if near.startswith("..") else near  # (outside the working folder: its whole path)

    folders = [os.path.dirname(os.path.abspath(p)) for p in paths]
    folder = os.path.commonpath(folders)
    bases = [os.path.basename(p) for p in paths]
    if os.path.dirname(folder) == folder and len(set(bases)) == len(bases):
        # Nothing in common but the root: each graph by its file's name, and their folders said
        # once (QA: "work/main/sa | mple_graphs/ | stack_rnn.me | ta" beside "graphs in /")
        return ", ".join(dict.fromkeys(shown(f) for f in folders)), bases
    names = [os.path.relpath(os.path.abspath(p), folder) for p in paths]
    return ("" if shown(folder) == "." else shown(folder)), names


def _render_needs(console, needs) -> None:
    from rich.table import Table

    from lmscli.units import format_size

    folder, names = _short_paths([n.path for n in needs])
    table = Table(title="Smallest limit under which one step runs (stand-in GPU)", title_justify="left",
                  caption=f"graphs in the folder {folder}" if folder else None, caption_justify="left",
                  pad_edge=False)
    for column in ("graph", "measured", "predicted (GPU)", "predicted here", "vs measured", "Grappler"):
        # (a long name folds, and keeps room enough to be read at 80 columns)
        table.add_column(column, justify="left" if column == "graph" else "right",
                         overflow="fold" if column == "graph" else "ellipsis",
                         min_width=min(12, max(len(name) for name in names)) if column == "graph" else None)
    for n, name in zip(needs, names):
        p = n.prediction
        table.add_row(name, format_size(n.min_limit_bytes) + (" (varies)" if n.varies else ""),
                      format_size(p.predicted_bytes), format_size(p.predicted_standin_bytes),
                      f"{p.predicted_standin_bytes / n.min_limit_bytes - 1:+.1%}",
                      format_size(p.grappler_bytes) if p.grappler_bytes else "-")
    console.print(table)
    console.print("[dim]predicted here = the stand-in's prediction: the CPU kernels' scratch buffers and the CPU "
                  "executor's op order, observed once per graph in a traced step (a GPU has neither)[/]")
    if any(n.varies for n in needs):  # (QA round 30: the mark had no legend)
        console.print("[dim](varies) = a smaller limit fitted once and then failed when confirmed: the executor's "
                      "order, and with it the need, differs between runs[/]")
