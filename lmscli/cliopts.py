"""Click option checks shared by the commands (no TensorFlow): a malformed value is a usage
error (exit 2, Click's own message), caught before any graph is loaded."""

from __future__ import annotations

import click

from lmscli.errors import InputError


def size_text(ctx, param, value):
    """A ``SIZE`` option (``16GiB``, ``1.5e9``, or ``N%`` where the option allows it), checked but
    kept as written: a percentage is resolved once the graph's peak is known."""
    from lmscli.device import gpu_mem_from_text
    from lmscli.units import parse_size

    if value is None:
        return None
    try:
        if param.name == "gpu_mem":
            gpu_mem_from_text(value, 1)
        else:
            parse_size(value)
    except InputError as exc:
        raise click.BadParameter(str(exc)) from None
    return value
