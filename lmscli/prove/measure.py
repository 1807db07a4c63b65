"""Measure the memory a training step really uses on the stand-in device, from TensorFlow's own
step statistics.

A traced run (``RunOptions(trace_level=FULL_TRACE)``) fills ``RunMetadata.step_stats``: per device,
per node, the allocator's ``allocation_records`` (positive bytes when the node allocates, negative
when that allocation is freed; a free is recorded on the node that allocated, at the time it
happens). Both logical CPUs share one allocator, so the live bytes of the stand-in device are
rebuilt from the records of the nodes that ran on it.

What the records count: only what the traced step allocates. Variables were allocated before it
(by the initializer, and Momentum/Adam slots that start as a shared constant get their own buffer
at their first update), so their bytes are measured from the traced initializer and warm-up runs
(what those left allocated on the stand-in) and reported apart (``resident_bytes``). Constants are
allocated when kernels are built and never appear. Forwarding ops (Identity, ReadVariableOp,
Reshape) allocate nothing: their output is their input's buffer, or the variable's.

The measurement runs a copy of the graph in which swap nodes really copy (see
:func:`lmscli.prove.steps.place_on_cpu`); nothing here changes a graph that is written to disk.

Order matters: TensorFlow's executor picks a different order among ready nodes in every session,
even with one inter-op thread, and with one thread the stand-in's partition keeps the thread
while the host partition's swap-outs wait (in a rewritten U-Net they ran after the peak, so the
rewrite appeared to save nothing). :func:`measure_peak` therefore chains the step in a given order
(the simulator's schedule) with control edges: reproducible, and the same order the plan assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmscli.errors import LmsError
from lmscli.tfimport import tensorflow

STANDIN_SUFFIX = "device:CPU:1"
HOST_SUFFIX = "device:CPU:0"


@dataclass(frozen=True)
class MeasuredMemory:
    """Live bytes on the stand-in device during one traced training step."""

    tensor_peak_bytes: int  # bytes allocated during the step, live at the peak
    resident_bytes: int  # bytes the variable initializer left allocated on the stand-in (variables)
    peak_node: str | None  # the node whose allocation reached the peak
    live_at_peak: tuple[tuple[str, int], ...]  # (allocating node, bytes) live at the peak, largest first
    curve: tuple[tuple[int, int], ...]  # (microseconds from the step's start, live tensor bytes) per event
    host_peak_bytes: int  # the same reconstruction for the host device
    copies: tuple[str, ...] = ()  # swap nodes measured as real copies
    placements: dict = field(default_factory=dict)  # swap node -> device it ran on
    notes: tuple[str, ...] = ()

    @property
    def peak_bytes(self) -> int:
        """Peak including resident variables: comparable with the simulator's peak."""
        return self.tensor_peak_bytes + self.resident_bytes


def _records(step_stats, suffix: str):
    """``(micros, bytes, node)`` allocation events of the nodes that ran on the device ending in
    ``suffix``. Scratch buffers an op frees before it ends (kernel temporaries, e.g. im2col) are
    left out: like Grappler and the simulator, we measure tensors, not kernel workspaces (which
    ``--reserve`` covers)."""
    events = []
    for dev in step_stats.dev_stats:
        if not dev.device.endswith(suffix):
            continue
        for node in dev.node_stats:
            records = [(rec.alloc_micros, rec.alloc_bytes) for mem in node.memory for rec in mem.allocation_records]
            end = node.all_start_micros + node.all_end_rel_micros
            freed = sorted((m, -b) for m, b in records if b < 0 and m <= end)
            scratch: list[tuple[int, int]] = []
            for m, b in sorted(r for r in records if r[1] > 0):
                match = next((f for f in freed if f[1] == b and f[0] >= m), None)
                if match is not None:
                    freed.remove(match)
                    scratch += [(m, b), (match[0], -b)]
            for rec in scratch:
                records.remove(rec)
            events.extend((m, b, node.node_name) for m, b in records)
    return events


def _ran_on(step_stats) -> dict:
    where = {}
    for dev in step_stats.dev_stats:
        for node in dev.node_stats:
            where[node.node_name] = dev.device
    return where


