"""A transient status line on stderr during the long passes, shown only on a terminal.

The line names the command's pass ("tuning"), what the library is doing inside it (the phase and
step it reports through :mod:`lmscli.timing`: "judge", "round 3: planning for 1.2 GiB") and the
seconds since the pass began. Off when stderr is not a TTY, and with ``--quiet`` or ``--json``:
piped and machine-read output never carries a spinner. The line disappears when the pass ends.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager


class Progress:
    """``with progress.phase("tuning"):`` shows a spinner and the phase while the block runs."""

    def __init__(self, console=None):
        self.console = console  # a Rich Console on stderr, or None for no status line
        self._status = None
        self._text = ""
        self._since = 0.0
        if console is not None:
            from lmscli import timing

            clock = timing.current()
            if clock is not None:
                clock.listener = self.detail

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
        self._text, self._since = text, time.monotonic()
        with self.console.status(text, spinner="dots") as status:
            self._status = status
            try:
                yield
            finally:
                self._status = None

    def detail(self, text: str) -> None:
        """What the library reports doing now, shown after the pass's own text."""
        if self._status is not None:
            from rich.markup import escape

            seconds = time.monotonic() - self._since
            self._status.update(f"{escape(self._text)} [dim]· {escape(text)} · {seconds:.0f} s[/]")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
