"""The ``lms`` command line: load -> library calls -> render. No computation lives here.

Exit codes (also in the README): 0 success; 1 bad input or a failed run; 2 usage error;
3 no plan fits the budget; 4 ``lms verify`` found different results.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from functools import wraps

import click

from lmscli import __version__
from lmscli.cliopts import console as _console
from lmscli.cliopts import JSON_ASKED, emit_json, error_document, feed_option, gpu_mem_text, link_text, profile_options, size_text
from lmscli.device import NO_BUDGET, STAND_IN_LINK
from lmscli.device import PRESETS as _PRESETS
from lmscli.errors import EXIT_ERROR, EXIT_NO_FIT, LmsError

PRESET_NAMES = tuple(_PRESETS)

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


RAW_ARGS = "lms.raw_args"  # click context meta: the arguments after ``lms``


class LmsGroup(click.Group):
    """Turns library errors into one line on stderr and the documented exit code."""

    def parse_args(self, ctx, args):
        ctx.meta[RAW_ARGS] = list(args)  # (for a usage error's JSON document: see invoke)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            # A usage error (exit 2) with --json is a document too (QA r50: a bad --gpu-mem gave
            # an empty stdout); click prints the usage on stderr as always.
            if "--json" in (ctx.meta.get(RAW_ARGS) or ()):
                ctx.meta[JSON_ASKED] = True
                _error_json(ctx, exc.exit_code, "UsageError", exc.format_message())
            raise
        except LmsError as exc:
            if _debug(ctx):
                traceback.print_exc()
            _error_json(ctx, exc.exit_code, type(exc).__name__, str(exc))
            # (no plan under a budget is an answer, not a failure: QA r49 read "lms: error:" as a crash)
            click.echo(f"lms: {exc}" if exc.exit_code == EXIT_NO_FIT else f"lms: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("lms: interrupted", err=True)
            ctx.exit(130)
        except Exception as exc:  # a bug or an unexpected TensorFlow failure
            if _debug(ctx):
                traceback.print_exc()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _error_json(ctx, EXIT_ERROR, "unexpected", f"unexpected {type(exc).__name__}: {first}")
            click.echo(f"lms: error: unexpected {type(exc).__name__}: {first} (run with --debug for a traceback)",
                       err=True)
            ctx.exit(EXIT_ERROR)


def _error_json(ctx, exit_code: int, kind: str, message: str) -> None:
    """With --json, the error as a document on stdout (schema lms.error), unless the command
    printed its own (a no-plan answer, verify's different results)."""
    doc = error_document(ctx.meta, ctx.invoked_subcommand, exit_code, kind, message)
    if doc is not None:
        click.echo(doc)


def _debug(ctx) -> bool:
    root = ctx.find_root()
    return bool((root.obj or {}).get("debug")) or os.environ.get("LMS_DEBUG") == "1"


@click.group(cls=LmsGroup, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="lms")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx, debug):
    """Fit TensorFlow training graphs in GPU memory by swapping tensors to the host.

    \b
    lms analyze model.meta                        what the graph needs
    lms tune model.meta --gpu-mem 16GiB           plan the least swapping that fits
    lms rewrite in.meta out.meta --gpu-mem 16GiB  write the rewritten graph
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    # TensorFlow's C++ errors stay off unless --debug: Grappler logs one for every candidate graph
    # one of its optimizers gives up on, which lms detects and handles itself (the guard).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if debug else "3")
    if ctx.invoked_subcommand in ("verify", "measure"):
        # oneDNN's CPU kernels may sum in another order for a buffer that arrived through a swap
        # (another address and alignment): 1e-7 differences that say nothing about the rewrite.
        # Verification compares computations, so it runs TensorFlow's own kernels.
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    ctx.default_map = project_defaults()


CONFIG_KEYS = {"gpu_mem", "host_mem", "reserve", "link", "device", "strategy", "host_device", "batch_size", "fetch"}


def project_defaults(path: str = "setup.cfg") -> dict:
    """Defaults from the ``[lms]`` section of the project's setup.cfg (in the working directory)."""
    import configparser

    if not os.path.isfile(path):
        return {}
    parser = configparser.ConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except configparser.Error:
        return {}
    if not parser.has_section("lms"):
        return {}
    values = {k.replace("-", "_"): v for k, v in parser.items("lms") if k.replace("-", "_") in CONFIG_KEYS}
    return {"tune": dict(values), "rewrite": dict(values)}


