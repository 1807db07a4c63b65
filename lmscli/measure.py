"""Measure the memory a training step really uses on the stand-in device, from TensorFlow's own
step statistics.

A traced run (``RunOptions(trace_level=FULL_TRACE)``) fills ``RunMetadata.step_stats``: per device,
per node, the allocator's ``allocation_records`` (positive bytes when the node allocates, negative
when that allocation is freed; a free is recorded on the node that allocated, at the time it
happens). Both logical CPUs share one allocator, so the live bytes of the stand-in device are
rebuilt from the records of the nodes that ran on it.

The measurement runs a copy of the graph in which swap nodes really copy (see
:func:`lmscli.verify.place_on_cpu`); nothing here changes a graph that is written to disk.
Variables are allocated by the initializer, before the step: their bytes (what initialisation
left allocated on the stand-in) are measured from a traced initializer run and reported apart.
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
    """``(micros, bytes, node)`` allocation events of the nodes that ran on the device ending in ``suffix``."""
    events = []
    for dev in step_stats.dev_stats:
        if not dev.device.endswith(suffix):
            continue
        for node in dev.node_stats:
            for mem in node.memory:
                for rec in mem.allocation_records:
                    events.append((rec.alloc_micros, rec.alloc_bytes, node.node_name))
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
    for micros, num_bytes, node in ordered[: peak_index + 1]:
        key = (node, abs(num_bytes))
        held[key] = held.get(key, 0) + (1 if num_bytes > 0 else -1)
    per_node: dict[str, int] = {}
    for (node, size), count in held.items():
        if count > 0:
            per_node[node] = per_node.get(node, 0) + size * count
    at_peak = tuple(sorted(per_node.items(), key=lambda kv: (-kv[1], kv[0])))
    return peak, peak_node, at_peak, tuple(curve), live


def measure_peak(meta_graph, fetches, batch_size: int = 1, warmup: int = 1, optimize: bool = True) -> MeasuredMemory:
    """Run one traced training step of ``fetches`` and measure the peak live bytes on the stand-in.

    Swap nodes are replaced by copying ops in a private copy of the graph; one inter-op thread makes
    the figure reproducible. ``warmup`` untraced steps run first (first-run allocations aside).
    """
    tf = tensorflow()
    from lmscli import verify

    placed = verify.place_on_cpu(meta_graph, copies=True)
    try:
        g = verify.import_graph(placed.meta_graph, fetches)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        with tf.compat.v1.Session(graph=g.graph, config=verify.session_config(optimize)) as sess:
            before = []  # what ran before the measured step: initializer, warm-up steps
            before.append(tf.compat.v1.RunMetadata())
            sess.run(g.init, options=options, run_metadata=before[-1])
            feed = verify.feeds(g.placeholders, batch_size, 0)
            for _ in range(warmup):
                before.append(tf.compat.v1.RunMetadata())
                sess.run(g.targets, feed_dict=feed, options=options, run_metadata=before[-1])
            step_meta = tf.compat.v1.RunMetadata()
            sess.run(g.targets, feed_dict=feed, options=options, run_metadata=step_meta)
    except LmsError:
        raise
    except Exception as exc:
        raise verify.failed_run(exc) from None
    # Resident: what the runs before the step left allocated on the stand-in (variables; slots that
    # start as a shared constant get their own buffer at their first update).
    resident = sum(b for md in before for _, b, _ in _records(md.step_stats, STANDIN_SUFFIX))
    events = _records(step_meta.step_stats, STANDIN_SUFFIX)
    if not events:
        raise LmsError("TensorFlow recorded no allocations for the step; cannot measure its memory")
    peak, peak_node, at_peak, curve, _ = live_curve(events)
    host_peak = live_curve(_records(step_meta.step_stats, HOST_SUFFIX))[0]
    ran = _ran_on(step_meta.step_stats)
    swaps = placed.swap_outs + placed.swap_ins
    placements = {name: ran[name] for name in swaps if name in ran}
    notes = list(placed.notes)
    misplaced = [n for n in placed.swap_outs if n in ran and not ran[n].endswith(HOST_SUFFIX)]
    if misplaced:
        notes.append(f"{len(misplaced)} swap-outs did not run on the host (e.g. {misplaced[0]})")
    return MeasuredMemory(peak, max(resident, 0), peak_node, at_peak, curve, host_peak, placed.copies, placements,
                          tuple(notes))