def live_curve(events):
    """Replay allocation events: ``(peak, peak node, live at peak, curve, live at the end)``.

    At equal microseconds allocations come before frees (conservative, as in Grappler's accounting
    and the simulator), so a tie never hides a peak.
    """
    ordered = sorted(events, key=lambda e: (e[0], e[1] < 0))
    live = peak = 0
    peak_node = None
    peak_index = -1
    curve = []
    start = ordered[0][0] if ordered else 0
    for i, (micros, num_bytes, node) in enumerate(ordered):
        live += num_bytes
        curve.append((micros - start, live))
        if live > peak:
            peak, peak_node, peak_index = live, node, i
    # Which allocations were still live at the peak (match frees to allocations per node and size).
    held: dict[tuple[str, int], int] = {}
    for _micros, num_bytes, node in ordered[: peak_index + 1]:
        key = (node, abs(num_bytes))
        held[key] = held.get(key, 0) + (1 if num_bytes > 0 else -1)
    per_node: dict[str, int] = {}
    for (node, size), count in held.items():
        if count > 0:
            per_node[node] = per_node.get(node, 0) + size * count
    at_peak = tuple(sorted(per_node.items(), key=lambda kv: (-kv[1], kv[0])))
    return peak, peak_node, at_peak, tuple(curve), live


def _initializer_ancestors(meta) -> set[str]:
    """Nodes the variable initializers need (they must not wait for the training step)."""
    from tensorflow.core.framework import variable_pb2

    starts = []
    for key in ("variables", "local_variables", "trainable_variables", "model_variables"):
        if key in meta.collection_def:
            for raw in meta.collection_def[key].bytes_list.value:
                var = variable_pb2.VariableDef()
                var.ParseFromString(raw)
                if var.initializer_name:
                    starts.append(var.initializer_name.split(":")[0])
    inputs = {node.name: node.input for node in meta.graph_def.node}
    seen: set[str] = set()
    stack = [s for s in starts if s in inputs]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in inputs.get(name, ()):
            src = text.lstrip("^").split(":")[0]
            if src in inputs and src not in seen:
                stack.append(src)
    return seen