# ---------------------------------------------------------------- shared options
def model_options(func):
    """Options naming what to load and what a step runs (shared by every command)."""

    @click.option("--format", "fmt", type=click.Choice(
        ["graphdef", "graphdef-text", "metagraph", "metagraph-text", "savedmodel"]),
        help="Input format (default: detected from the content).")
    @click.option("--fetch", "fetch", metavar="NAME[,NAME]",
                  help="Ops a training step runs (default: the train_op collection, else the sinks).")
    @click.option("--tag", help="SavedModel tag set to load (default: the only one, else 'train', else 'serve').")
    @click.option("--batch-size", type=click.IntRange(min=1), help="Set unknown batch dimensions to N.")
    @wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def output_options(func):
    """Options choosing how results are shown (shared by every command)."""

    @click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (logs go to stderr).")
    @click.option("-v", "--verbose", is_flag=True, help="Also print [LMS] log lines on stderr.")
    @click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors (and --json output).")
    @click.option("--no-color", is_flag=True, help="Plain output without colours.")
    @profile_options
    @wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def device_options(func):
    """The device a plan is made for (shared by tune and rewrite)."""

    @click.option("--gpu-mem", metavar="SIZE", callback=gpu_mem_text,
                  help="GPU memory, e.g. 16GiB, 32GB, 1.5e9, or N% of the no-swap peak.")
    @click.option("--device", "device_preset", type=click.Choice(sorted(PRESET_NAMES)),
                  help="A named GPU (memory, speed, link).")
    @click.option("--reserve", type=click.FloatRange(0.0, 0.99), default=None,
                  help="Share of GPU memory held back for workspaces and fragmentation (default 0.10).")
    @click.option("--host-mem", metavar="SIZE", callback=size_text,
                  help="Pinned host memory for swapped tensors (default 64GiB).")
    @click.option("--link", metavar="LINK", callback=link_text,
                  help="CPU-GPU link: nvlink2, pcie3, pcie4, pcie5, nvlink-c2c or e.g. 25GB/s.")
    @wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def plan_options(func):
    """How to plan (shared by tune and rewrite)."""

    @click.option("--strategy", type=click.Choice(["hybrid", "swap", "recompute", "tflms", "lms"]), default="hybrid",
                  show_default=True,
                  help="hybrid: per tensor, swap or recompute, whichever costs less time on --link; swap: swaps only "
                       "(lms is its former name); recompute: recomputation only (automatic gradient checkpointing); "
                       "tflms: TFLMS v2's parameter search.")
    @click.option("--swapout-threshold", type=int, help="TFLMS: swap for consumers more than N levels away.")
    @click.option("--swapin-ahead", type=int, help="TFLMS: start swap-ins N levels before the consumer.")
    @click.option("--swapin-groupby", type=int, help="TFLMS: consumers within N levels share a swap-in.")
    @click.option("--sync-mode", type=click.IntRange(0, 3), help="TFLMS: 0 async, 1 sync swap-out, 2 sync swap-in, 3 both.")
    @click.option("--include-scope", multiple=True, metavar="SCOPE", help="Only swap tensors of ops under SCOPE.")
    @click.option("--exclude-scope", multiple=True, metavar="SCOPE", help="Never swap tensors of ops under SCOPE.")
    @click.option("--include-type", multiple=True, metavar="OP", help="Only swap tensors of ops of type OP.")
    @click.option("--exclude-type", multiple=True, metavar="OP", help="Never swap tensors of ops of type OP.")
    @click.option("--exclude-consumer-scope", multiple=True, metavar="SCOPE",
                  help="Never rewire consumers under SCOPE to a swap-in.")
    @click.option("--exclude-consumer-type", multiple=True, metavar="OP",
                  help="Never rewire consumers of type OP to a swap-in.")
    @click.option("--keep-loop-parallelism", is_flag=True,
                  help="Leave while loops' parallel_iterations as they are. By default a plan runs each loop one "
                       "iteration at a time (the same results), as lms's memory model counts it: overlapping "
                       "iterations each hold their own temporaries.")
    @click.option("--keep-order", is_flag=True,
                  help="Add no control edges that only reorder ops. By default a --stand-in plan may run an op that "
                       "frees more memory than it makes before a sibling that allocates (a filter gradient before its "
                       "input gradient; the same results), and a GPU plan may when no plan in the step's order passes "
                       "the judge.")
    @click.option("--judge", type=click.Choice(["executor", "grappler"]), default="executor", show_default=True,
                  help="What decides that a plan fits: the simulator of TensorFlow's executor (what a run really "
                       "allocates), or Grappler's static estimate (conservative; today's TFLMS-like behaviour).")
    @click.option("--stand-in", "stand_in", is_flag=True,
                  help="Plan for the CPU stand-in GPU of `lms verify --gpu-mem`, not for a real GPU: count the scratch "
                       "buffers this machine's CPU kernels take and follow the CPU executor's op order, both observed "
                       "in traced steps there, and judge each plan by real runs there (see --judge-runs).")
    @click.option("--judge-runs", type=click.IntRange(min=1), default=None, metavar="N",
                  help="With --stand-in: fresh runs of each plan the judge makes under --gpu-mem, and as many under "
                       "--gpu-mem less half the reserve (default 5). Fewer is faster and weaker evidence against a "
                       "run that varies; `lms verify` proves the result anyway.")
    @feed_option
    @click.option("--no-grappler-check", is_flag=True, help="Skip Grappler's estimate of the plan (its second opinion).")
    @click.option("--time-limit", type=click.FloatRange(min=0.0, min_open=True), metavar="SECONDS",
                  help="Stop refining after SECONDS (counted from the start) and return the best fitting plan "
                       "found by then; say so. Exit 3 if none fits by then.")
    @wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def _tune_options(strategy, swapout_threshold, swapin_ahead, swapin_groupby, sync_mode, include_scope,
                  exclude_scope, include_type, exclude_type, exclude_consumer_scope, exclude_consumer_type,
                  keep_loop_parallelism=False, keep_order=False):
    from lmscli.plan.candidates import Filters
    from lmscli.plan.planner import TflmsParams, TuneOptions

    filters = Filters(include_scopes=tuple(include_scope), exclude_scopes=tuple(exclude_scope),
                      include_types=tuple(include_type), exclude_types=tuple(exclude_type),
                      exclude_consumer_scopes=tuple(exclude_consumer_scope),
                      exclude_consumer_types=tuple(exclude_consumer_type))
    manual = [swapout_threshold, swapin_ahead, swapin_groupby]
    tflms = None
    if any(v is not None for v in manual):
        strategy = "tflms"
        tflms = TflmsParams(swapout_threshold if swapout_threshold is not None else 1,
                            swapin_ahead if swapin_ahead is not None else 1,
                            swapin_groupby if swapin_groupby is not None else 0,
                            sync_mode or 0)
    return TuneOptions(strategy=strategy, filters=filters, tflms=tflms, sync_mode=sync_mode or 0,
                       serial_loops=not keep_loop_parallelism, reorder=False if keep_order else None)


