"""Where a command's time goes: named phases, recorded by the library, shown by the CLI.

The library marks its expensive steps with ``@timed("Grappler's optimizations")`` (or ``with
phase(...)``) and reports what it is trying with ``step("round 2: ...")``. Both cost nothing unless a
:class:`Clock` is active (``with Clock(listener) as clock:``): the CLI activates one to drive its
progress line and ``--profile``; benchmarks activate one to print a per-phase table. Phases nest;
the time of a phase includes the phases inside it. The clock also carries an optional deadline
(``--time-limit``), which the tune loop asks about through :func:`out_of_time`.
"""

from __future__ import annotations

import contextvars
import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

_CLOCK: contextvars.ContextVar = contextvars.ContextVar("lms_clock", default=None)


@dataclass
class PhaseTotal:
    path: tuple  # the phase's name, after the names of the phases it ran inside
    calls: int = 0
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def depth(self) -> int:
        return len(self.path) - 1


@dataclass
class Clock:
    """Records phases; ``listener(text)`` hears every phase start and step (for a progress line).
    ``deadline`` is a :func:`time.monotonic` value after which :func:`out_of_time` is true;
    ``round_s`` the longest check of a plan so far (:func:`round_took`)."""

    listener: object = None
    deadline: float | None = None
    round_s: float = 0.0
    totals: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    _stack: list = field(default_factory=list)
    _token: object = None

    def __enter__(self) -> "Clock":
        self._token = _CLOCK.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _CLOCK.reset(self._token)

    def tell(self, text: str) -> None:
        if self.listener is not None:
            self.listener(text)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def table(self) -> list[PhaseTotal]:
        """Phases in the order they first ran."""
        return list(self.totals.values())

    def to_dict(self) -> dict:
        return {"total_s": round(self.elapsed(), 3),
                "phases": [{"phase": " / ".join(p.path), "calls": p.calls, "seconds": round(p.seconds, 3)}
                           for p in self.table()]}


@contextmanager
def phase(name: str):
    """Time the block as phase ``name`` when a clock is active: summed over the calls made inside
    the same enclosing phases (``shapes`` inside ``judge`` is apart from ``shapes`` at the top)."""
    clock = _CLOCK.get()
    if clock is None:
        yield
        return
    path = (*clock._stack, name)
    total = clock.totals.get(path)
    if total is None:
        total = clock.totals[path] = PhaseTotal(path)
    clock._stack.append(name)
    clock.tell(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        total.calls += 1
        total.seconds += time.perf_counter() - start
        clock._stack.pop()
        if clock._stack:
            clock.tell(clock._stack[-1])


def step(text: str) -> None:
    """Say what is being tried now (a progress line shows it beside the current phase)."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.tell(f"{clock._stack[-1]}: {text}" if clock._stack else text)


def out_of_time() -> bool:
    """Would one more check of a plan, as long as the longest so far (:func:`round_took`), end
    past the active clock's deadline? (Work started before the deadline runs on past it: a round
    of the stand-in's real runs, up to tens of seconds.) False without a clock or a deadline."""
    clock = _CLOCK.get()
    return clock is not None and clock.deadline is not None and time.monotonic() + clock.round_s >= clock.deadline


def round_took(seconds: float) -> None:
    """A check of a plan (the judge: on the stand-in, real runs) took ``seconds``."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.round_s = max(clock.round_s, seconds)


def timed(name: str):
    """Decorator: the function's calls are phase ``name``."""
    def wrap(func):
        @functools.wraps(func)
        def timed_call(*args, **kwargs):
            with phase(name):
                return func(*args, **kwargs)
        return timed_call
    return wrap


def current() -> Clock | None:
    return _CLOCK.get()


def detach() -> None:
    """Forget the active clock (in a forked child: its progress line belongs to the parent)."""
    _CLOCK.set(None)