def _control_flow_regions(graph_def) -> tuple[set[str], set[str]]:
    """``(loops, conds)``: nodes the main chain must not touch. ``loops``: v1 while-loop bodies
    (from an Enter up to its Exit) and all that follows an Exit (it fires only when the loop is
    done, through back edges a static order does not see); ``conds``: v1 cond branches (from a
    Switch up to its Merge: a dead branch would kill the next node in the chain)."""
    succ: dict[str, list[str]] = {}
    ops = {}
    for node in graph_def.node:
        ops[node.name] = node.op
        for text in node.input:
            succ.setdefault(text.lstrip("^").split(":")[0], []).append(node.name)

    def flood(starts, stop=frozenset()):
        seen = set(starts)
        stack = list(starts)
        while stack:
            name = stack.pop()
            if ops.get(name) in stop and name not in starts:
                continue
            for nxt in succ.get(name, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    enters = [n for n, op in ops.items() if op in ("Enter", "RefEnter")]
    exits = [n for n, op in ops.items() if op in ("Exit", "RefExit")]
    switches = [n for n, op in ops.items() if op in ("Switch", "RefSwitch")]
    return (flood(enters, frozenset({"Exit", "RefExit"})) | flood(exits),
            flood(switches, frozenset({"Merge", "RefMerge"})))


def serialize(meta, order) -> int:
    """Chain the nodes of ``order`` with control edges so they run exactly in that order.

    Nodes without inputs (variables, constants, placeholders), what the variable initializers
    need and while loops stay free. The nodes of each v1 cond branch form a chain of their own
    (an edge between two nodes of the same branches is dead exactly when both are); before, they
    ran as the executor pleased, and a swap-out in a branch could leave after the peak (QA: a
    rewrite that saved 16 MiB measured as saving nothing). Returns the number of edges added.
    """
    from lmscli.graph.graphview import GraphView

    loops, conds = _control_flow_regions(meta.graph_def)
    skip = _initializer_ancestors(meta) | loops
    nodes = {node.name: node for node in meta.graph_def.node}
    ready = [n for n in order if n in nodes and n not in skip and len(nodes[n].input) > 0]
    chains: dict[frozenset, list[str]] = {frozenset(): [n for n in ready if n not in conds]}
    if conds:
        view = GraphView(meta.graph_def)
        tags = view.branch_tags()
        for n in ready:
            tag = tags[view.index[n]]
            if n in conds and tag:
                chains.setdefault(tag, []).append(n)
    added = 0
    for chain in chains.values():
        for prev, name in zip(chain, chain[1:]):
            node = nodes[name]
            if any(text.lstrip("^").split(":")[0] == prev for text in node.input):
                continue
            node.input.append("^" + prev)
            added += 1
    return added


def measure_peak(meta_graph, fetches, batch_size: int = 1, order=None, warmup: int = 1,
                 optimize: bool = False, feed_values: dict | None = None) -> MeasuredMemory:
    """Run one traced training step of ``fetches`` and measure the peak live bytes on the stand-in.

    Swap nodes are replaced by copying ops in a private copy of the graph. ``order`` (node names,
    e.g. the schedule the simulator used) serializes the step: TensorFlow's executor otherwise picks
    a different order of ready nodes in every session, even with one inter-op thread, and a
    rewritten graph's peak depends on it. ``warmup`` steps run first (first-run allocations aside).
    ``optimize=False`` turns Grappler off so the graph runs as written (oneDNN's fusions remain).
    ``feed_values``: the user's values for placeholders (:func:`lmscli.prove.steps.feeds`).
    """
    tf = tensorflow()
    from lmscli.prove import steps

    placed = steps.place_on_cpu(meta_graph, copies=True)
    if order:
        serialize(placed.meta_graph, order)
    try:
        g = steps.import_graph(placed.meta_graph, fetches)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        with tf.compat.v1.Session(graph=g.graph, config=steps.session_config(optimize)) as sess:
            before = []  # what ran before the measured step: initializer, warm-up steps
            before.append(tf.compat.v1.RunMetadata())
            sess.run(g.init, feed_dict=g.init_feed, options=options, run_metadata=before[-1])
            feed = steps.feeds(g.placeholders, batch_size, 0, feed_values)
            for _ in range(warmup):
                before.append(tf.compat.v1.RunMetadata())
                sess.run(g.targets, feed_dict=feed, options=options, run_metadata=before[-1])
            step_meta = tf.compat.v1.RunMetadata()
            sess.run(g.targets, feed_dict=feed, options=options, run_metadata=step_meta)
    except LmsError:
        raise
    except Exception as exc:
        raise steps.failed_run(exc) from None
    # Resident: what the runs before the step left allocated on the stand-in (variables; slots that
    # start as a shared constant get their own buffer at their first update).
    resident = sum(b for md in before for _, b, _ in _records(md.step_stats, STANDIN_SUFFIX))
    events = _records(step_meta.step_stats, STANDIN_SUFFIX)
    if not events:
        raise LmsError("TensorFlow recorded no allocations for the step; cannot measure its memory")
    peak, peak_node, at_peak, curve, _ = live_curve(events)
    host_peak = live_curve(_records(step_meta.step_stats, HOST_SUFFIX))[0]
    ran = _ran_on(step_meta.step_stats)
    # (only nodes the step needs: a SavedModel's saver nodes sit on the host, and no step runs
    # them -- QA: "1 of 1 swap nodes did not run (save/Identity): they sit in cond branches")
    step = {op.name for op in steps.ancestors(g.targets)}
    swaps = [n for n in placed.swap_outs + placed.swap_ins if n in step]
    placements = {name: ran[name] for name in swaps if name in ran}
    notes = list(placed.notes)
    misplaced = [n for n in placed.swap_outs if n in ran and not ran[n].endswith(HOST_SUFFIX)]
    if misplaced:
        notes.append(f"{len(misplaced)} swap-outs did not run on the host (e.g. {misplaced[0]})")
    idle = [n for n in swaps if n not in ran]
    if idle:
        notes.append(f"{len(idle)} of {len(swaps)} swap nodes did not run in the measured step (e.g. {idle[0]}): "
                     "they sit in cond branches the step's inputs did not take, so neither the measurement nor "
                     "the bit-for-bit comparison covers them")
    return MeasuredMemory(peak, max(resident, 0), peak_node, at_peak, curve, host_peak, placed.copies, placements,
                          tuple(notes))
