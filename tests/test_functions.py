"""Graphs whose step lives in the function library: calls inlined (lmscli.graph.inline), planned and
rewritten inside the bodies, trained bit-identically.

``tf2_step/`` is a TensorFlow 2 SavedModel (sample_graphs/tf2_step.py): its signature ``train`` is
one StatefulPartitionedCall whose body calls the step, whose body calls the residual blocks'
forward and backward functions; its variables have no initializer (their values are in the
checkpoint). Before inlining, lms saw three ops and no tensor of the step.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmscli import api
from lmscli.graph import inline
from lmscli.model import loops
from lmscli.prove import steps
from tests.conftest import graph_def_from_nodes, invoke, trained_alike

CALLS = {"PartitionedCall", "StatefulPartitionedCall"}


def _raw_saved_model(path):
    """The SavedModel's MetaGraphDef as written (calls not inlined)."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((path / "saved_model.pb").read_bytes())
    return saved.meta_graphs[0]


@pytest.fixture(scope="module")
def tf2_step(samples):
    model = api.load(str(samples / "tf2_step"))
    return model, api.prepare(model)


def test_the_step_is_inlined_and_fetched_from_its_signature(tf2_step):
    model, prepared = tf2_step
    assert model.fetch_source == "signature train" and model.fetches == ("StatefulPartitionedCall",)
    left = [n.name for n in model.graph_def.node if n.op in CALLS]
    assert sorted(left) == ["StatefulPartitionedCall_1", "StatefulPartitionedCall_2"]  # save, restore
    assert any("function call(s) inlined" in note for note in model.notes)
    ops = {prepared.view.ops[i] for i in range(len(prepared.view.names))}
    assert {"Conv2D", "Conv2DBackpropFilter", "AssignVariableOp"} <= ops
    analysis = api.analyze(prepared)
    assert analysis.peak_bytes > 8 * 2**20  # the blocks' activations (1 MiB each), not 3 opaque ops
    assert model.meta_graph.signature_def["train"].outputs["loss"].name == "StatefulPartitionedCall/output_0:0"


def test_a_saved_models_learning_parameters_are_its_trainable_variables(tf2_step):
    """A TensorFlow 2 SavedModel has no trainable_variables collection: its object graph says
    which variables are trainable (QA r51: analyze gave all variables, the optimizer's
    momentum included, as learning parameters)."""
    model, prepared = tf2_step
    analysis = api.analyze(prepared)
    trainable = [n.variable for n in model.meta_graph.object_graph_def.nodes
                 if n.WhichOneof("kind") == "variable" and n.variable.trainable]
    sizes = [4 * int(np.prod([d.size for d in v.shape.dim])) for v in trainable]  # (float32)
    assert trainable and analysis.parameter_bytes == sum(sizes)
    assert 2 * analysis.parameter_bytes <= analysis.variable_bytes  # SGD's momentum: one slot per parameter


def test_the_inlined_step_trains_as_the_calls_do(samples, tf2_step):
    """TensorFlow runs the SavedModel's calls; lms's inlined graph must compute the same bits."""
    model, _prepared = tf2_step
    raw = _raw_saved_model(samples / "tf2_step")
    calls = steps.run_steps(raw, ["StatefulPartitionedCall"], steps=2, loss="StatefulPartitionedCall:0")
    inlined = steps.run_steps(model.meta_graph, list(model.fetches), steps=2,
                              loss=steps.default_loss(model.meta_graph))
    assert len(calls.variables) > 50 and len(calls.losses) == 2
    assert steps.compare(calls, inlined) is None


