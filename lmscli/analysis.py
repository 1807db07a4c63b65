"""The analysis pass: what the graph is and how much memory one training step needs without swapping.

``prepare()`` turns a loaded :class:`~lmscli.loader.Model` into a :class:`Prepared` graph (shapes
inferred, batch size applied, execution schedule built); ``analyze()`` derives an immutable
:class:`Analysis` from it. Both are pure with respect to their inputs.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import asdict, dataclass, field, replace

from lmscli.plan import hoststacks
from lmscli.plan.candidates import Filters, candidates
from lmscli.errors import InputError
from lmscli.graph.graphview import PLACEHOLDER_OPS, SHAPE_OPS, VARIABLE_OPS, GraphView, TensorInfo
from lmscli.loader import Model
from lmscli.model.schedule import (STORAGE_OUTPUT, Schedule, build_schedules, loop_counts, storage_bytes,
                                   variable_bytes)
from lmscli.model.simulator import SimResult, simulate
from lmscli.timing import timed

SCHEMA_VERSION = 1
RUN_JUDGE_MAX_OPS = 8_000  # above this, plans are judged on the graph as written (tool speed)


@dataclass(frozen=True)
class Prepared:
    """A model ready for the passes: the view with shapes, and the step's schedule."""

    model: Model
    graph_def: object  # the GraphDef the view describes (batch size applied)
    view: GraphView
    schedule: Schedule
    batch_size: int | None
    batched_placeholders: tuple[str, ...]
    fused: frozenset = frozenset()  # nodes Grappler's default optimizations remove (never swapped)
    schedules: tuple = ()  # one Schedule per GPU the step uses; ``schedule`` is the one needing most
    optimized: object = None  # the GraphDef Grappler's default optimizations make (None: refused)
    scratch: object = None  # node name -> kernel scratch bytes counted in the schedules (the CPU stand-in's)
    scratch_first: frozenset = frozenset()  # ops of ``scratch`` that take it before their outputs
    trace: object = None  # Grappler's trace the schedules were built from (None: roofline model)
    observed_order: tuple = ()  # an execution order observed in a real run, followed by the schedules
    observed_micros: object = None  # op times observed in that run (node name -> microseconds)
    observed_orders: tuple = ()  # orders of other traced steps (how far loop iterations ran ahead)
    dead: frozenset = frozenset()  # ops of the step Grappler prunes as unused, left out of the schedules
    untaken: frozenset = frozenset()  # ops of the smaller branch of each v1 cond, left out likewise
    # The StandIn a step prepared for the stand-in was observed on; its plans are judged there.
    stand_in: object = field(default=None, compare=False, repr=False)
    judge_runs: int | None = None  # fresh runs per limit of the stand-in's judge (None: its default)

    @functools.cached_property
    def run_peak_bytes(self) -> int | None:
        """The executor model's peak of the graph a Session runs for this step (Grappler's
        optimizations applied; see :func:`run_peak`); None if unknown, or for steps of more than
        :data:`RUN_JUDGE_MAX_OPS` ops (scheduling the optimized graph again costs tens of seconds
        there; the graph as written is judged instead)."""
        if len(self.schedule) > RUN_JUDGE_MAX_OPS and not self.observed_order:
            return None
        return run_peak(self.model, with_graph_def(self.model.meta_graph, self.graph_def), self.optimized,
                        self.scratch, self.observed_order, self.observed_micros, known=self.view.tensor_facts(),
                        orders=self.observed_orders, scratch_first=self.scratch_first, fed=self.view.fed)

    def with_scratch(self, scratch: dict, first=frozenset()) -> "Prepared":
        """The same step with each op's kernel scratch (node name -> bytes) counted while it runs,
        taken before the op's outputs by the ops named in ``first``."""
        schedules = tuple(s.with_scratch(scratch, first) for s in self.schedules)
        chosen = next((s for s in schedules if s.device == self.schedule.device),
                      self.schedule.with_scratch(scratch, first))
        return replace(self, schedule=chosen, schedules=schedules, scratch=dict(scratch),
                       scratch_first=frozenset(first))

    def observed(self, order, scratch: dict | None = None, micros: dict | None = None, orders=(),
                 scratch_first=frozenset()) -> "Prepared":
        """The same step in an execution order observed in a real run on the stand-in (op names; ops
        the run did not show run as soon as they are ready), with kernel scratch and op times if
        given, and the stand-in's executor (:meth:`Schedule.on_stand_in`). Loop iterations
        running at once hold what ``order`` and the ``orders`` of other traced steps show at most
        (:attr:`Schedule.ahead`)."""
        trace = self.trace.observed(order, micros) if self.trace is not None else None
        if trace is None:
            schedules = tuple(s.on_stand_in() for s in self.schedules)
            chosen = self.schedule.on_stand_in()
            return replace(self, schedule=chosen, schedules=schedules).with_scratch(scratch or {}, scratch_first)
        from lmscli.model.loops import running_ahead

        schedules = tuple(s.without(self.dead | self.untaken).on_stand_in() for s in build_schedules(
            self.view, self.model.fetches, trace=trace, memory_model=self.schedule.memory_model))
        schedules = tuple(running_ahead(s, self.view, order, *orders) for s in schedules)
        chosen = next((s for s in schedules if s.device == self.schedule.device), schedules[0])
        seen = replace(self, schedule=chosen, schedules=schedules, observed_order=tuple(order),
                       observed_micros=dict(micros or {}), observed_orders=tuple(orders))
        return seen.with_scratch(scratch or {}, scratch_first)

    @functools.cached_property
    def optimized_on_cpu(self):
        """What Grappler's default optimizations make of this step placed on CPUs, as ``lms verify``
        runs it (see :func:`grappler_on_cpu`); None for a step prepared for the stand-in (its
        :attr:`optimized` is that already) or when Grappler refuses the graph."""
        if self.stand_in is not None or self.optimized is None:
            return None
        return self.grappler_on_cpu(with_graph_def(self.model.meta_graph, self.graph_def))

    def grappler_on_cpu(self, meta_graph):
        """What Grappler's default optimizations but the remapper's make of ``meta_graph`` placed as
        ``lms verify`` runs a step, every op on a CPU. Some rewrites are made on CPUs only
        (``x ** 3`` becomes ``x * Square(x)``, whose Square then merges with an equal one: the
        GELU's with its gradient's), so a control edge that stops the merge changes the results
        there though the graph a GPU runs is the same. (The remapper's fusions are left out here:
        those a GPU makes are the first comparison's, and one a CPU makes that a swap stops (a
        matrix product with its bias add, reading a swap-in from the other device) trained
        bit-identically.)"""
        from lmscli import grappler
        from lmscli.prove.steps import place_on_cpu

        return grappler.optimize(place_on_cpu(meta_graph).meta_graph, self.model.fetches, remapping=False)

    def grappler(self, meta_graph):
        """What Grappler's default optimizations make of ``meta_graph`` (this step, or a rewrite of
        it) where the step is to run: for a step prepared for the stand-in, in the stand-in's
        processes when this one's Grappler fuses otherwise (oneDNN on here; see
        :meth:`lmscli.prove.standin.StandIn.grappler`); else in this process. None if Grappler
        refuses the graph."""
        from lmscli import grappler

        optimizer = self.stand_in.optimizer if self.stand_in is not None else None
        return (optimizer or grappler.optimize)(meta_graph, self.model.fetches)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(s.device for s in self.schedules) or (self.schedule.device,)

    def for_device(self, device: str) -> "Prepared":
        """The same model seen by one of its GPUs (what a per-device plan is made from)."""
        for schedule in self.schedules:
            if schedule.device == device:
                return replace(self, schedule=schedule, schedules=(schedule,))
        raise InputError(f"the step runs no op on {device!r} (devices: {', '.join(self.devices)})")