def _directories_exist(*paths) -> None:
    """Refuse, before any work, to write a file into a directory that does not exist (QA r52: a
    rewrite tuned for 17 s, then said so)."""
    from lmscli.loader import output_directory

    for path in paths:
        if path:
            output_directory(path)


def _judge_runs_need_the_stand_in(judge_runs, stand_in) -> None:
    if judge_runs is not None and not stand_in:
        raise click.UsageError("--judge-runs counts the stand-in judge's real runs: add --stand-in (without it, "
                               "plans are judged by the executor model, not by runs)")


def _device(prepared, gpu_mem, device_preset, reserve, host_mem, link):
    """The device; ``prepared`` (a Prepared, or a function making one) is used only for N%."""
    from lmscli import api
    from lmscli.device import gpu_mem_from_text
    from lmscli.model.simulator import simulate

    peak = None
    if isinstance(gpu_mem, str) and gpu_mem.strip().endswith("%"):
        prepared = prepared() if callable(prepared) else prepared
        peak = simulate(prepared.schedule).peak_bytes
    return api.make_device(gpu_mem=gpu_mem_from_text(gpu_mem, peak), preset=device_preset, reserve=reserve,
                           host_mem=host_mem, link=link)


def _load(path, fmt, fetch, tag):
    from lmscli import api

    return api.load(path, fmt=fmt, fetch=fetch.split(",") if fetch else None, tag=tag)


