"""The ``lms`` command line: load -> library calls -> render. No computation lives here.

Exit codes (also in the README): 0 success; 1 bad input or a failed run; 2 usage error;
3 no plan fits the budget.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from functools import wraps

import click

from lmscli import __version__
from lmscli.errors import EXIT_ERROR, LmsError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class LmsGroup(click.Group):
    """Turns library errors into one line on stderr and the documented exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LmsError as exc:
            if _debug(ctx):
                traceback.print_exc()
            click.echo(f"lms: error: {exc}", err=True)
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
            click.echo(f"lms: error: unexpected {type(exc).__name__}: {first} (run with --debug for a traceback)",
                       err=True)
            ctx.exit(EXIT_ERROR)


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
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


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
    @wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def _console(no_color: bool, stderr: bool = False):
    from rich.console import Console

    color = not no_color and "NO_COLOR" not in os.environ
    return Console(stderr=stderr, no_color=not color, highlight=False,
                   soft_wrap=not (sys.stderr if stderr else sys.stdout).isatty())


def _load(path, fmt, fetch, tag):
    from lmscli import api

    return api.load(path, fmt=fmt, fetch=fetch.split(",") if fetch else None, tag=tag)


def _emit_json(data: dict) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def _log(lines, verbose: bool) -> None:
    if verbose:
        for line in lines:
            click.echo(line, err=True)


# ---------------------------------------------------------------- commands
@cli.command(context_settings=CONTEXT)
@click.argument("model", type=click.Path())
@model_options
@output_options
def analyze(model, fmt, fetch, tag, batch_size, as_json, verbose, quiet, no_color):
    """Report a graph's size, levels, largest operation and peak memory without swapping."""
    from lmscli import api, report

    loaded = _load(model, fmt, fetch, tag)
    prepared = api.prepare(loaded, batch_size=batch_size)
    result = api.analyze(prepared)
    _log(report.analysis_log_lines(result), verbose)
    if as_json:
        _emit_json(result.to_dict())
    elif not quiet:
        report.render_analysis(_console(no_color), result)


def main(argv=None):
    cli.main(args=argv, prog_name="lms")