@timed("prepare")
def prepare(model: Model, batch_size: int | None = None, cost_model: str = "grappler",
            flops: float = 15.7e12, mem_bandwidth: float = 900e9, judge: str = "executor",
            optimize: bool = True, prune_dead: bool | None = None, known: dict | None = None,
            runtime_folding: bool | None = None, optimizer=None, feed_values: dict | None = None) -> Prepared:
    """Infer shapes (applying ``batch_size`` to unknown placeholder batch dims) and build the schedule.

    ``cost_model="grappler"`` orders and times ops by Grappler's virtual scheduler on a virtual
    GPU (TensorFlow's own analytical model); ``"roofline"`` uses our FLOP/byte model. If Grappler
    cannot schedule the graph, the roofline model is used and a note says so. ``judge`` is the
    memory model the schedule is counted by (:mod:`lmscli.model.memmodel`): ``executor`` (what a real
    run allocates) or ``grappler`` (TensorFlow's static estimate). ``optimize=False`` skips
    computing what Grappler's default optimizations make of the graph (the optimizer guard needs it).
    ``prune_dead`` (default: under the executor judge) leaves out of the schedule the ops those
    optimizations prune as unused (:func:`lmscli.grappler.dead_nodes`): a Session never runs them,
    and in the graph as written they hold tensors into the backward pass; and the smaller branch
    of each v1 cond (:meth:`GraphView.untaken_branches`), as a step runs one. ``known``: tensor
    facts by node name (of the graph as written) for outputs whose size inference leaves unknown
    (Grappler's rewrite of a v1 loop can defeat TensorFlow's shape inference inside it).
    ``runtime_folding`` (default: under the executor judge): count what TensorFlow's runtime folds
    into constants when it builds the step's executors (:mod:`lmscli.graph.constfold`): after
    Grappler on the graph a session runs; on the graph as written, what either of them would fold.
    ``optimizer(meta_graph, fetches)``: what runs Grappler's default optimizations (default:
    :func:`lmscli.grappler.optimize` in a second process; the stand-in's run them in its own).
    ``feed_values``: placeholder values the steps are fed (``--feed``): loops bounded by them are
    counted by them (:meth:`GraphView.with_fed`).
    """
    from lmscli.graph import shapes

    if cost_model not in ("grappler", "roofline"):
        raise InputError(f"unknown cost model {cost_model!r} (use grappler or roofline)")
    if judge not in ("executor", "grappler"):
        raise InputError(f"unknown judge {judge!r} (use executor or grappler)")
    graph_def = model.graph_def
    changed: list[str] = []
    if batch_size is not None:
        graph_def, changed = shapes.set_batch_size(graph_def, batch_size)
        unused = (f"--batch-size {batch_size} changes nothing: no placeholder of the graph has an unknown batch "
                  "dimension, and the figures are for the batch it was built with")
        if not changed and unused not in model.notes:  # (QA r52: "batch size 3" beside figures of batch 8)
            model.notes.append(unused)
    from lmscli import grappler

    meta = with_graph_def(model.meta_graph, graph_def) if changed else model.meta_graph
    # (Grappler in a second process, beside the work below; a given optimizer runs in its own)
    pending = grappler.optimize_in_parallel(meta, model.fetches) if optimize and optimizer is None else None
    try:
        tensors = shapes.infer(graph_def)
        if known:
            tensors = _filled(tensors, known)
        if not changed and model.structure is not None and model.structure.size == len(graph_def.node):
            view = model.structure.with_tensors(tensors)
        else:
            view = GraphView(graph_def, tensors)
        if feed_values:
            _check_fed(view, feed_values)
            view = view.with_fed(feed_values)
        for name in model.fetches:
            if name not in view.index:
                raise InputError(f"fetch {name!r} is not a node of the graph")
        trace = None
        if cost_model == "grappler":
            from lmscli.errors import LmsError

            try:
                trace = grappler.trace(meta, model.fetches)
            except LmsError as exc:
                model.notes.append(f"{exc}; ordering ops with the roofline cost model instead")
            else:
                view = _with_shapes(view, trace.shapes)
        schedules = build_schedules(view, model.fetches, flops=flops, mem_bandwidth=mem_bandwidth, trace=trace,
                                    memory_model=judge)
        schedule = schedules[0]
        if len(schedules) > 1:  # the GPU that needs the most memory speaks for the graph
            schedule = max(schedules, key=lambda s: simulate(s, detail=False).peak_bytes)
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    if pending is not None:
        optimized = pending()
    else:
        optimized = optimizer(meta, model.fetches) if optimize and optimizer is not None else None
    fused = grappler.fused_away(meta.graph_def, optimized)
    dead = untaken = frozenset()
    if prune_dead if prune_dead is not None else judge == "executor":
        pruned = grappler.dead_nodes(meta.graph_def, optimized, model.fetches) | grappler.folded_shapes(
            meta.graph_def, fused)
        dead = frozenset(view.names[i] for i in schedule.nodes if view.names[i] in pruned)
        untaken = frozenset(view.names[i] for i in view.untaken_branches(
            i for i in schedule.nodes if view.names[i] not in dead))
        if dead or untaken:
            schedules = tuple(s.without(dead | untaken) for s in schedules)
            schedule = next(s for s in schedules if s.device == schedule.device)
    if runtime_folding if runtime_folding is not None else judge == "executor":
        from lmscli.graph.constfold import runtime_constants

        folded = runtime_constants(view, gone=frozenset(view.index[name] for name in dead | untaken))
        if folded:  # (the same order: only what is resident changes)
            view = view.with_runtime_constants(folded)
            schedules = tuple(s.without(dead | untaken) for s in build_schedules(
                view, model.fetches, flops=flops, mem_bandwidth=mem_bandwidth, trace=trace, memory_model=judge))
            schedule = next(s for s in schedules if s.device == schedule.device)
    return Prepared(model, graph_def, view, schedule, batch_size, tuple(changed), fused, schedules, optimized,
                    trace=trace, dead=dead, untaken=untaken)