@contextlib.contextmanager
def _no_fit_json(schema: str, as_json: bool, verbose: bool = False):
    """With ``--json``, a no-plan answer is a document too (``fits: false`` and ``no_fit``), printed
    before the error line and exit code 3; with ``-v``, the planner's log lines come first."""
    from lmscli.errors import NoFitError

    try:
        yield
    except NoFitError as exc:
        _log(exc.log, verbose)
        if as_json:
            emit_json({"schema": schema, "version": 1, "fits": False, "necessary": True, "plan": None,
                        "no_fit": exc.to_dict()})
        raise


def _format_note(path: str, fmt: str, quiet: bool) -> None:
    """Say on stderr (unless -q) that ``path``, written in the input's format ``fmt``, has the
    extension of the other one (QA r54: a MetaGraphDef written to a .pb without a word)."""
    name = path.lower()
    named = "graphdef" if name.endswith((".pb", ".pbtxt")) and not name.endswith(".meta.pbtxt") else (
        "metagraph" if name.endswith((".meta", ".meta.txt", ".meta.pbtxt")) else None)
    if quiet or named is None or fmt.startswith(named):
        return
    kinds = {"metagraph": "MetaGraphDef", "graphdef": "GraphDef"}
    click.echo(f"note: {path} holds a {kinds[fmt.split('-')[0]]}, not the {kinds[named]} its name suggests: lms writes "
               "the format it read (a SavedModel's step as a MetaGraphDef) and reads it back by its content; other "
               "tools may not", err=True)


def _whole_mib_note(device, stand_in: bool, quiet: bool) -> None:
    """With --stand-in, say on stderr (unless -q) that a --gpu-mem of a fraction of a MiB is judged
    under the whole MiB below it, as the stand-in's allocator takes its limit (QA r48: 4.5MiB was
    judged and proven under 4 MiB, and only `lms verify` said so)."""
    from lmscli.units import format_size

    mib = 1 << 20
    if stand_in and not quiet and device.gpu_mem % mib and device.gpu_mem > mib:
        click.echo(f"note: the stand-in's allocator takes its limit in whole MiB: --gpu-mem {format_size(device.gpu_mem)} "
                   f"is judged under {format_size(device.gpu_mem // mib * mib)} (prove it there with `lms verify "
                   "--gpu-mem`)", err=True)


def _warn_unknown_sizes(prepared, quiet: bool) -> None:
    """Say on stderr (unless -q) when tensors of the step have unknown sizes."""
    from lmscli.analysis import unknown_size_warning

    text = unknown_size_warning(prepared)
    if text and not quiet:
        click.echo(f"warning: {text}", err=True)


def _log(lines, verbose: bool) -> None:
    if verbose:
        for line in lines:
            click.echo(line, err=True)


def _progress(quiet: bool, as_json: bool, no_color: bool):
    from lmscli.progress import Progress

    return Progress.for_output(quiet=quiet, as_json=as_json, no_color=no_color)


def _write_report(path: str, doc: dict, prepared, result) -> None:
    """--report: the HTML page of ``doc`` with the plot (when matplotlib is installed), atomically."""
    import importlib.util

    from lmscli import api
    from lmscli.report import html as html_report

    svg = None
    if importlib.util.find_spec("matplotlib") is not None:
        from lmscli.report import plots

        svg = plots.memory_svg(prepared, result)
    api.atomic_write(path, html_report.render(doc, svg).encode("utf-8"))


def report_option(func):
    return click.option("--report", "report_file", type=click.Path(dir_okay=False), metavar="FILE.html",
                        help="Write a self-contained HTML report (tables, plot, plan), e.g. for CI artifacts.")(func)


# ---------------------------------------------------------------- commands
@cli.command(context_settings=CONTEXT)
@click.argument("model", type=click.Path())
@model_options
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a memory-over-time plot (.png or .svg).")
@report_option
@click.option("--stand-in", "stand_in", is_flag=True,
              help="The step as the CPU stand-in GPU of `lms verify --gpu-mem` runs it (its kernels' scratch "
                   "buffers and op order, observed in traced steps): the peak, and the lower bound before "
                   "`--stand-in` planning leaves alone the tensors whose swap would change Grappler's optimizations.")