def test_a_plan_inside_the_function_bodies_trains_bit_identically(samples, runner, tmp_path):
    out = tmp_path / "tf2_step.lms.meta"
    result = invoke(runner, "rewrite", samples / "tf2_step", out, "--gpu-mem", "60%", "--reserve", "0", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["swap_ins"] >= 3
    swapped = [s["tensor"] for s in doc["plan"]["swaps"]]
    assert all(name.startswith("StatefulPartitionedCall/") for name in swapped)  # inside the bodies
    original = api.load(str(samples / "tf2_step"))
    rewritten = api.load(str(out))
    assert rewritten.fetches == original.fetches  # the signature came along
    before = steps.run_steps(original.meta_graph, list(original.fetches), steps=2)
    after = steps.run_steps(rewritten.meta_graph, list(rewritten.fetches), steps=2)
    assert steps.compare(before, after) is None


def _call_graph(control=False, colocate=False):
    """``y = f(x)`` through a StatefulPartitionedCall; f's body: ``Square(x)`` (+ a Const)."""
    from tensorflow.core.framework import attr_value_pb2, function_pb2

    fdef = function_pb2.FunctionDef()
    fdef.signature.name = "f"
    fdef.signature.input_arg.add(name="x", type=1)
    fdef.signature.output_arg.add(name="y", type=1)
    sq = fdef.node_def.add(name="sq", op="Square", input=["x"])
    sq.attr["T"].type = 1
    c = fdef.node_def.add(name="c", op="Const")
    c.attr["dtype"].type = 1
    c.attr["value"].tensor.dtype = 1
    c.attr["value"].tensor.float_val.append(2.0)
    mul = fdef.node_def.add(name="mul", op="Mul", input=["sq:y:0", "c:output:0"])
    mul.attr["T"].type = 1
    if colocate:
        mul.attr["_class"].list.s.append(b"loc:@sq")
    fdef.ret["y"] = "mul:z:0"
    types = {"list": {"type": [1]}}
    nodes = [
        ("x", "Placeholder", [], {"dtype": {"type": 1}}),
        ("gate", "NoOp", [], {}),
        ("call", "StatefulPartitionedCall", ["x"] + (["^gate"] if control else []),
         {"f": {"func": attr_value_pb2.NameAttrList(name="f")}, "Tin": types, "Tout": types}),
        ("out", "Identity", ["call"], {"T": {"type": 1}}),
        ("after", "NoOp", ["^call"], {}),
    ]
    graph_def = graph_def_from_nodes(nodes)
    graph_def.library.function.add().CopyFrom(fdef)
    return graph_def


def test_inlining_keeps_every_reference_to_the_call():
    """Before: x -> call(f) -> out, ^call -> after. After: x -> call/x -> call/sq -> call/mul ->
    call/output_0 -> out; the NoOp "call" waits for the output, so ^call still means "f ran"."""
    graph_def = _call_graph(control=True, colocate=True)
    before = graph_def.SerializeToString(deterministic=True)
    done = inline.inline_calls(graph_def)
    assert graph_def.SerializeToString(deterministic=True) == before  # a new graph; the input is untouched
    nodes = {n.name: n for n in done.graph_def.node}
    assert done.calls == ("call",) and not done.left
    assert nodes["call"].op == "NoOp" and "^call/output_0" in nodes["call"].input
    assert list(nodes["out"].input) == ["call/output_0:0"]
    assert list(nodes["after"].input) == ["^call"]
    assert list(nodes["call/x"].input) == ["x", "^gate"]  # the call's control inputs hold the body back
    assert "^gate" in nodes["call/c"].input  # (a node without inputs too)
    assert list(nodes["call/mul"].input) == ["call/sq:0", "call/c:0"]
    assert list(nodes["call/mul"].attr["_class"].list.s) == [b"loc:@call/sq"]
    assert done.renamed == {"call:0": "call/output_0:0"}


def test_inlined_calls_compute_what_the_calls_compute():
    import numpy as np
    import tensorflow as tf

    graph_def = _call_graph(control=True)
    done = inline.inline_calls(graph_def)
    values = []
    for gd in (graph_def, done.graph_def):
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(gd, name="")
        with tf.compat.v1.Session(graph=graph) as sess:
            values.append(sess.run("out:0", {"x:0": np.float32(3.0)}))
    assert values[0] == values[1] == np.float32(18.0)


def test_a_call_that_cannot_be_inlined_is_left_and_said():
    graph_def = _call_graph()
    call = next(n for n in graph_def.node if n.name == "call")
    call.input.append("x")  # two inputs for one argument
    done = inline.inline_calls(graph_def)
    assert not done.calls and done.left == (("call", "2 inputs for 1 arguments"),)
    assert any(n.op == "StatefulPartitionedCall" for n in done.graph_def.node)


def test_a_tf2_step_calling_nested_functions_is_rewritten_and_runs_back():
    """lmscli.tf2 on a step whose layers are nested tf.functions (forward and backward functions
    called from the step): the swaps land inside their bodies; same losses and variables."""
    import numpy as np
    import tensorflow as tf

    from lmscli import tf2

    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((128, 128)).astype(np.float32) * 0.05) for _ in range(5)]

    @tf.function
    def layer(h, w):
        return tf.nn.relu(h @ w) + 0.5 * h

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = layer(h, w)
            loss = tf.reduce_mean(h * h)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.01 * g)
        return loss

    spec = tf.TensorSpec([1024, 128])
    fitted = tf2.rewrite(step.get_concrete_function(spec), gpu_mem="60%", reserve=0.0)
    assert fitted.plan.swaps and all("PartitionedCall" in s.tensor for s in fitted.plan.swaps), fitted.plan.swaps
    batches = [(rng.standard_normal((1024, 128)).astype(np.float32),) for _ in range(2)]
    runs = trained_alike((step, fitted), weights, batches)
    assert runs[0] == runs[1]