def _with_shapes(view: GraphView, shapes: dict) -> GraphView:
    """``view`` with the outputs TensorFlow's shape inference leaves unknown given the shapes
    Grappler's inference found (``(node, output) -> dims``, fully known), where they agree with
    what is known. Grappler iterates loops to a fixed point: in a lowered functional ``While``,
    whose loop variables reach their Merges through back edges the Python import cannot follow,
    TensorFlow left 97 tensors of a static TensorFlow 2 step unknown (QA), counted as 0 bytes."""
    facts = view.tensor_facts()
    out = None
    for name, infos in facts.items():
        for k, info in enumerate(infos):
            dims = shapes.get((name, k))
            if info.num_bytes is not None or not info.itemsize or dims is None:
                continue
            if info.shape is not None and (len(info.shape) != len(dims) or any(
                    d is not None and d != g for d, g in zip(info.shape, dims))):
                continue
            total = info.itemsize
            for d in dims:
                total *= d
            out = dict(facts) if out is None else out
            row = list(out[name])
            row[k] = TensorInfo(tuple(dims), info.dtype, info.itemsize, total)
            out[name] = tuple(row)
    return view if out is None else view.with_tensors(out)


def _filled(tensors: dict, known: dict) -> dict:
    """``tensors`` with the sizes ``known`` has for outputs of the same node it leaves unknown."""
    out = dict(tensors)
    for name, infos in tensors.items():
        other = known.get(name)
        if other and len(other) == len(infos) and any(i.num_bytes is None and o.num_bytes is not None
                                                       for i, o in zip(infos, other)):
            out[name] = tuple(o if i.num_bytes is None and o.num_bytes is not None else i for i, o in zip(infos, other))
    return out


def _check_fed(view: GraphView, feed_values: dict) -> None:
    """A ``--feed`` names a placeholder of the graph and gives a value of its type, else an input
    error (naming the placeholders there are, or what the placeholder takes)."""
    from lmscli.graph.fed import check
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    check(feed_values, {view.names[i]: tf.as_dtype(view.node_defs[i].attr["dtype"].type)
                        for i in range(view.size) if view.ops[i] in PLACEHOLDER_OPS})


def run_peak(model: Model, meta_graph, optimized, scratch: dict | None = None, order=(),
             micros: dict | None = None, link_bandwidth: float = float("inf"), known: dict | None = None,
             orders=(), scratch_first=frozenset(), fed: dict | None = None) -> int | None:
    """The executor model's peak of the graph a Session really runs: ``optimized``, what
    Grappler's default optimizations make of ``meta_graph`` (fusions, folded constants and the
    order they allow change the step's memory: on an attention model it fell by a third); for the
    stand-in (``order`` or ``scratch`` observed on it) with the BFC allocator's fragmentation. The
    largest over the step's GPUs, resident bytes included; None when it cannot be scheduled.
    ``fed``: the placeholder values the steps are fed (:func:`prepare`'s ``feed_values``)."""
    seen = run_graph(model, meta_graph, optimized, known, fed)
    return None if seen is None else run_peak_of(seen, scratch, order, micros, link_bandwidth, orders, scratch_first)


