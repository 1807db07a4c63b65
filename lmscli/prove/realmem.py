"""Memory claims proven by real runs on the stand-in GPU (:mod:`lmscli.prove.standin`).

Two questions, each answered by TensorFlow's own allocator under a hard limit:

* :func:`prove_at_limit`: at ``limit`` bytes, does the original run out of memory, does the
  rewrite train, and does it compute bit-identically what the original computes (against the
  original's run without a limit)?
* :func:`measure_need`: the smallest limit, to 1 MiB, under which one training step of a graph
  runs, beside what the simulator predicts for it and Grappler's estimate.

What a CPU stand-in does that a GPU would not (its kernels' scratch; the CPU executor's order,
which queues expensive ops, sends included, last-in first-out) is observed once per graph in a
traced step and reported apart: ``predicted_bytes`` is the GPU prediction (the executor model
in Grappler's first-ready order), ``predicted_standin_bytes`` the stand-in's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from lmscli import timing
from lmscli.timing import timed
from lmscli.errors import EXIT_OUT_OF_MEMORY, LmsError
from lmscli.units import format_size

SCHEMA_VERSION = 1


class RewrittenOutOfMemory(LmsError):
    """The rewritten graph ran out of memory on the stand-in at the limit it was proven at."""

    exit_code = EXIT_OUT_OF_MEMORY


@dataclass(frozen=True)
class Prediction:
    """What the simulator says one step of a graph needs (variables included)."""

    predicted_bytes: int  # the executor model of the optimized graph: what a GPU allocates (tensors, variables)
    predicted_standin_bytes: int  # the same with the CPU stand-in's kernel scratch
    scratch_peak_bytes: int  # the largest scratch one op of the step holds
    grappler_bytes: int | None  # Grappler's static estimate plus variables (a second opinion)


@timed("predict")
def predict(model, batch_size: int | None = None, observation=None, stand_in=None) -> tuple[Prediction, object]:
    """Predict one step of ``model`` (a loaded Model) on a GPU and on the stand-in. The stand-in's
    figure follows what traced steps of that graph on the stand-in show (kernel scratch, the
    CPU executor's order and op times: :meth:`lmscli.prove.standin.StandIn.observe`; the largest
    need over the orders of its traced steps); returns that observation too. ``stand_in``: the
    StandIn to observe on (default: the process's shared one)."""
    from lmscli import api, grappler
    from lmscli.prove import steps
    from lmscli.analysis import RUN_JUDGE_MAX_OPS, run_graph, run_peak_of
    from lmscli.prove.standin import shared
    from lmscli.model.simulator import simulate

    meta, _ = steps.map_gpu_ops(model.meta_graph)
    model = api.Model(model.path, model.format, meta, steps.step_fetches(meta, model.fetches), model.fetch_source,
                      list(model.notes))
    stand_in = stand_in or shared()
    fed = stand_in.feed_values  # (the values the stand-in's steps are fed: loops they bound counted by them)
    prepared = api.prepare(model, batch_size=batch_size, feed_values=fed)
    schedule = prepared.schedule
    prepared_meta = api.with_graph_def(meta, prepared.graph_def)
    run = run_graph(model, prepared_meta, prepared.optimized, prepared.view.tensor_facts(), fed)
    on_gpu = (run_peak_of(run) if run is not None and len(schedule) <= RUN_JUDGE_MAX_OPS
              else simulate(schedule, detail=False).peak_bytes)
    # The stand-in is one device: a graph placed on several GPUs runs all their ops in its one
    # limited process, and is predicted so (a two-tower CNN needs 6 MiB there, 2.5 per GPU).
    # The stand-in runs the graph Grappler makes in its processes, without oneDNN: in a process with
    # oneDNN on, Grappler fuses batch norms with their ReLUs on a CPU, which the stand-in does not.
    optimizer = stand_in.optimizer
    here, here_prepared, here_meta, here_run = model, prepared, prepared_meta, run
    if len(prepared.devices) > 1 or optimizer is not None:
        if len(prepared.devices) > 1:
            here = api.Model(model.path, model.format, steps.on_one_device(meta), tuple(model.fetches),
                             model.fetch_source, list(model.notes))
        here_prepared = api.prepare(here, batch_size=batch_size, optimizer=optimizer, feed_values=fed)
        here_meta = api.with_graph_def(here.meta_graph, here_prepared.graph_def)
        here_run = run_graph(here, here_meta, here_prepared.optimized, here_prepared.view.tensor_facts(), fed)
    # Each graph is observed itself: a rewrite's swap nodes and trigger edges change the order the
    # CPU executor picks. A given observation lends its kernel scratch (the same kernels run).
    observation = stand_in.observe(here_meta, model.fetches,
                                   batch_size=batch_size or 1).lending(observation)
    # The graph TensorFlow runs (Grappler-optimized) when it can be scheduled, else the graph as
    # written.
    # The executor's order varies from run to run and a limit must hold in every run: the largest
    # need over the orders of the traced steps (a residual MLP's rewrite needed 55, 55 and 64 MiB
    # in its three, and measured 60; by the first alone it was predicted 14% low).
    orders = (observation.order,) + tuple(o for o in observation.orders if o)
    if here_run is not None:
        standin = max(run_peak_of(here_run, observation.scratch, order, observation.micros,
                                  orders=observation.orders, scratch_first=observation.scratch_first) for order in orders)
    else:
        standin = max(simulate(here_prepared.observed(order, observation.scratch, observation.micros,
                                                      observation.orders, observation.scratch_first).schedule,
                               detail=False).peak_bytes
                      for order in orders)
    try:
        estimate = grappler.estimate_peak(prepared_meta, model.fetches)
        grappler_bytes = estimate.gpu_peaks.get(schedule.device, estimate.gpu_peak_bytes) + schedule.variable_bytes
    except LmsError:
        grappler_bytes = None
    largest = max((observation.scratch.get(name, 0) for name in schedule.names), default=0)
    return Prediction(on_gpu, standin, largest, grappler_bytes), observation


@dataclass(frozen=True)
class Need:
    """The smallest limit under which one step of a graph runs on the stand-in."""

    path: str
    min_limit_bytes: int
    probes: tuple[tuple[int, bool], ...]
    varies: bool
    seconds: float
    prediction: Prediction

    def to_dict(self) -> dict:
        p = self.prediction
        return {"path": self.path, "min_limit_bytes": self.min_limit_bytes,
                "predicted_bytes": p.predicted_bytes, "predicted_standin_bytes": p.predicted_standin_bytes,
                "scratch_peak_bytes": p.scratch_peak_bytes, "grappler_bytes": p.grappler_bytes,
                "predicted_vs_measured": round(p.predicted_standin_bytes / self.min_limit_bytes, 4),
                "varies": self.varies, "probes": [list(x) for x in self.probes], "seconds": round(self.seconds, 2)}


def run_batch(models, batch_size: int | None) -> int | None:
    """The batch size steps of ``models`` run at on the stand-in, which their predictions must
    use too: ``batch_size``; else 1 where a graph has an unknown batch dimension (its steps are
    fed at 1; predicted with that dimension unknown, its tensors counted 0 bytes, a QA frozen
    graph's need was said to be half what it measured); else None."""
    if batch_size is not None:
        return batch_size
    from lmscli.graph.shapes import set_batch_size

    return 1 if any(set_batch_size(m.graph_def, 1)[1] for m in models) else None


@timed("find the smallest limit")
def measure_need(models, batch_size: int | None = None, runs: int = 3, optimize: bool = True,
                 stand_in=None, observation=None, feed_values: dict | None = None) -> tuple[Need, ...]:
    """The smallest limit (to 1 MiB) under which one step of each of ``models`` runs, each found by
    bisection around the simulator's prediction and confirmed ``runs`` times. Each model's kernel
    scratch is lent to the next (a rewrite runs the same kernels), starting from ``observation``.
    An unknown batch dimension is 1 unless ``batch_size`` says otherwise (:func:`run_batch`).
    ``feed_values``: the user's values for placeholders, for a StandIn made here (``--feed``)."""
    from lmscli.prove.standin import StandIn

    batch_size = run_batch(models, batch_size)
    out = []
    owned = stand_in is None
    stand_in = stand_in or StandIn(optimize=optimize, feed_values=feed_values)
    try:
        for k, model in enumerate(models):
            timing.step(f"{os.path.basename(model.path)} ({k + 1} of {len(models)}): predicting")
            prediction, observation = predict(model, batch_size, observation, stand_in)
            meta = _runnable(model)
            found = stand_in.find_min(meta, tuple(model.fetches), hint_bytes=prediction.predicted_standin_bytes,
                                      batch_size=batch_size or 1, runs=runs)
            out.append(Need(model.path, found.limit_bytes, found.probes, found.varies, found.seconds, prediction))
    finally:
        if owned:
            stand_in.close()
    return tuple(out)


@dataclass(frozen=True)
class LimitProof:
    """Both graphs of a rewrite run at one limit on the stand-in."""

    limit_bytes: int
    original: object  # StepVerdict at the limit
    rewritten: object  # StepVerdict at the limit
    identical: bool | None  # rewritten against the original, both without a limit (what the rewrite computes)
    difference: str | None
    steps: int
    notes: tuple[str, ...] = field(default=())
    # What differs first between the rewritten graph's run under the limit and its own run without
    # one (None: nothing, or not compared): another allocator, so other buffer addresses and, for
    # some kernels, other code paths (QA r40: verify said "bit-identical" and only a note told it).
    limited_difference: str | None = None

    @property
    def proven(self) -> bool:
        """The rewrite trains under the limit, bit-identically."""
        return bool(self.rewritten.fits and self.identical)

    def line(self) -> str:
        """The proof in one line, e.g. ``original: out of memory at 12.00 MiB; rewritten: trains at
        12.00 MiB, bit-identical``."""
        size = format_size(self.limit_bytes)
        first = f"original: {'trains' if self.original.fits else 'out of memory'} at {size}"
        if not self.rewritten.fits:
            return f"{first}; rewritten: out of memory at {size}"
        same = "bit-identical" if self.identical else f"DIFFERENT ({self.difference})"
        if self.identical and self.limited_difference:
            same += " without a limit (under it, the rewrite's results differ from its own without one: see the note)"
        return f"{first}; rewritten: trains at {size}, {same}"

    def to_dict(self) -> dict:
        def verdict(v) -> dict:
            return {"fits": v.fits, "runs": v.runs, "failures": v.failures, "varies": v.varies,
                    "oom_node": v.oom_node, "message": v.message, "seconds": round(v.seconds, 2)}

        return {"limit_bytes": self.limit_bytes, "proven": self.proven, "line": self.line(),
                "original": verdict(self.original), "rewritten": verdict(self.rewritten),
                "identical": self.identical, "first_difference": self.difference, "steps": self.steps,
                "limited_difference": self.limited_difference, "notes": list(self.notes)}


@timed("prove at the limit")
def prove_at_limit(original, rewritten, limit_bytes: int, steps: int = 1, runs: int = 3,
                   batch_size: int | None = None, loss: str | None = None, optimize: bool = True,
                   stand_in=None, feed_values: dict | None = None) -> LimitProof:
    """Run ``original`` and ``rewritten`` (loaded Models) for ``steps`` steps on the stand-in at
    ``limit_bytes``, ``runs`` times each, and both once without a limit (:func:`_unlimited`): the
    rewrite must compute bit for bit what the original computes, and what it computes under the
    limit must be what it computes without one (else a note says so). ``feed_values``: the
    user's values for placeholders, for a StandIn made here (``--feed``)."""
    from lmscli.prove.steps import compare, default_loss, rewrite_batch_size, same_variables
    from lmscli.prove.standin import StandIn, _check_limit

    same_variables(original, rewritten)
    batch_size = rewrite_batch_size(original.meta_graph, rewritten.meta_graph, batch_size)
    fetches = tuple(original.fetches)
    meta_a, meta_b = _runnable(original), _runnable(rewritten)
    loss = loss or default_loss(meta_a)
    batch = batch_size or 1
    owned = stand_in is None
    stand_in = stand_in or StandIn(optimize=optimize, feed_values=feed_values)
    notes = []
    whole = _check_limit(limit_bytes)  # the allocator's limit is set in whole MiB
    if whole != limit_bytes:
        notes.append(f"the stand-in's allocator takes its limit in whole MiB: {limit_bytes:,} bytes run as "
                     f"{format_size(whole)}")
        limit_bytes = whole
    try:
        at_limit = stand_in.run(meta_a, fetches, limit_bytes, batch_size=batch, steps=steps, runs=runs, loss=loss)
        reference = _unlimited(stand_in, meta_a, fetches, limit_bytes, batch, steps, loss)
        rewrite = stand_in.run(meta_b, fetches, limit_bytes, batch_size=batch, steps=steps, runs=runs, loss=loss)
        free = _unlimited(stand_in, meta_b, fetches, limit_bytes, batch, steps, loss)
    finally:
        if owned:
            stand_in.close()
    if at_limit.fits:
        notes.append(f"the original also trains at {format_size(limit_bytes)}: the rewrite is not needed there")
    for label, v in (("original", at_limit), ("rewritten", rewrite)):
        if v.varies:
            notes.append(f"{label}: {v.failures} of {v.runs} runs ran out of memory (the executor's order varies "
                         "between runs); a limit this close to the need is not safe")
    identical = difference = limited = None
    if reference.result is not None and free.result is not None:
        # What the rewrite computes: both graphs without a limit, bit for bit.
        diff = compare(reference.result, free.result)
        identical, difference = diff is None, (diff.message if diff else None)
    if identical and rewrite.fits and rewrite.result is not None:
        squeezed = compare(free.result, rewrite.result)
        if squeezed is not None:
            limited = squeezed.message
            notes.append(f"at {format_size(limit_bytes)} the rewritten graph's results differ from its own run without a "
                         f"limit ({squeezed.message}): the same graph computes differently with and without the "
                         "limit (other buffer addresses and, for some kernels, other code paths), not because of "
                         "the rewrite, which computes bit-identically")
    return LimitProof(limit_bytes, at_limit, rewrite, identical, difference, steps, tuple(notes), limited)


REFERENCE_REGION = 8 << 30  # the allocator's one region in a run "without a limit" (untouched pages cost nothing)


def _unlimited(stand_in, meta, fetches, limit_bytes: int, batch: int, steps: int, loss):
    """One run of ``meta`` as good as without a limit, in the allocator's mode of the runs under
    one: a region of :data:`REFERENCE_REGION` bytes (or four times the limit, if more) given at
    the start, as a GPU's allocator has. Run with no limit at all, TensorFlow's allocator grows
    regions as it needs them, and a graph computed differently in its last bits there (QA r48: a
    dropout MLP's loss 3.3383512 under 20 MiB, 64 MiB, 1 GiB and 4 GiB alike, 3.338351 with a
    growing allocator; three of four new graphs' proofs read "bit-identical without a limit"
    only). A step that needs more than that region runs with no limit."""
    region = max(REFERENCE_REGION, 4 * limit_bytes)
    verdict = stand_in.run(meta, fetches, region, batch_size=batch, steps=steps, runs=1, loss=loss)
    if verdict.fits:
        return verdict
    return stand_in.run(meta, fetches, None, batch_size=batch, steps=steps, runs=1, loss=loss)


def _runnable(model):
    """The model's MetaGraphDef as the stand-in takes it (it maps Grappler's GPU-only copy ops to
    Identity on the side their output lives on, so a copy still leaves the limited process)."""
    return model.meta_graph
