"""A function run in a forked child process, on a second core, beside the caller's own work.

Grappler's optimizer and its scheduler hold Python's lock for their whole run (11 and 7 s on a
60,000-node graph), so threads cannot overlap them with each other or with shape inference; a
forked child can::

    parent:  fork --> fork --> shape inference ..........--> wait --> wait
    child 1:          Grappler's optimizations ------------> result (pickled, through a pipe)
    child 2:                   Grappler's scheduler -------> result

Forking is safe only before TensorFlow's runtime has started thread pools (a fork copies them
in whatever state they are in): :func:`start` forks only while the process runs no more threads
than after importing TensorFlow and reading a graph, on systems with ``fork`` and ``/proc``;
otherwise, or when the child fails, the function runs in the caller when its result is asked for.
An :class:`~lmscli.errors.LmsError` the function raises in the child is raised in the caller.
``LMS_NO_FORK=1`` turns forking off.
"""

from __future__ import annotations

import os
import pickle

from lmscli import timing
from lmscli.errors import LmsError

FORK_MAX_THREADS = 2  # a process that has only imported TensorFlow and parsed graphs runs 2 threads


def may_fork() -> bool:
    if os.environ.get("LMS_NO_FORK") == "1" or not hasattr(os, "fork"):
        return False
    try:
        return len(os.listdir("/proc/self/task")) <= FORK_MAX_THREADS
    except OSError:
        return False


def start(label: str, func, *args) -> "Pending":
    """Start ``func(*args)`` in a child process when :func:`may_fork`; the caller's wait for its
    result is timed as phase ``label``."""
    if not may_fork():
        return Pending(label, func, args)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, send the result, leave without running the parent's exit code
        code = 1
        try:
            os.close(read_end)
            timing.detach()
            try:
                outcome = ("return", func(*args))
            except LmsError as exc:
                outcome = ("raise", exc)
            data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write_end, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    return Pending(label, func, args, pid, read_end)


class Pending:
    """The result of :func:`start`: from the child process, or computed here on demand."""

    def __init__(self, label: str, func, args, pid: int | None = None, pipe: int | None = None):
        self.label, self.func, self.args, self.pid, self.pipe = label, func, args, pid, pipe

    def __call__(self):
        if self.pid is None:
            return self.func(*self.args)
        with timing.phase(self.label):
            with os.fdopen(self.pipe, "rb") as pipe:
                data = pipe.read()
            _, status = os.waitpid(self.pid, 0)
        self.pid = None
        try:
            kind, value = pickle.loads(data) if status == 0 and data else (None, None)
        except Exception:
            kind = None
        if kind is None:  # the child failed: compute it here (raising what the child met, if anything)
            return self.func(*self.args)
        if kind == "raise":
            raise value
        return value

    def cancel(self) -> None:
        """Give up on the result (the child, if any, is killed and reaped)."""
        if self.pid is None:
            return
        import signal

        os.kill(self.pid, signal.SIGKILL)
        os.close(self.pipe)
        os.waitpid(self.pid, 0)
        self.pid = None