def run_graph(model: Model, meta_graph, optimized, known: dict | None = None,
              fed: dict | None = None) -> Prepared | None:
    """``optimized`` (the graph a Session runs for ``meta_graph``) prepared for the simulator, fed
    ``fed`` (:func:`prepare`'s ``feed_values``); None when there is none or it cannot be scheduled."""
    from lmscli.errors import LmsError

    if optimized is None:
        return None
    optimized = _with_idle_variables(optimized, meta_graph.graph_def)
    for graph_def in (optimized, _importable(optimized)):
        if graph_def is None:
            break
        graph = Model(model.path, model.format, with_graph_def(meta_graph, graph_def), tuple(model.fetches),
                      model.fetch_source, [])
        try:
            return prepare(graph, optimize=False, known=known, runtime_folding=True, feed_values=fed)
        except LmsError:
            continue
    return None


def _with_idle_variables(optimized, written):
    """``optimized``, or a copy of it holding the variables of ``written`` that Grappler pruned
    (the step does not read them). A session initializes or restores them all the same, so they
    are resident (QA r47: a TensorFlow 2 SavedModel's other signatures hold 6.5 MiB of variables;
    predicted 24 MiB, it needed 30)::

        written:   w (read by the step), v (read by another signature only)
        optimized: w, the step                 -->  w, the step, v (no inputs, no readers)
    """
    have = {node.name for node in optimized.node}
    idle = [node for node in written.node if node.op in VARIABLE_OPS and node.name not in have]
    if not idle:
        return optimized
    copy = type(optimized)()
    copy.CopyFrom(optimized)
    for node in idle:
        added = copy.node.add()
        added.CopyFrom(node)
        del added.input[:]
    return copy


def _importable(optimized):
    """A copy of ``optimized`` that TensorFlow can import again, or None when it needs no change.
    Grappler's remapper fuses a batch norm and its activation (and a side input) into
    ``_FusedBatchNormEx`` for any channel count, but that op's shape function, run on import,
    accepts only multiples of 4 (a DenseNet's 42 channels are not). For the memory model the
    fused op is a ``FusedBatchNormV3`` with the same outputs; a side input becomes a control
    input (it is read at that moment all the same)::

        _FusedBatchNormEx(x, scale, offset, mean, var, side; activation_mode=Relu)
          -->  FusedBatchNormV3(x, scale, offset, mean, var, ^side)
    """
    fused = [node for node in optimized.node if node.op == "_FusedBatchNormEx"]
    if not fused:
        return None
    copy = type(optimized)()
    copy.CopyFrom(optimized)
    for node in copy.node:
        if node.op != "_FusedBatchNormEx":
            continue
        data = [i for i in node.input if not i.startswith("^")]
        control = [i for i in node.input if i.startswith("^")]
        del node.input[:]
        node.input.extend(data[:5] + control + ["^" + i.split(":")[0] for i in data[5:]])
        node.op = "FusedBatchNormV3"
        for key in ("activation_mode", "num_side_inputs"):
            if key in node.attr:
                del node.attr[key]
    return copy


def run_peak_of(seen: Prepared, scratch: dict | None = None, order=(), micros: dict | None = None,
                link_bandwidth: float = float("inf"), orders=(), scratch_first=frozenset()) -> int:
    """:func:`run_peak` of a graph :func:`run_graph` prepared."""
    if order:
        seen = seen.observed(order, micros=micros, orders=orders)
    if scratch:
        seen = seen.with_scratch(scratch, scratch_first)
    # On the stand-in (an observed order or kernel scratch), the allocator's fragmentation too; a
    # GPU plan leaves it to --reserve, with cuDNN's workspaces. Its transfers are gRPC's.
    stand_in = bool(order or scratch)
    if stand_in and link_bandwidth == float("inf"):
        from lmscli.device import STAND_IN_LINK
        from lmscli.units import parse_bandwidth

        link_bandwidth = parse_bandwidth(STAND_IN_LINK)
    return max(simulate(s, detail=False, link_bandwidth=link_bandwidth, allocator=stand_in).allocator_peak_bytes
               for s in seen.schedules or (seen.schedule,))


def with_graph_def(meta_graph, graph_def):
    """A copy of ``meta_graph`` holding ``graph_def``."""
    copy = type(meta_graph)()
    copy.CopyFrom(meta_graph)
    copy.graph_def.CopyFrom(graph_def)
    return copy


@dataclass(frozen=True)
class OpInfo:
    name: str
    type: str
    bytes: int


@dataclass(frozen=True)
class UnknownTensor:
    name: str
    shape: str
    dtype: str
    known_bytes: int  # bytes of the known dims (a lower bound)


@dataclass(frozen=True)
class DeviceFacts:
    """Memory of one GPU in one step (graphs that place ops on several GPUs have one per GPU)."""

    device: str
    ops: int  # ops the step runs on this GPU
    peak_bytes: int
    resident_bytes: int
    lower_bound_bytes: int
    swappable_tensors: int