def _control_flow_saved_model(path):
    """A TensorFlow 2 SavedModel whose step has a tf.cond on a fed predicate (a functional If,
    its gradient a StatelessIf) and a tf.range loop (a functional While, and its gradient's)."""
    import tensorflow as tf

    class Step(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.random.stateless_normal([128, 128], seed=[1, 2]) * 0.05)
            self.v = tf.Variable(tf.random.stateless_normal([128, 128], seed=[1, 3]) * 0.05)

        @tf.function(input_signature=[tf.TensorSpec([1024, 128]), tf.TensorSpec([], tf.bool)])
        def train(self, x, p):
            with tf.GradientTape() as tape:
                h = x
                for _ in range(4):  # activations held for the backward pass, outside loops
                    h = tf.nn.relu(h @ self.w) + 0.5 * h
                h = tf.cond(p, lambda: tf.nn.relu(h @ self.v) * 2.0, lambda: h + 1.0)
                for _ in tf.range(3):
                    h = tf.tanh(h @ self.v)
                loss = tf.reduce_mean(h * h)
            grads = tape.gradient(loss, [self.w, self.v])
            self.w.assign_sub(0.1 * grads[0])
            self.v.assign_sub(0.1 * grads[1])
            return {"loss": loss}

    step = Step()
    tf.saved_model.save(step, str(path), signatures={"train": step.train})
    return path


@pytest.fixture(scope="module")
def control_flow_step(tmp_path_factory):
    return _control_flow_saved_model(tmp_path_factory.mktemp("tf2cf") / "step")


def test_functional_control_flow_is_lowered_and_trains_as_written(control_flow_step):
    """Both predicate values are fed over the 4 steps; the lowered graph computes the same bits."""
    import tensorflow as tf

    assert {bool(steps._feed_value("train_p", [], tf.bool, 2, k)) for k in range(4)} == {True, False}
    model = api.load(str(control_flow_step))
    assert any("If/While/Case op(s) lowered" in note for note in model.notes)
    prepared = api.prepare(model)
    view = prepared.view
    assert not {view.ops[i] for i in range(len(view.names))} & inline.FUNCTIONAL_OPS
    assert any(view.in_loop(i) for i in range(len(view.names))) and any(view.branch_tags())
    # TensorFlow 2's loop passes its bound on as a loop variable; its gradient pops TensorLists
    trips = sorted(loop.trips for loop in loops.trip_counts(view).values())
    assert trips == [3, 3], loops.trip_counts(view)
    kept = loops.storage(view)
    assert kept and all(view.ops[s.writer] == "TensorListPushBack" for s in kept)
    raw = _raw_saved_model(control_flow_step)
    out = raw.signature_def["train"].outputs["loss"].name
    before = steps.run_steps(raw, [out.split(":")[0]], steps=4, loss=out)
    lowered = steps.run_steps(model.meta_graph, list(model.fetches), steps=4, loss=steps.default_loss(model.meta_graph))
    assert steps.compare(before, lowered) is None


def test_a_plan_with_lowered_control_flow_trains_bit_identically(control_flow_step, tmp_path):
    model = api.load(str(control_flow_step))
    prepared = api.prepare(model)
    device = api.make_device(gpu_mem=int(0.9 * api.analyze(prepared).peak_bytes), reserve=0.0)
    result = api.tune(prepared, device)
    assert result.fits and result.plan.swaps
    new_graph, _report = api.rewrite(prepared, result.plan)
    before = steps.run_steps(model.meta_graph, list(model.fetches), steps=4)
    after = steps.run_steps(new_graph, list(model.fetches), steps=4)
    assert steps.compare(before, after) is None


def test_a_tf2_step_with_a_cond_and_a_loop_is_rewritten_and_runs_back():
    """lmscli.tf2 on a step with tf.cond and a tf.range loop: lowered, planned, and run back (as a
    wrapped function: lowered control flow cannot go into a tf.function) with both predicates."""
    import numpy as np
    import tensorflow as tf

    from lmscli import tf2

    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((128, 128)).astype(np.float32) * 0.05) for _ in range(4)]

    @tf.function
    def step(x, p):
        with tf.GradientTape() as tape:
            h = x
            for w in weights[:3]:
                h = tf.nn.relu(h @ w) + 0.5 * h
            h = tf.cond(p, lambda: tf.nn.relu(h @ weights[3]) * 2.0, lambda: h + 1.0)
            for _ in tf.range(3):
                h = tf.tanh(h @ weights[3])
            loss = tf.reduce_mean(h * h)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.01 * g)
        return loss

    concrete = step.get_concrete_function(tf.TensorSpec([1024, 128]), tf.TensorSpec([], tf.bool))
    fitted = tf2.rewrite(concrete, gpu_mem="90%", reserve=0.0)
    # (swaps, or the loop's gradient stacks kept on the host)
    assert (fitted.plan.swaps or fitted.plan.host_stacks) and any("lowered" in note for note in fitted.model.notes)
    feeds = [(rng.standard_normal((1024, 128)).astype(np.float32), tf.constant(p)) for p in (True, False, True)]
    runs = trained_alike((step, fitted), weights, feeds)
    assert runs[0] == runs[1]
