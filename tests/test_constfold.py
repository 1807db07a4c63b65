"""What TensorFlow's runtime folds into constants after Grappler (lmscli.graph.constfold), and the
step a stand-in run fetches (its loss too): both decide what the model of the graph TensorFlow
runs holds."""

from __future__ import annotations

import numpy as np
import pytest

from lmscli import api
from lmscli.graph.constfold import MAX_CONSTANT_BYTES, runtime_constants
from lmscli.analysis import run_graph
from lmscli.graph.graphview import GraphView, TensorInfo
from tests.conftest import assert_within_fidelity, graph_def_from_nodes, v1_training_graph

MEAN_GRAD_BYTES = 1024 * 2048 * 4  # the gradient of a mean over the 1024 x 2048 activation


def _view(nodes, sizes):
    """A GraphView of ``(name, op, inputs, device)`` nodes, each output float32 of ``sizes[name]`` bytes."""
    graph_def = graph_def_from_nodes([(name, op, inputs, None) for name, op, inputs, _ in nodes])
    for node, (_, _, _, device) in zip(graph_def.node, nodes):
        node.device = device
    facts = {name: (TensorInfo((size // 4,), "float32", 4, size),) for name, size in sizes.items()}
    return GraphView(graph_def, facts)


def _folded(view) -> set[str]:
    return {f"{view.names[i]}:{k}" for i, k in runtime_constants(
        view, stateful=lambda op: op.startswith("Random"), cpu_kernel=lambda op: op != "GpuOnly")}


def test_a_constant_computation_read_by_the_step_becomes_a_constant():
    """Only the tensors the step reads from a computation of constants become constants (not its
    inner ones, not the constants themselves); a constant with a control input, a stateful op, an
    op without a CPU kernel, an input from another device or an output over the size limit stops
    the folding."""
    gpu, cpu = "/device:GPU:0", "/device:CPU:0"
    view = _view([
        ("c", "Const", [], gpu),
        ("tile", "Tile", ["c", "c"], gpu),
        ("scaled", "Mul", ["tile", "c"], gpu),  # read by the step: folded
        ("x", "Placeholder", [], gpu),
        ("use", "Mul", ["x", "scaled"], gpu),
        ("guarded", "Const", ["^x"], gpu),  # a constant waiting for an op is no seed
        ("g2", "Neg", ["guarded"], gpu),
        ("use2", "Mul", ["x", "g2"], gpu),
        ("noise", "RandomUniform", ["c"], gpu),  # stateful
        ("n2", "Neg", ["noise"], gpu),
        ("use3", "Mul", ["x", "n2"], gpu),
        ("special", "GpuOnly", ["c"], gpu),  # no CPU kernel
        ("use4", "Mul", ["x", "special"], gpu),
        ("host", "Const", [], cpu),
        ("moved", "Neg", ["host"], gpu),  # reads another device's constant: a receive
        ("use5", "Mul", ["x", "moved"], gpu),
        ("big", "Tile", ["c", "c"], gpu),  # over the limit
        ("use6", "Mul", ["x", "big"], gpu),
        ("on_host", "Neg", ["host"], cpu),  # read across devices: folded on its own device
        ("use7", "Mul", ["x", "on_host"], gpu),
    ], {**{name: 4096 for name in ("c", "tile", "scaled", "x", "use", "guarded", "g2", "use2", "noise", "n2",
                                   "use3", "special", "use4", "host", "moved", "use5", "use6", "on_host",
                                   "use7")},
        "big": MAX_CONSTANT_BYTES + 4})
    assert _folded(view) == {"scaled:0", "on_host:0"}


@pytest.fixture(scope="module")
def mean_loss(tmp_path_factory):
    """A layer whose loss is the mean of its 8 MiB activation: the mean's gradient is a Tile of a
    scalar, which Grappler leaves alone and the runtime folds into an 8 MiB constant."""
    path = tmp_path_factory.mktemp("mean") / "mean_loss.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        x = v1.placeholder(tf.float32, [1024, 256], name="x")
        w = v1.get_variable("w", [256, 2048], initializer=v1.glorot_uniform_initializer(seed=1))
        graph.loss = tf.reduce_mean(tf.nn.relu(tf.matmul(x, w)))
    return path


def test_the_graph_tensorflow_runs_holds_the_runtimes_constants(mean_loss):
    from lmscli.analysis import run_graph

    model = api.load(str(mean_loss))
    prepared = api.prepare(model)
    run = run_graph(model, api.with_graph_def(model.meta_graph, prepared.graph_def), prepared.optimized,
                    prepared.view.tensor_facts())
    folded = {run.view.names[i]: run.view.outputs(i)[k].num_bytes for i, k in run.view.runtime_constants}
    assert MEAN_GRAD_BYTES in folded.values() and any("Mean_grad" in name for name in folded), folded
    assert run.schedule.constant_bytes >= MEAN_GRAD_BYTES  # the graph TensorFlow runs
    assert prepared.schedule.constant_bytes >= MEAN_GRAD_BYTES  # as written: what either would fold
    assert api.prepare(model, runtime_folding=False).schedule.constant_bytes < MEAN_GRAD_BYTES


def test_a_stand_in_step_fetches_the_loss(mean_loss):
    """The stand-in fetches the loss with the train op; so does the model of its step (Grappler
    would prune the loss's own ops of a step fetching the train op alone)."""
    model = api.load(str(mean_loss))
    step = api.stand_in_step(model)
    assert step.fetches == (*model.fetches, "loss")
    assert api.stand_in_step(step) is step
    assert "loss" not in api.prepare(model).schedule.names
    assert "loss" in api.prepare(step).schedule.names


@pytest.mark.slow
def test_the_runtimes_constant_is_in_the_predicted_need(mean_loss):
    """The stand-in's need against the prediction: fits at P / 0.97, out of memory at P / 1.10.
    Without the folded 8 MiB constant the model had the mean's gradient live for two ops (and the
    ReLU's gradient in its buffer): P 8 MiB low."""
    from lmscli.prove import realmem
    from lmscli.prove.standin import StandIn

    model = api.load(str(mean_loss))
    with StandIn() as stand_in:
        assert_within_fidelity(stand_in, model, realmem.predict(model, stand_in=stand_in)[0].predicted_standin_bytes)


def test_equal_shapes_of_a_deep_net_of_diamonds_are_found_at_once():
    """QA r50: each swish activation ``h * sigmoid(h)`` reads its input twice, and the keys that
    compare runtime constants were nested tuples whose hashing walked every path back to the
    input: twice as long per layer (`lms analyze` of an EfficientNet-style net ran out of time).
    Keys are interned now, and made without recursion (600 layers go deeper than Python's stack)."""
    from lmscli.graph.constfold import repeated

    nodes, sizes, h = [("x", "Placeholder", [], "")], {"x": 64}, "x"
    for k in range(600):
        nodes += [(f"s{k}", "Sigmoid", [h], ""), (f"m{k}", "Mul", [h, f"s{k}"], "")]
        sizes.update({f"s{k}": 64, f"m{k}": 64})
        h = f"m{k}"
    nodes += [("shape_a", "Shape", [h], ""), ("shape_b", "Shape", [h], ""), ("shape_c", "Shape", ["s3"], "")]
    sizes.update({"shape_a": 4, "shape_b": 4, "shape_c": 4})
    view = _view(nodes, sizes)
    index = {name: i for i, name in enumerate(view.names)}
    folded = {(index[name], 0) for name in ("shape_a", "shape_b", "shape_c")}
    assert repeated(view, folded) == {(index["shape_b"], 0)}  # (shape_c reads another tensor)


@pytest.fixture(scope="module")
def idle_and_repeated(tmp_path_factory):
    """A step with a 4 MiB variable it never reads (another signature's, say), and a segment
    reduction whose gradient makes identical 2 MiB ``zeros_like`` Fills from constants."""
    path = tmp_path_factory.mktemp("idle") / "idle.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        v1.get_variable("unused", [1024, 1024], initializer=v1.zeros_initializer())
        x = v1.placeholder(tf.float32, [4096, 128], name="x")
        w = v1.get_variable("w", [128, 128], initializer=v1.glorot_uniform_initializer(seed=1))
        h = tf.matmul(x, w)
        ids = tf.constant(np.arange(4096) % 64, dtype=tf.int32)
        graph.loss = (tf.reduce_sum(tf.math.unsorted_segment_max(h, ids, 64))
                      + tf.reduce_sum(tf.math.unsorted_segment_max(h * 2.0, ids, 64)))
    return path


def test_idle_variables_are_resident_and_equal_constants_held_once(idle_and_repeated):
    """QA r47: a TensorFlow 2 SavedModel's other signatures held 6.5 MiB of variables the step does
    not read, which a session still initializes (predicted 24 MiB, needed 30); two segment
    reductions' gradients made four equal 8 MiB ``zeros_like`` constants, of which Grappler keeps
    one (the graph as written was counted 36 MiB of constants, its lower bound above the peak of
    the graph TensorFlow runs)."""
    from lmscli.graph.constfold import repeated

    prepared = api.prepare(api.load(str(idle_and_repeated)))
    view = prepared.view
    assert prepared.schedule.variable_bytes == (1024 * 1024 + 128 * 128) * 4  # the unused one too
    fills = {(i, o) for i, o in view.runtime_constants if view.ops[i] == "Fill" and view.outputs(i)[o].num_bytes == 2 << 20}
    again = repeated(view, view.runtime_constants)
    assert len(fills) >= 2 and len(fills - again) == 1, (len(fills), len(again))
    seen = run_graph(prepared.model, prepared.model.meta_graph, prepared.optimized)
    assert seen.schedule.variable_bytes == prepared.schedule.variable_bytes  # (Grappler prunes the idle one)


@pytest.mark.slow
def test_idle_variables_and_held_constants_are_in_the_predicted_need(idle_and_repeated):
    from lmscli.prove import realmem
    from lmscli.prove.standin import StandIn

    model = api.load(str(idle_and_repeated))
    with StandIn() as stand_in:
        assert_within_fidelity(stand_in, model, realmem.predict(model, stand_in=stand_in)[0].predicted_standin_bytes)