@dataclass(frozen=True)
class Analysis:
    model: str
    path: str
    format: str
    fetches: tuple[str, ...]
    fetch_source: str
    notes: tuple[str, ...]
    batch_size: int | None
    vertices: int
    active_vertices: int
    data_edges: int
    control_edges: int
    edges: int
    parameter_bytes: int
    variable_bytes: int
    constant_bytes: int
    largest_op: OpInfo | None
    levels: int
    peak_bytes: int
    activation_peak_bytes: int
    peak_op: str | None
    lower_bound_bytes: int
    lower_bound_op: str | None
    while_loops: int
    conds: int
    swappable_tensors: int
    swappable_bytes: int
    unknown_tensors: int
    largest_unknown: tuple[UnknownTensor, ...]
    top_live_at_peak: tuple[OpInfo, ...]
    devices: tuple[DeviceFacts, ...] = ()
    device: str = ""  # the GPU the figures above describe (the one needing the most memory)
    run_peak_bytes: int | None = None  # peak of the graph TensorFlow runs (Grappler-optimized); None: unknown
    grappler_model_peak_bytes: int | None = None  # the same schedule counted as Grappler's estimate counts it
    peak_in_branches: int = 0  # bytes live at the peak made inside v1 cond branches (lms swaps there)
    peak_in_loops: int = 0  # bytes live at the peak made inside v1 while loops (stacks and arrays included; not swapped)
    peak_from_calls: int = 0  # bytes live at the peak returned by function calls (their bodies are not counted)
    peak_in_host_stacks: int = 0  # of peak_in_loops, what gradient stacks keep that lms can move to the host
    host_stacks: int = 0  # gradient stacks of v1 while loops lms can keep on the host
    host_stack_bytes: int = 0  # what they keep over one step (the lower bound has them on the host)
    unread_accumulators: int = 0  # of those, TensorList accumulators no op reads (a rewrite drops their pushes)
    unread_accumulator_bytes: int = 0  # what they keep over one step
    unknown_batch: bool = False  # a placeholder the step reads has an unknown dimension (--batch-size fixes it)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["edges"] = {"data": self.data_edges, "control": self.control_edges, "total": self.edges}
        del data["data_edges"], data["control_edges"]
        return {"schema": "lms.analysis", "version": SCHEMA_VERSION, **data}


def saved_trainable_bytes(model: Model) -> int | None:
    """Bytes of the trainable variables a TensorFlow 2 SavedModel's object graph lists (it has no
    ``trainable_variables`` collection; QA r51: an MLP-Mixer's learning parameters were shown
    as all its variables, Adam's slots included); None when it lists none."""
    variables = [n.variable for n in model.meta_graph.object_graph_def.nodes if n.WhichOneof("kind") == "variable"]
    if not variables:
        return None
    return sum(storage_bytes(v.shape, v.dtype) for v in variables if v.trainable)


def trainable_names(model: Model) -> set[str] | None:
    """Node names of the trainable variables per the MetaGraphDef collections (None when absent)."""
    meta = model.meta_graph
    if "trainable_variables" not in meta.collection_def:
        return None
    from tensorflow.core.framework import variable_pb2

    names = set()
    for raw in meta.collection_def["trainable_variables"].bytes_list.value:
        var = variable_pb2.VariableDef()
        try:
            var.ParseFromString(raw)
        except Exception:
            continue
        names.add(var.variable_name.rsplit(":", 1)[0])
    return names


def largest_op(view: GraphView, nodes) -> OpInfo | None:
    """The GPU op with the largest inputs-plus-outputs bytes (ties: by name)."""
    best = None
    for i in nodes:
        if view.on_host(i):
            continue
        total = sum(view.tensor_bytes(src, out) for src, out in view.data_inputs[i])
        total += sum(info.num_bytes or 0 for info in view.outputs(i))
        key = (total, view.names[i])
        if best is None or (key[0] > best[0] or (key[0] == best[0] and key[1] < best[1])):
            best = key + (view.ops[i],)
    return OpInfo(best[1], best[2], best[0]) if best else None


@dataclass(frozen=True)
class Bound:
    """The instant that binds the lower bound, and why it binds."""

    bytes: int  # the lower bound (resident bytes included)
    position: int | None  # an op running at the binding instant
    time_us: int
    ops: tuple[int, ...]  # positions of the ops running at that instant
    pinned_bytes: int  # live tensors that cannot be swapped
    touched_bytes: int  # swappable tensors the running ops read or write
    largest: tuple[tuple[str, int, bool], ...]  # (tensor, bytes, swappable) held then, largest first

    def explain(self, schedule: Schedule, budget: int, moved: str = "swapped") -> str:
        """One sentence for an error message: what the step holds at the binding instant.
        ``moved``: what the strategy does with a tensor ("swapped", "made again by this strategy"):
        QA r49 read "tensors that cannot be swapped" under ``--strategy recompute`` as the loop
        stacks the other strategies do move to the host."""
        from lmscli.units import format_size

        if self.position is None:
            return f"the resident variables alone need {format_size(self.bytes)} > {format_size(budget)}"
        first = schedule.names[self.ops[0]]
        when = (f"when {first} ({schedule.ops[self.ops[0]]}) runs" if len(self.ops) == 1 else
                f"at {self.time_us / 1000:.3f} ms, where {len(self.ops)} ops run at one instant (ops that take no "
                f"time share one, as in Grappler's accounting; e.g. {first})")
        held = ", ".join(f"{name} {format_size(size)}" for name, size, _ in self.largest[:3])
        scratch = max(0, self.bytes - self.pinned_bytes - self.touched_bytes - schedule.resident_bytes)
        extra = (f", and {format_size(scratch)} of kernel scratch and allocator rounding while they run (CPU "
                 "kernels' temporaries on the stand-in)" if scratch >= 1 << 20 else "")
        return (f"{when} the step holds {format_size(self.pinned_bytes)} of tensors that cannot be {moved} and "
                f"{format_size(self.touched_bytes)} that the running ops read or write (largest: {held}){extra}; "
                f"with {format_size(schedule.resident_bytes)} resident (variables, constants) that is "
                f"{format_size(self.bytes)} > {format_size(budget)}")


def lower_bound(prepared: Prepared, swappable: set[int], baseline: SimResult | None = None) -> tuple[int, int | None]:
    """No swap plan can go below this (see :func:`binding`). Returns (bytes, position of an op at
    the binding instant)."""
    bound = binding(prepared, swappable, baseline)
    return bound.bytes, bound.position