@feed_option
@output_options
def analyze(model, fmt, fetch, tag, batch_size, plot, report_file, stand_in, feed_values, as_json, verbose, quiet,
            no_color):
    """Report a graph's size, levels, largest operation and peak memory without swapping."""
    from lmscli import api
    from lmscli.report import terminal as report
    from lmscli.model.simulator import simulate

    progress = _progress(quiet, as_json, no_color)
    with progress.phase(f"loading {model}"):
        loaded = _load(model, fmt, fetch, tag)
        if stand_in:
            loaded = api.stand_in_step(loaded)
    with progress.phase("inferring shapes and scheduling the step"):
        prepared = api.prepare(loaded, batch_size=batch_size, feed_values=feed_values)
        if stand_in:
            prepared = api.for_stand_in(prepared, feed_values=feed_values)
    _warn_unknown_sizes(prepared, quiet)
    with progress.phase("simulating the step"):
        baseline = simulate(prepared.schedule)
        result = api.analyze(prepared, baseline)
    with progress.phase("drawing", active=bool(plot or report_file)):
        if plot:
            from lmscli.report import plots

            plots.memory_plot(prepared, baseline, plot)
        if report_file:
            _write_report(report_file, result.to_dict(), prepared, baseline)
    _log(report.analysis_log_lines(result), verbose)
    if as_json:
        emit_json(result.to_dict())
    elif not quiet:
        report.render_analysis(_console(no_color), result, baseline)


@cli.command(context_settings=CONTEXT)
@click.argument("model", type=click.Path())
@model_options
@device_options
@plan_options
@click.option("--find-max-batch", is_flag=True, help="Search the largest batch size that fits (unknown batch dims).")
@click.option("--plan-out", type=click.Path(dir_okay=False), help="Write the plan as JSON (for lms rewrite --plan).")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a memory-over-time plot (.png or .svg).")
@report_option
@output_options
def tune(model, fmt, fetch, tag, batch_size, gpu_mem, device_preset, reserve, host_mem, link, find_max_batch,
         plan_out, plot, report_file, as_json, verbose, quiet, no_color, no_grappler_check, judge, stand_in,
         judge_runs, feed_values, **plan_kwargs):
    """Plan the least swapping that fits a GPU, and predict its cost."""
    from lmscli import api
    from lmscli.report import terminal as report

    _judge_runs_need_the_stand_in(judge_runs, stand_in)
    if gpu_mem is None and device_preset is None:
        raise click.UsageError("give the GPU memory with --gpu-mem SIZE (e.g. 16GiB or 80%) or a --device preset")
    _directories_exist(plan_out, plot, report_file)
    progress = _progress(quiet, as_json, no_color)
    with progress.phase(f"loading {model}"):
        loaded = _load(model, fmt, fetch, tag)
    options = _tune_options(**plan_kwargs)
    if find_max_batch:
        def probe():
            return api.prepare(loaded, batch_size=batch_size or 1, judge=judge, feed_values=feed_values)

        with progress.phase("searching the largest batch size that fits"), _no_fit_json("lms.tune", as_json, verbose):
            device = _device(probe, gpu_mem, device_preset, reserve, host_mem, link)
            batch, result, prepared = api.find_max_batch(loaded, device, options, judge=judge,
                                                         feed_values=feed_values)
    else:
        with progress.phase("inferring shapes and scheduling the step"):
            if stand_in:
                loaded = api.stand_in_step(loaded)
            prepared = api.prepare(loaded, batch_size=batch_size, judge=judge, feed_values=feed_values)
            _warn_unknown_sizes(prepared, quiet)
            if stand_in:
                prepared = api.for_stand_in(prepared, judge_runs=judge_runs, feed_values=feed_values)
                link = link or STAND_IN_LINK
            device = _device(prepared, gpu_mem, device_preset, reserve, host_mem, link)
            _whole_mib_note(device, stand_in, quiet)
        with progress.phase("tuning" + ("" if no_grappler_check else ", then checking the plan with Grappler")), \
                _no_fit_json("lms.tune", as_json, verbose):
            result = api.tune(prepared, device, options, check=not no_grappler_check)
        batch = None
    result = api.with_link_predictions(prepared, result)
    details = report.plan_details(prepared, result)
    _log(report.tune_log_lines(result), verbose)
    if plan_out:
        api.atomic_write(plan_out, result.plan.to_json().encode("utf-8"))
    doc = {"schema": "lms.tune", "version": 1, "fits": result.fits, "necessary": result.necessary,
           "time_limited": result.time_limited, "max_batch_size": batch, "plan": result.plan.to_dict(), **details}
    with progress.phase("drawing", active=bool(plot or report_file)):
        if plot:
            from lmscli.report import plots

            plots.memory_plot(prepared, result, plot)
        if report_file:
            _write_report(report_file, doc, prepared, result)
    if as_json:
        emit_json(doc)
    elif not quiet:
        console = _console(no_color)
        if batch is not None:
            console.print(f"[bold]largest batch size that fits: {batch}[/]")
        report.render_tune(console, result, details)


