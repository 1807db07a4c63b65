"""Click options shared by the commands (no TensorFlow). Checks: a malformed value is a usage
error (exit 2, Click's own message), caught before any graph is loaded; values are checked but
kept as written (a percentage is resolved once the graph's peak is known). And the command's
clock: ``--profile``, ``--profile-out`` (:func:`profile_options`)."""

from __future__ import annotations

import json
import os
import sys
import time
from functools import wraps

import click

from lmscli.errors import InputError


def size_text(ctx, param, value):
    """A ``SIZE`` option: ``16GiB``, ``32GB``, ``1.5e9``."""
    from lmscli.units import parse_size

    return _checked(value, parse_size)


def gpu_mem_text(ctx, param, value):
    """``--gpu-mem``: a ``SIZE``, or ``N%`` of the graph's no-swap peak."""
    from lmscli.device import gpu_mem_from_text

    def parse(text):
        size = gpu_mem_from_text(text, 1 << 40)  # (a percentage is checked by its range)
        if size <= 0:
            raise InputError(f"--gpu-mem must be at least 1 byte: {text!r}")

    return _checked(value, parse)


def link_text(ctx, param, value):
    """``--link``: a link's name (``pcie3``) or its bandwidth (``25GB/s``)."""
    from lmscli.device import resolve_link

    return _checked(value, resolve_link)


def _checked(value, parse):
    if value is None:
        return None
    try:
        parse(value)
    except InputError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def feed_values(ctx, param, value) -> dict:
    """``--feed NAME=VALUE`` (repeatable): a placeholder's value in the steps lms runs, filling its
    shape: ``true``/``false``, an integer or a number (``--feed seq_len=128 --feed keep_prob=0.9``)."""
    out: dict = {}
    for text in value or ():
        name, sep, raw = text.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name or not raw:
            raise click.BadParameter(f"{text!r}: give NAME=VALUE, e.g. seq_len=128", ctx=ctx, param=param)
        if name in out:
            raise click.BadParameter(f"{name} is given twice", ctx=ctx, param=param)
        out[name] = _feed_number(raw, ctx, param)
    return out


def _feed_number(raw: str, ctx, param):
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        number = float(raw)
    except ValueError:
        raise click.BadParameter(f"{raw!r} is not true, false or a number", ctx=ctx, param=param) from None
    if number != number or number in (float("inf"), float("-inf")):
        raise click.BadParameter(f"{raw!r} is not a finite number", ctx=ctx, param=param)
    return number


FEED_HELP = ("Feed placeholder NAME the value VALUE (true, false, an integer or a number, filling its shape) in "
             "the steps lms runs, instead of lms's own: a sequence length, a count, a keep probability. Repeatable.")


def feed_option(func):
    """``--feed NAME=VALUE`` (repeatable), given to the command as ``feed_values`` (a dict)."""
    return click.option("--feed", "feed_values", multiple=True, metavar="NAME=VALUE", callback=feed_values,
                        help=FEED_HELP)(func)


JSON_ASKED = "lms.json"  # click context meta: the command was given --json
JSON_PRINTED = "lms.json_printed"  # ... and has printed its document


def emit_json(data: dict) -> None:
    """Print the command's one JSON document on stdout (and remember that it did: an error after
    it, such as verify's exit 4, adds no error document)."""
    click.get_current_context().meta[JSON_PRINTED] = True
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def error_document(meta: dict, command: str | None, exit_code: int, kind: str, message: str) -> str | None:
    """With ``--json``, a failure with no document printed is a document too (schema ``lms.error``),
    so that a CI job reading stdout gets one for every result; None without ``--json`` or when
    the command printed its own."""
    if not meta.get(JSON_ASKED) or meta.get(JSON_PRINTED):
        return None
    return json.dumps({"schema": "lms.error", "version": 1, "command": command, "exit_code": exit_code,
                       "error": {"type": kind, "message": message}}, indent=2)


def profile_options(func):
    """``--profile`` and ``--profile-out``: the command runs under a :class:`lmscli.timing.Clock`
    (with the deadline of ``--time-limit``, for the commands that have it), and where its time went,
    phase by phase, is printed on stderr or written as JSON (schema lms.profile) when it ends."""

    @click.option("--profile", is_flag=True, help="When done, print on stderr where the time went, phase by phase.")
    @click.option("--profile-out", type=click.Path(dir_okay=False), metavar="FILE.json",
                  help="When done, write where the time went as JSON (schema lms.profile).")
    @wraps(func)
    def wrapper(*args, profile=False, profile_out=None, **kwargs):
        from lmscli.timing import Clock

        if kwargs.get("as_json"):
            click.get_current_context().meta[JSON_ASKED] = True
        limit = kwargs.pop("time_limit", None)
        clock = Clock(deadline=None if limit is None else time.monotonic() + limit)
        try:
            with clock:
                return func(*args, **kwargs)
        finally:
            if profile:
                _print_profile(clock, kwargs.get("no_color", False))
            if profile_out:
                from lmscli.loader import atomic_write

                doc = {"schema": "lms.profile", "version": 1, "command": click.get_current_context().info_name,
                       **clock.to_dict()}
                atomic_write(profile_out, (json.dumps(doc, indent=2) + "\n").encode("utf-8"))

    return wrapper


def _print_profile(clock, no_color: bool) -> None:
    """--profile: each phase's calls and seconds, nested as they ran (inner phases are part of the
    outer ones' time), and the whole command's wall time."""
    from rich.table import Table

    table = Table(title=f"time by phase ({clock.elapsed():.2f} s since the command started)", title_justify="left")
    table.add_column("phase")
    table.add_column("calls", justify="right")
    table.add_column("seconds", justify="right")
    for total in clock.table():
        table.add_row("  " * total.depth + total.name, str(total.calls), f"{total.seconds:.2f}")
    console(no_color, stderr=True).print(table)


def console(no_color: bool, stderr: bool = False):
    """The rich Console a command renders on: plain text under --no-color or NO_COLOR (no colour,
    no bold or dim either), lines left whole when not on a terminal."""
    from rich.console import Console

    color = not no_color and "NO_COLOR" not in os.environ
    return Console(stderr=stderr, no_color=not color, color_system="auto" if color else None, highlight=False,
                   soft_wrap=not (sys.stderr if stderr else sys.stdout).isatty())