def binding(prepared: Prepared, swappable: set[int], baseline: SimResult | None = None) -> Bound:
    """No swap plan can go below this. At every instant of the step, these tensors are on the GPU:
    the inputs and outputs of the ops running then (ops that take no time share an instant, as
    in Grappler's accounting), and every live tensor that cannot be swapped; add everything
    resident. What a loop keeps is counted at the least it can be (``SimTensor.floor_bytes``: a
    cond's branches in a loop split its iterations as the data says). Returns the instant where
    that is largest."""
    schedule = prepared.schedule
    n = len(schedule)
    if n == 0:
        return Bound(schedule.resident_bytes, None, 0, (), 0, 0, ())
    base = baseline or simulate(schedule)
    if schedule.memory_model == "executor":
        return _executor_binding(schedule, swappable, base)
    starts, ends = base.starts, base.ends
    times = sorted(set(starts))
    index = {t: i for i, t in enumerate(times)}
    pinned = [0] * (len(times) + 1)
    for t in schedule.tensors:
        if t.id in swappable:
            continue
        last = t.consumers[-1] if t.consumers else t.producer
        lo = index[starts[t.producer]]
        hi = bisect.bisect_right(times, ends[last]) - 1
        pinned[lo] += t.floor_bytes
        pinned[hi + 1] -= t.floor_bytes
    running: dict[int, list[int]] = {}
    for k in range(n):
        running.setdefault(index[starts[k]], []).append(k)
        if ends[k] in index and ends[k] != starts[k]:
            running.setdefault(index[ends[k]], []).append(k)
    size = {t.id: t.floor_bytes for t in schedule.tensors}
    produced: dict[int, list[int]] = {}
    for t in schedule.tensors:
        produced.setdefault(t.producer, []).append(t.id)
    best, best_i, best_level, best_touched, level = 0, None, 0, set(), 0
    for i in range(len(times)):
        level += pinned[i]
        touched = set()
        for k in running.get(i, ()):
            touched.update(tid for tid in schedule.inputs[k] if tid in swappable)
            touched.update(tid for tid in produced.get(k, ()) if tid in swappable)
        total = level + sum(size[tid] for tid in touched)
        if total > best:
            best, best_i, best_level, best_touched = total, i, level, touched
    if best_i is None or not running.get(best_i):
        return Bound(best + schedule.resident_bytes, None, 0, (), best_level, 0, ())
    time = times[best_i]
    held = []
    for t in schedule.tensors:
        last = t.consumers[-1] if t.consumers else t.producer
        if t.id in best_touched or (t.id not in swappable and starts[t.producer] <= time <= ends[last]):
            held.append((schedule.label(t.id), t.floor_bytes, t.id in swappable))
    held.sort(key=lambda h: (-h[1], h[0]))
    ops = tuple(running[best_i])
    return Bound(best + schedule.resident_bytes, ops[0], time, ops, best_level,
                 sum(size[tid] for tid in best_touched), tuple(held[:10]))


def _executor_binding(schedule: Schedule, swappable: set[int], base: SimResult) -> Bound:
    """:func:`binding` under the executor's memory model: ops run one at a time, so the bound at
    an op is the buffers it reads and writes (a buffer reused in place counted once), its kernel
    scratch, every live buffer that no swap can move, and everything resident."""
    from lmscli.model.memmodel import rounded, roots

    n = len(schedule)
    root = roots(schedule)
    size: dict[int, int] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    movable: set[int] = set()
    for t in schedule.tensors:
        r = root[t.id]
        if r < 0:
            continue
        if r == t.id:
            size[r], first[r] = rounded(t.floor_bytes), t.producer
        last[r] = max(last.get(r, 0), t.consumers[-1] if t.consumers else t.producer)
        if t.id in swappable:
            movable.add(r)
    pinned = [0] * (n + 1)
    for r in size:
        if r not in movable:
            pinned[first[r]] += size[r]
            pinned[last[r] + 1] -= size[r]
    produced: dict[int, list[int]] = {}
    for t in schedule.tensors:
        produced.setdefault(t.producer, []).append(t.id)
    scratch = schedule.scratch or (0,) * n
    best, best_k, best_level, best_touched, level = -1, 0, 0, set(), 0
    for k in range(n):
        level += pinned[k]
        touched = {root[tid] for tid in schedule.inputs[k] + tuple(produced.get(k, ()))
                   if root[tid] >= 0 and root[tid] in movable}
        total = level + sum(size[r] for r in touched) + scratch[k]
        if total > best:
            best, best_k, best_level, best_touched = total, k, level, touched
    held = []
    for r, num in size.items():
        if r in best_touched or (r not in movable and first[r] <= best_k <= last[r]):
            t = schedule.tensors[r]
            held.append((schedule.label(t.id), num, r in movable))
    held.sort(key=lambda h: (-h[1], h[0]))
    return Bound(best + schedule.resident_bytes, best_k, base.starts[best_k], (best_k,), best_level,
                 sum(size[r] for r in best_touched), tuple(held[:10]))


def _dead_notes(prepared: Prepared) -> tuple[str, ...]:
    """A note when ops of the step as written are left out because Grappler prunes them."""
    if not prepared.dead:
        return ()
    return (f"{len(prepared.dead)} op(s) compute results nothing reads (gradients with respect to constants or dropout "
            "masks) or read static shapes: TensorFlow's optimizations prune or fold them, so the schedule leaves them out",)


def _branch_notes(prepared: Prepared) -> tuple[str, ...]:
    if not prepared.untaken:
        return ()
    which, kept = (("the branches the --feed values do not take (else the smaller ones)", "the others")
                   if prepared.view.fed else ("the smaller branches", "the larger branches"))
    return (f"a step runs one branch of each cond: {which} ({len(prepared.untaken)} op(s)) are left "
            f"out of the schedule, and tensors read in them are never swapped ({kept} are planned: "
            "swap-ins there are triggered from the same branch or from before the cond)",)


