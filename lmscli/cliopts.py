"""Click option checks shared by the commands (no TensorFlow): a malformed value is a usage
error (exit 2, Click's own message), caught before any graph is loaded. Values are checked but
kept as written: a percentage is resolved once the graph's peak is known."""

from __future__ import annotations

import click

from lmscli.errors import InputError


def size_text(ctx, param, value):
    """A ``SIZE`` option: ``16GiB``, ``32GB``, ``1.5e9``."""
    from lmscli.units import parse_size

    return _checked(value, parse_size)


def gpu_mem_text(ctx, param, value):
    """``--gpu-mem``: a ``SIZE``, or ``N%`` of the graph's no-swap peak."""
    from lmscli.device import gpu_mem_from_text

    return _checked(value, lambda text: gpu_mem_from_text(text, 1))


def _checked(value, parse):
    if value is None:
        return None
    try:
        parse(value)
    except InputError as exc:
        raise click.BadParameter(str(exc)) from None
    return value
