"""One error family for the whole library, and the exit-code table.

The library raises these; only the CLI turns them into exit codes.

| code | meaning                                              |
|------|------------------------------------------------------|
| 0    | success                                              |
| 1    | bad input or a failed run (:class:`LmsError`)        |
| 2    | usage error (Click's own)                            |
| 3    | no plan fits the budget (:class:`NoFitError`)        |
| 4    | ``lms verify``: the graphs compute different results |
| 5    | ``lms verify --gpu-mem``: the rewritten graph ran out of memory on the stand-in GPU at that limit |
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_FIT = 3
EXIT_DIFFERENT = 4
EXIT_OUT_OF_MEMORY = 5


class LmsError(Exception):
    """Base of every error the library raises on purpose; the message says what to do."""

    exit_code = EXIT_ERROR


class InputError(LmsError):
    """The input file or directory cannot be read as a graph."""


class MissingFetchError(InputError):
    """A fetch names no node of the graph (``node``: the first one missing)."""

    def __init__(self, message: str, node: str):
        super().__init__(message)
        self.node = node


class GraphError(LmsError):
    """The graph is readable but malformed (dangling inputs, duplicate names, cycles)."""


class PlanError(LmsError):
    """A plan file is malformed or does not match the graph it is applied to."""


class NoFitError(LmsError):
    """No swap plan fits the budget. A result, not a crash. ``bound_bytes``: the lower bound of
    the step's order; ``binding_op``: the op where the step needs most even with every possible
    swap (or where planning got stuck); ``budget_bytes``: the budget that was asked for."""

    exit_code = EXIT_NO_FIT

    def __init__(self, message: str, bound_bytes: int | None = None, binding_op: str | None = None,
                 budget_bytes: int | None = None):
        super().__init__(message)
        self.bound_bytes = bound_bytes
        self.binding_op = binding_op
        self.budget_bytes = budget_bytes
        self.log: tuple[str, ...] = ()  # the planner's [LMS] lines up to the answer (shown with -v)
        self.closest_bytes: int | None = None  # the least a judged plan needed, when every one was over

    def to_dict(self) -> dict:
        """The answer as JSON fields (``no_fit`` in the documents of ``tune`` and ``rewrite``)."""
        return {"reason": str(self), "budget_bytes": self.budget_bytes, "lower_bound_bytes": self.bound_bytes,
                "binding_op": self.binding_op, "closest_bytes": self.closest_bytes}