def _dims(shape) -> str:
    """A partly known shape as ``[?, 48, 48, 32]`` (``<unknown rank>`` when even its rank is unknown)."""
    return "<unknown rank>" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def unknown_batch(prepared: Prepared) -> bool:
    """Has a placeholder the step reads an unknown dimension (what ``--batch-size`` fixes)?"""
    view = prepared.view
    placeholders = [i for i in prepared.schedule.nodes if view.ops[i] == "Placeholder"]
    return any(info.shape is None or None in info.shape for i in placeholders for info in view.outputs(i))


def unknown_size_warning(prepared: Prepared) -> str | None:
    """A warning when outputs of the step have sizes shape inference leaves unknown (counted as 0
    bytes, so the figures are too small), naming the largest partly known one; None otherwise.
    Outputs of unknown rank are left out (a FusedBatchNorm's reserve outputs, a few bytes); the
    ``--batch-size`` hint comes only when a placeholder of the step has an unknown dimension, and
    the warning counts those inside while loops, whose back edges shape inference does not follow
    (else the sizes depend on the data, e.g. the number of unique ids)."""
    view, found, in_loops = prepared.view, [], 0
    for i in prepared.schedule.nodes:
        if view.ops[i] in DIMENSION_OPS:
            continue  # (a few integers each, sized by ranks: QA r45 saw them "depend on the data")
        for k, info in enumerate(view.outputs(i)):
            if info.num_bytes is None and info.shape is not None:
                found.append((-info.known_elements * info.itemsize, f"{view.names[i]}:{k}", info.shape))
                in_loops += bool(view.frames[i])
    if not found:
        return None
    _size, name, shape = min(found)
    batch = unknown_batch(prepared)
    # (QA: a bidirectional GRU's loop gradients, static in fact, were said to depend on the data)
    where = (f"{in_loops} of them in while loops, whose back edges TensorFlow's shape inference does not follow"
             if in_loops else "")
    if batch and not prepared.batch_size:
        hint = "; give --batch-size N for the unknown batch dimension" + (f" ({where})" if where else "")
    elif batch:
        hint = f" ({where})" if where else ""
    else:
        hint = f" ({where}, or depending on the data)" if where else " (they depend on the data)"
    return (f"{len(found)} tensor(s) of the step have an unknown size and count as 0 bytes, so the figures are "
            f"too small (largest: {name} {_dims(shape)}){hint}")


# Ops whose outputs are dimensions or indices (a shape's reads, and the broadcast ops of gradients).
DIMENSION_OPS = SHAPE_OPS | frozenset({"BroadcastGradientArgs", "BroadcastArgs"})


def _loop_notes(view: GraphView, active) -> tuple[str, ...]:
    """Notes when the step runs v1 while loops: their trip counts, or that they are unknown."""
    if not any(view.frames[i] for i in active):
        return ()
    from lmscli.model import loops

    return loops.notes(view, active, loop_counts(view))


def _cond_switch(view, i: int) -> bool:
    """Whether node ``i`` is a Switch of a v1 cond, inside a loop or not: a while loop's own
    Switches test the loop's ``LoopCond``."""
    if view.ops[i] not in ("Switch", "RefSwitch") or len(view.data_inputs[i]) < 2:
        return False
    return view.ops[view.data_inputs[i][1][0]] != "LoopCond"


def _call_notes(view: GraphView, active) -> tuple[str, ...]:
    """A note when the step calls functions of the graph's library: the tensors inside their
    bodies are not counted (only the calls' inputs and outputs are), nor swapped."""
    from lmscli.grappler import call_ops

    callers = call_ops(view.library)
    found = [view.ops[i] for i in active if view.ops[i] in callers]
    if not found:
        return ()
    calls = sorted(set(found))
    return (f"{len(found)} op(s) of the step call functions ({', '.join(calls[:4])}{', ...' if len(calls) > 4 else ''}); "
            "the tensors inside their bodies are neither counted nor swapped, so the peak of a step that runs "
            "mostly inside a function is underestimated",)


def plan_bound(prepared: Prepared, filters: Filters, stacks=(), baseline: SimResult | None = None):
    """(bytes, position): the lower bound of the plans ``lms tune`` makes by default, as its
    planner computes it (:func:`lower_bound`): loops running one iteration at a time, as plans
    run them (:func:`lmscli.model.loops.run_serially`: a loop's sums carried from iteration to
    iteration count, iterations running ahead do not), and, where that is lower, with the
    gradient ``stacks`` of v1 loops on the host (their ops keep their positions). QA r52: a
    seq2seq's ``analyze --stand-in`` said 24.38 MiB, counted with its loops as written, while
    ``tune --stand-in`` turned down 27 MiB as under its 28.03 MiB bound."""
    from lmscli.model.loops import run_serially

    view, schedule = prepared.view, prepared.schedule
    one_gpu = len(prepared.schedules or (schedule,)) <= 1
    serial = run_serially(schedule, view)
    if serial is not schedule:
        prepared = replace(prepared, schedule=serial,
                           schedules=tuple(serial if s is schedule else s for s in prepared.schedules))
        baseline = None
    cands = candidates(view, prepared.schedule, filters, prepared.fused, untaken=prepared.untaken)
    lb, lb_pos = lower_bound(prepared, set(cands), baseline)
    if stacks and one_gpu:
        hosted = hoststacks.hosting(prepared.schedule, view, stacks)
        hosted_cands = candidates(view, hosted, filters, prepared.fused, untaken=prepared.untaken)
        lb, lb_pos = min((lb, lb_pos), lower_bound(replace(prepared, schedule=hosted, schedules=(hosted,)),
                                                   set(hosted_cands)), key=lambda b: b[0])
    return lb, lb_pos


