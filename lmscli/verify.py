"""Run training steps on CPU to prove that a rewrite computes exactly what the original computes.

The graph is imported into a session with two logical CPUs: the model on ``/device:CPU:1`` (the
stand-in for the GPU), nodes explicitly placed on a CPU (the swap nodes) on ``/device:CPU:0``.
Both runs use the same graph seed, the same random feeds for every placeholder and one
inter-op thread, so any difference in loss or variables is a real difference.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from lmscli.errors import LmsError
from lmscli.tfimport import tensorflow

GPU_STANDIN = "/device:CPU:1"
HOST = "/device:CPU:0"


@dataclass(frozen=True)
class StepRun:
    losses: tuple  # one array per step (the fetched loss, if the graph has one)
    variables: dict  # name -> final value
    placements: dict  # node name -> device it ran on (for the lms/ nodes)


def _feed_value(name: str, shape, dtype, batch_size: int, step: int):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{step}".encode()))
    dims = [batch_size if d is None else d for d in shape]
    if dtype.is_bool:
        return rng.integers(0, 2, size=dims).astype(bool)
    if dtype.is_integer:
        return rng.integers(0, 2, size=dims).astype(dtype.as_numpy_dtype)
    return rng.standard_normal(size=dims).astype(dtype.as_numpy_dtype)


def run_steps(meta_graph, fetches, steps: int = 1, batch_size: int = 2, loss: str | None = "loss:0") -> StepRun:
    """Import ``meta_graph`` and run ``steps`` training steps of ``fetches`` on CPU."""
    tf = tensorflow()
    from tensorflow.core.protobuf import config_pb2

    graph = tf.Graph()
    config = config_pb2.ConfigProto(device_count={"CPU": 2}, inter_op_parallelism_threads=1,
                                    intra_op_parallelism_threads=1, allow_soft_placement=False)
    try:
        with graph.as_default():
            tf.compat.v1.set_random_seed(0)
            meta = type(meta_graph)()
            meta.CopyFrom(meta_graph)
            for node in meta.graph_def.node:
                device = node.device.lower()
                node.device = HOST if ("cpu" in device and "gpu" not in device) else GPU_STANDIN
            tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
            init = tf.compat.v1.global_variables_initializer()
            variables = sorted(tf.compat.v1.global_variables(), key=lambda v: v.name)
            targets = [graph.get_operation_by_name(f) for f in fetches]
            loss_tensor = None
            if loss:
                try:
                    loss_tensor = graph.get_tensor_by_name(loss)
                except (KeyError, ValueError):
                    loss_tensor = None
            placeholders = [op for op in graph.get_operations() if op.type == "Placeholder"]
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(init)
            losses = []
            for step in range(steps):
                feed = {}
                for op in placeholders:
                    t = op.outputs[0]
                    if t.shape.rank is None:
                        continue
                    feed[t] = _feed_value(op.name, t.shape.as_list(), t.dtype, batch_size, step)
                out = sess.run({"train": targets, "loss": loss_tensor} if loss_tensor is not None
                               else {"train": targets}, feed_dict=feed)
                if loss_tensor is not None:
                    losses.append(np.asarray(out["loss"]))
            values = dict(zip((v.name for v in variables), sess.run(variables)))
        placements = {op.name: op.device for op in graph.get_operations() if op.name.startswith("lms/")}
    except LmsError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LmsError(f"the graph failed to run on CPU: {text}") from None
    return StepRun(tuple(losses), values, placements)


def first_difference(a: StepRun, b: StepRun) -> str | None:
    """None when both runs are bit-identical; else what differs first."""
    for step, (x, y) in enumerate(zip(a.losses, b.losses)):
        if x.tobytes() != y.tobytes():
            return f"loss at step {step}: {x!r} != {y!r}"
    if len(a.losses) != len(b.losses):
        return "different number of losses"
    if sorted(a.variables) != sorted(b.variables):
        return "different variables"
    for name in sorted(a.variables):
        x, y = a.variables[name], b.variables[name]
        if x.shape != y.shape or x.tobytes() != y.tobytes():
            return f"variable {name}"
    return None
