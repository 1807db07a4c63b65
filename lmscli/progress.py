"""A transient status line on stderr during the long passes, shown only on a terminal.

Off when stderr is not a TTY, and with ``--quiet`` or ``--json``: piped and machine-read output
never carries a spinner. The line disappears when the pass ends (Rich's ``transient`` live display).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager


class Progress:
    """``with progress.phase("tuning"):`` shows a spinner and the phase while the block runs."""

    def __init__(self, console=None):
        self.console = console  # a Rich Console on stderr, or None for no status line

    @classmethod
    def for_output(cls, quiet: bool = False, as_json: bool = False, no_color: bool = False,
                   stream=None) -> "Progress":
        stream = sys.stderr if stream is None else stream
        if quiet or as_json or not _isatty(stream):
            return cls(None)
        from rich.console import Console

        color = not no_color and "NO_COLOR" not in os.environ
        return cls(Console(file=stream, no_color=not color, highlight=False))

    @property
    def enabled(self) -> bool:
        return self.console is not None

    @contextmanager
    def phase(self, text: str, active: bool = True):
        """Show ``text`` while the block runs (``active=False``: run the block, show nothing)."""
        if self.console is None or not active:
            yield
            return
        with self.console.status(text, spinner="dots"):
            yield


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