@timed("analyze")
def analyze(prepared: Prepared, baseline: SimResult | None = None, filters: Filters = Filters()) -> Analysis:
    model, view, schedule = prepared.model, prepared.view, prepared.schedule
    active = schedule.nodes
    result = baseline or simulate(schedule)
    trainable = trainable_names(model)
    var_nodes = [i for i in range(view.size) if view.ops[i] in VARIABLE_OPS]
    all_var_bytes = sum(variable_bytes(view, i) for i in var_nodes)
    if trainable is None:
        param_bytes = saved_trainable_bytes(model)
        param_bytes = all_var_bytes if param_bytes is None else min(param_bytes, all_var_bytes)
    else:
        param_bytes = sum(variable_bytes(view, i) for i in var_nodes if view.names[i] in trainable)
    cands = candidates(view, schedule, filters, prepared.fused, untaken=prepared.untaken)
    stacks = hoststacks.hostable(view, prepared.dead | prepared.untaken, frozenset(model.fetches))
    lb, lb_pos = plan_bound(prepared, filters, stacks, result)
    hosted_pushes = {p for h in stacks for p in h.pushes}
    devices = []
    for other in prepared.schedules or (schedule,):
        if other is schedule:
            facts = (result.peak_bytes, lb, len(cands))
        else:
            alone = prepared.for_device(other.device)
            other_cands = candidates(view, other, filters, prepared.fused, untaken=prepared.untaken)
            base = simulate(other)
            facts = (base.peak_bytes, lower_bound(alone, set(other_cands), base)[0], len(other_cands))
        devices.append(DeviceFacts(other.device, sum(other.on_gpu), facts[0], other.resident_bytes, facts[1], facts[2]))
    unknown = []  # (as unknown_size_warning counts them: outputs of the ops scheduled, of known rank,
    for i in schedule.nodes:  # but dimensions: QA r52, the warning said 2 and the table 12)
        if view.ops[i] in DIMENSION_OPS:
            continue
        for k, info in enumerate(view.outputs(i)):
            if info.num_bytes is None and info.shape is not None:
                unknown.append(UnknownTensor(f"{view.names[i]}:{k}", _dims(info.shape), info.dtype,
                                             info.known_elements * info.itemsize))
    unknown.sort(key=lambda u: (-u.known_bytes, u.name))
    top = []
    for kind, tid, size in result.live_at_peak[:10]:
        t = schedule.tensors[tid]
        label = schedule.label(tid) + (" (swap-in)" if kind == "swapin" else "")
        top.append(OpInfo(label, schedule.ops[t.producer], size))
    from lmscli.grappler import call_ops

    callers = call_ops(view.library)
    in_branches = in_loops = from_calls = in_stacks = 0
    for _kind, tid, size in result.live_at_peak:
        node = schedule.nodes[schedule.tensors[tid].producer]
        if view.in_loop(node):
            in_loops += size
            if schedule.tensors[tid].output == STORAGE_OUTPUT and node in hosted_pushes:
                in_stacks += size
        elif view.conditional(node):
            in_branches += size
        if view.ops[node] in callers:
            from_calls += size
    loops = {view.frames[i] for i in range(view.size) if view.frames[i]}
    conds = sum(1 for i in range(view.size) if _cond_switch(view, i))
    return Analysis(
        model=model.name,
        path=model.path,
        format=model.format,
        fetches=tuple(model.fetches),
        fetch_source=model.fetch_source,
        notes=tuple(model.notes) + _call_notes(view, active) + _dead_notes(prepared) + _branch_notes(prepared)
              + _loop_notes(view, active),
        batch_size=prepared.batch_size if prepared.batched_placeholders else None,  # (a --batch-size that changed nothing: none)
        vertices=view.size,
        active_vertices=len(active),
        data_edges=view.num_data_edges,
        control_edges=view.num_control_edges,
        edges=view.num_data_edges + view.num_control_edges,
        parameter_bytes=param_bytes,
        variable_bytes=all_var_bytes,
        constant_bytes=schedule.constant_bytes,
        largest_op=largest_op(view, active),
        levels=(max(view.levels) + 1) if view.size else 0,
        peak_bytes=result.peak_bytes,
        activation_peak_bytes=result.activation_peak_bytes,
        peak_op=schedule.names[result.peak_position] if len(schedule) else None,
        lower_bound_bytes=lb,
        lower_bound_op=schedule.names[lb_pos] if lb_pos is not None else None,
        while_loops=len(loops),
        conds=conds,
        peak_in_branches=in_branches,
        peak_in_loops=in_loops,
        peak_from_calls=from_calls,
        peak_in_host_stacks=in_stacks,
        host_stacks=sum(len(h.stacks) for h in stacks),
        host_stack_bytes=sum(h.num_bytes for h in stacks),
        unread_accumulators=sum(len(h.stacks) for h in stacks if h.dropped),
        unread_accumulator_bytes=sum(h.num_bytes for h in stacks if h.dropped),
        swappable_tensors=len(cands),
        swappable_bytes=sum(schedule.tensors[t].num_bytes for t in cands),
        unknown_tensors=len(unknown),
        unknown_batch=unknown_batch(prepared),
        largest_unknown=tuple(unknown[:5]),
        top_live_at_peak=tuple(top),
        devices=tuple(devices),
        device=schedule.device,
        run_peak_bytes=prepared.run_peak_bytes if schedule.memory_model == "executor" else None,
        grappler_model_peak_bytes=(result.peak_bytes if schedule.memory_model == "grappler" else
                                   simulate(schedule.with_memory_model("grappler"), detail=False).peak_bytes),
    )
