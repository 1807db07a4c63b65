"""What one real step on the CPU shows that a static model cannot: each op's kernel scratch, and
the order TensorFlow's executor runs the ops in.

CPU kernels take temporaries from the device's allocator while they run (the col buffers of
convolution gradients, up to tens of MiB at small shapes); a GPU's kernels use cuDNN workspaces
instead, which ``--reserve`` covers. With TensorFlow's BFC allocator (the stand-in's, and a
GPU's), a traced step records each op's own peak allocation and what it left allocated, so
``peak - live`` is what the op held only while it ran. The allocator is chosen when a process
starts, so the measurement runs in a child process (``python -m lmscli.prove.scratch``):
one TensorFlow import and one traced step, seconds.

The order: with one inter-op thread, TensorFlow's CPU executor runs cheap ops inline as they
become ready and queues expensive ones last-in first-out, so weight gradients and their updates
wait until the backward pass is nearly done; on a ResNet-50 that holds 17% more than the
first-ready order of Grappler's scheduler. The traced step's start times give that order (it was
the same in every run here); the stand-in runs the same executor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from lmscli.errors import LmsError
from lmscli.prove._server import FIRST_REGION, _preallocate
from lmscli.timing import timed

REGION = 8 << 30  # address space the traced step's allocator gets up front (untouched pages cost nothing)


@dataclass(frozen=True)
class Observation:
    scratch: dict  # node name -> kernel scratch bytes (ops that hold any)
    order: tuple  # node names in the order the executor started them
    micros: dict = field(default_factory=dict)  # node name -> microseconds it ran on this CPU


@timed("traced CPU step")
def observe(meta_graph, fetches, batch_size: int = 1, timeout_s: float = 300.0) -> Observation:
    """One traced training step on the CPU with the stand-in's allocator: scratch and order."""
    with tempfile.TemporaryDirectory(prefix="lms-scratch-") as tmp:
        graph = os.path.join(tmp, "graph.meta")
        out = os.path.join(tmp, "scratch.json")
        with open(graph, "wb") as fh:
            fh.write(meta_graph.SerializeToString())
        limit_mib = REGION >> 20
        env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3",
                   TF_CPU_BFC_MEM_LIMIT_IN_MB=str(limit_mib + (FIRST_REGION >> 20)))
        cmd = [sys.executable, "-m", "lmscli.prove.scratch", graph, out, str(batch_size)] + list(fetches)
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise LmsError(f"measuring kernel scratch took more than {timeout_s:.0f} s") from None
        if done.returncode != 0 or not os.path.exists(out):
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise LmsError(f"measuring kernel scratch failed: {last}")
        with open(out, encoding="utf-8") as fh:
            data = json.load(fh)
        return Observation({k: int(v) for k, v in data["scratch"].items()}, tuple(data["order"]),
                           {k: int(v) for k, v in data["micros"].items()})


def _main(argv) -> int:
    graph, out, batch = argv[0], argv[1], int(argv[2])
    fetches = argv[3:]
    from lmscli.prove import steps
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    held = _preallocate(tf, REGION)  # one region, as on the stand-in: chunks are split to their request  # noqa: F841
    meta = type(tf.compat.v1.MetaGraphDef())()
    with open(graph, "rb") as fh:
        meta.ParseFromString(fh.read())
    placed = steps.place_on_cpu(meta).meta_graph
    g = steps.import_graph(placed, fetches)
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    with tf.compat.v1.Session(graph=g.graph, config=steps.session_config(True)) as sess:
        sess.run(g.init, feed_dict=g.init_feed)
        feed = steps.feeds(g.placeholders, batch, 0)
        sess.run(g.targets, feed_dict=feed)  # first-run allocations aside
        step = tf.compat.v1.RunMetadata()
        sess.run(g.targets, feed_dict=feed, options=options, run_metadata=step)
    scratch: dict[str, int] = {}
    started = []
    micros: dict[str, int] = {}
    for dev in step.step_stats.dev_stats:
        for node in dev.node_stats:
            started.append((node.all_start_micros, node.node_name))
            micros[node.node_name] = max(1, int(node.all_end_rel_micros))
            for mem in node.memory:
                held = mem.peak_bytes - mem.live_bytes
                if held > 0:
                    scratch[node.node_name] = max(scratch.get(node.node_name, 0), int(held))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"scratch": scratch, "order": [name for _, name in sorted(started)], "micros": micros}, fh,
                  sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