@cli.command(context_settings=CONTEXT)
@click.argument("model", type=click.Path())
@click.argument("output", type=click.Path(dir_okay=False))
@model_options
@device_options
@plan_options
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False), help="Apply a reviewed plan (from tune --plan-out).")
@click.option("--serialize", "serialize_levels", metavar="LEVELS",
              help="Run the ops of these levels one at a time, e.g. 1,3:5,7 (ranges include both ends).")
@click.option("--serialize-by-size", metavar="SIZE", callback=size_text, help="Serialize every level whose outputs exceed SIZE.")
@click.option("--host-device", default="/device:CPU:0", show_default=True, help="Where swap nodes are placed.")
@click.option("--force", is_flag=True, help="Rewrite a graph that already has lms swap nodes.")
@click.option("--dry-run", is_flag=True, help="Report what would be added; write nothing.")
@click.option("--plan-out", type=click.Path(dir_okay=False), help="Also write the applied plan as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a memory-over-time plot (.png or .svg).")
@report_option
@click.option("--tensorboard-logdir", type=click.Path(file_okay=False), metavar="DIR",
              help="Also write the rewritten graph as a TensorBoard event file in DIR.")
@output_options
def rewrite(model, output, fmt, fetch, tag, batch_size, gpu_mem, device_preset, reserve, host_mem, link, plan_file,
            serialize_levels, serialize_by_size, host_device, force, dry_run, plan_out, plot, report_file,
            tensorboard_logdir, as_json, verbose, quiet, no_color, no_grappler_check, judge, stand_in,
            judge_runs, feed_values, **plan_kwargs):
    """Write MODEL with swap-out and swap-in operations to OUTPUT (same format)."""
    from dataclasses import replace

    from lmscli import api
    from lmscli.report import terminal as report
    from lmscli.errors import GraphError, InputError
    from lmscli.plan.document import Plan
    from lmscli.emit.rewriter import has_lms_nodes
    from lmscli.plan.planner import parse_levels
    from lmscli.units import parse_size

    if os.path.abspath(model) == os.path.abspath(output):
        raise InputError(f"{output}: refusing to overwrite the input; write to another file")
    _judge_runs_need_the_stand_in(judge_runs, stand_in)
    options = _tune_options(**plan_kwargs)
    if plan_file is None and gpu_mem is None and device_preset is None and options.tflms is None:
        raise click.UsageError("say how to plan: --gpu-mem SIZE, --device NAME, --plan plan.json, "
                               "or TFLMS parameters (--swapout-threshold ...)")
    _directories_exist(None if dry_run else output, plan_out, plot, report_file)
    progress = _progress(quiet, as_json, no_color)
    plan = None
    if plan_file:
        try:
            with open(plan_file, encoding="utf-8") as fh:
                plan = Plan.from_json(fh.read())
        except OSError as exc:
            raise InputError(f"{plan_file}: cannot read the plan ({exc.strerror})") from None
        if plan.stand_in and not stand_in:
            # (its triggers follow the stand-in's traced order, its fetches the stand-in's step)
            _log([f"[LMS] {plan_file} was made for the stand-in GPU (--stand-in): applying it to the step as the "
                  "stand-in runs it"], not quiet)
            stand_in = True
    with progress.phase(f"loading {model}"):
        loaded = _load(model, fmt, fetch, tag)
    if not force and has_lms_nodes(loaded.graph_def):
        raise GraphError(f"{model}: the graph already contains lms swap nodes (it was rewritten before); "
                         "pass --force to rewrite it again")
    with progress.phase("inferring shapes and scheduling the step"):
        if stand_in:
            loaded = api.stand_in_step(loaded)
        prepared = api.prepare(loaded, batch_size=batch_size, judge=judge, feed_values=feed_values)
        _warn_unknown_sizes(prepared, quiet)
        if stand_in:
            prepared = api.for_stand_in(prepared, judge_runs=judge_runs, feed_values=feed_values)
            link = link or STAND_IN_LINK
    if plan is not None:
        result = None
    else:
        if gpu_mem is None and device_preset is None:
            gpu_mem = str(NO_BUDGET)  # manual TFLMS parameters: no budget to meet
        device = _device(prepared, gpu_mem, device_preset, reserve, host_mem, link)
        _whole_mib_note(device, stand_in, quiet)
        with progress.phase("tuning" + ("" if no_grappler_check else ", then checking the plan with Grappler")), \
                _no_fit_json("lms.rewrite", as_json, verbose):
            result = api.with_link_predictions(prepared, api.tune(prepared, device, options,
                                                                  check=not no_grappler_check))
        plan = result.plan
    levels = parse_levels(serialize_levels) if serialize_levels else ()
    min_bytes = parse_size(serialize_by_size) if serialize_by_size else None
    if levels or min_bytes is not None:
        plan = replace(plan, serialize=plan.serialize + api.serialization_chains(prepared, levels, min_bytes))
    with progress.phase("writing the swap nodes"):
        new_graph, rep = api.rewrite(prepared, plan, host_device=host_device, force=force)
        # (a given plan is simulated before anything is written: PlanError if lms cannot follow it)
        shown = result if result is not None else api.replay(prepared, plan)
        written = None
        if not dry_run:
            written = api.save(loaded, new_graph, output)
            _format_note(output, written, quiet)
        event_file = None
        if tensorboard_logdir:
            from lmscli.report.tensorboard import write_graph

            event_file = write_graph(new_graph, tensorboard_logdir)
    if plan_out:
        api.atomic_write(plan_out, plan.to_json().encode("utf-8"))
    details = report.plan_details(prepared, shown)
    doc = {"schema": "lms.rewrite", "version": 1, "fits": shown.fits, "output": None if dry_run else output,
           "format": written, "dry_run": dry_run, "summary": rep.summary(),
           "swap_outs": rep.swap_outs, "swap_ins": rep.swap_ins, "swap_out_bytes": rep.swap_out_bytes,
           "swap_in_bytes": rep.swap_in_bytes, "recomputes": rep.recomputes, "recompute_bytes": rep.recompute_bytes,
           "host_stacks": rep.host_stacks, "dropped_accumulators": rep.dropped_lists,
           "serial_loops": rep.serial_loops, "control_edges": rep.control_edges,
           "added_nodes": list(rep.added_nodes), "tensorboard_event_file": event_file,
           "time_limited": bool(result is not None and result.time_limited), "plan": plan.to_dict(), **details}
    with progress.phase("drawing", active=bool(plot or report_file)):
        if plot:
            from lmscli.report import plots

            plots.memory_plot(prepared, shown, plot)
        if report_file:
            _write_report(report_file, doc, prepared, shown)
    if result is not None:
        _log(report.tune_log_lines(result), verbose)
    _log([f"[LMS] {rep.summary()}"], verbose)
    if as_json:
        emit_json(doc)
    elif not quiet:
        console = _console(no_color)
        report.render_tune(console, shown, details)
        report.render_rewrite(console, rep, output, dry_run, event_file)
    if not quiet and not plan.stand_in and plan.swaps:
        # (QA: six GPU plans ran out of memory under `lms verify --gpu-mem` at their budgets)
        click.echo("note: a plan made without --stand-in is for a GPU; `lms verify --gpu-mem` runs it on a CPU "
                   "stand-in, where swapped tensors stay until their sends run and it can need more than the "
                   "budget: to prove a plan at its budget there, make it with --stand-in", err=True)


from lmscli.verify_cli import measure, verify  # noqa: E402  (imports no TensorFlow)

cli.add_command(verify)
cli.add_command(measure)


def main(argv=None):
    cli.main(args=argv, prog_name="lms")
