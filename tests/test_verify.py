"""lms verify: a rewrite trains bit-identically on CPU, and its measured peak falls as planned.

Measured in the schedule's order on this machine (tensorflow-cpu 2.21), each graph's allocations
are what lms's executor model predicts within 3% (forwarded buffers counted once, element-wise
kernels reusing their input's buffer, ops one after another), while Grappler's static accounting,
which counts every output as a buffer of its own, is 10-40% above the measurement. (Before the
executor model, the simulator counted as Grappler does and the measurements were 75-82% of it.)
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from lmscli import api
from lmscli.prove import measure, steps, verify
from lmscli.tfimport import tensorflow
from lmscli.verify_cli import verify as verify_command
from tests.conftest import SAMPLES, invoke

NAMES = ["cnn", "unet3d", "resnet50"]


def _lms():
    """The lms group with verify on it (a test group built the same way until cli.py registers it)."""
    from lmscli.cli import LmsGroup, cli

    if "verify" in cli.commands:
        return cli
    group = LmsGroup(name="lms")
    group.add_command(verify_command, "verify")
    return group


def _run(*args):
    return CliRunner().invoke(_lms(), ["verify", *map(str, args)], catch_exceptions=False)


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    """name -> (original path, rewritten path, RewriteReport), each made once."""
    made = {}

    def make(name):
        if name not in made:
            model = api.load(str(SAMPLES / f"{name}.meta"))
            prepared = api.prepare(model)
            facts = api.analyze(prepared)
            budget = int(facts.peak_bytes * 0.75)
            if budget < facts.lower_bound_bytes:  # ResNet-50 at 64^2: weights dominate; half-way to the bound
                budget = (facts.lower_bound_bytes + facts.peak_bytes) // 2
            result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0), check=False)
            new_meta, report = api.rewrite(prepared, result.plan)
            out = tmp_path_factory.mktemp(name) / f"{name}.lms.meta"
            api.save(model, new_meta, str(out))
            made[name] = (SAMPLES / f"{name}.meta", out, report)
        return made[name]

    return make


@pytest.fixture(scope="module")
def verified(rewritten):
    """name -> (exit code, JSON document) of ``lms verify --json``, each run once."""
    done = {}

    def run(name):
        if name not in done:
            original, out, _ = rewritten(name)
            result = _run(original, out, "--json")
            done[name] = (result.exit_code, json.loads(result.stdout))
        return done[name]

    return run


@pytest.mark.parametrize("name", NAMES)
def test_rewrite_trains_bit_identically(verified, rewritten, name):
    code, doc = verified(name)
    assert code == 0
    assert doc["identical"] is True and doc["first_difference"] is None
    assert doc["steps"] == 2 and doc["loss"] == "loss:0" and doc["variables"] > 10
    report = rewritten(name)[2]
    assert doc["rewritten"]["swap_nodes"] == report.swap_outs + report.swap_ins
    landed = report.swap_ins  # each swap-in is read on the GPU through one Identity
    assert report.sent == 0  # (a GPU plan's swap-outs read the tensor itself)
    assert doc["rewritten"]["swap_nodes"] + doc["rewritten"]["recompute_nodes"] + landed == len(report.added_nodes) > 0
    assert doc["original"]["swap_nodes"] == doc["original"]["recompute_nodes"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_measured_peak_falls_where_the_plan_says(verified, name):
    _, doc = verified(name)
    a, b = doc["original"], doc["rewritten"]
    print(f"\n{name}: measured {a['measured_peak_bytes']:,} -> {b['measured_peak_bytes']:,}; simulated "
          f"{a['simulated_peak_bytes']:,} -> {b['simulated_peak_bytes']:,}; Grappler {a['grappler_peak_bytes']:,} "
          f"-> {b['grappler_peak_bytes']:,}")
    assert b["simulated_peak_bytes"] < a["simulated_peak_bytes"]  # the plan says it falls
    assert b["measured_peak_bytes"] < a["measured_peak_bytes"]
    assert b["measured_tensor_peak_bytes"] < a["measured_tensor_peak_bytes"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("which", ["original", "rewritten"])
def test_measured_agrees_with_the_executor_model(verified, name, which):
    """Measured in the schedule's order, the step's allocations are what the executor model
    predicts (forwarded buffers, in-place reuse, ops one after another) within 3%; Grappler's
    accounting is well above both."""
    _, doc = verified(name)
    g = doc[which]
    measured, simulated = g["measured_peak_bytes"], g["simulated_peak_bytes"]
    print(f"\n{name} {which}: measured {measured:,} = {measured / simulated:.1%} of simulated {simulated:,}; "
          f"Grappler {g['grappler_peak_bytes']:,}")
    # RunMetadata of a step holds only what the step allocates; the variables were allocated before
    # (initializer, first update of Momentum/Adam slots): measured from those runs, they are exactly
    # the variable storage the simulator adds.
    assert g["measured_resident_bytes"] == g["variable_bytes"]
    assert abs(measured / simulated - 1.0) <= 0.03
    assert g["grappler_peak_bytes"] > 1.1 * measured
    assert not any("of the simulated one" in note for note in doc["notes"])


def test_json_document(verified):
    _, doc = verified("cnn")
    assert doc["schema"] == "lms.verify" and doc["version"] == 1
    for key in ("identical", "first_difference", "steps", "original", "rewritten", "notes"):
        assert key in doc
    for which in ("original", "rewritten"):
        for key in ("measured_peak_bytes", "simulated_peak_bytes", "grappler_peak_bytes"):
            assert isinstance(doc[which][key], int) and doc[which][key] > 0
    assert json.loads(json.dumps(doc)) == doc


def test_table_output(rewritten):
    original, out, _ = rewritten("cnn")
    result = _run(original, out, "--no-measure", "--steps", "1", "--no-color")
    assert result.exit_code == 0
    assert "simulated" in result.stdout and "Grappler" in result.stdout
    assert "identical" in result.stdout and "bit-identical after 1 step" in result.stdout


def _rewire_one_consumer(meta_graph):
    """Point one ReluGrad's features at another Relu output of the same shape and dtype."""
    tf = tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.import_meta_graph(meta_graph, clear_devices=True)
    relus = [op.outputs[0] for op in graph.get_operations() if op.type == "Relu"]
    for node in meta_graph.graph_def.node:
        if node.op != "ReluGrad":
            continue
        features = graph.get_tensor_by_name(node.input[1] if ":" in node.input[1] else node.input[1] + ":0")
        source = features
        while source.op.type == "Identity":  # through the swap-in
            source = source.op.inputs[0]
        for other in relus:
            if other is not source and other.shape == features.shape and other.dtype == features.dtype:
                node.input[1] = other.op.name
                return node.name, other.op.name
    raise AssertionError("no ReluGrad with a same-shaped Relu to rewire to")


def test_broken_rewrite_is_caught(rewritten, tmp_path):
    original, out, _ = rewritten("cnn")
    model = api.load(str(out))
    consumer, wrong = _rewire_one_consumer(model.meta_graph)
    broken = tmp_path / "broken.meta"
    api.save(model, model.meta_graph, str(broken))
    result = _run(original, broken, "--json", "--no-measure")
    assert result.exit_code == verify.EXIT_DIFFERENT == 4
    doc = json.loads(result.stdout)
    assert doc["identical"] is False
    assert doc["first_different_variable"]  # names the variable
    assert result.stderr.startswith("lms: error: ")
    assert f"variable {doc['first_different_variable']}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_measurement_is_reproducible_and_really_copies(rewritten):
    _, out, report = rewritten("cnn")
    model = api.load(str(out))
    order = verify.measurement_order(api.prepare(model))
    first = measure.measure_peak(model.meta_graph, model.fetches, order=order)
    second = measure.measure_peak(model.meta_graph, model.fetches, order=order)
    assert first.tensor_peak_bytes == second.tensor_peak_bytes
    assert first.curve[-1][1] == 0  # a step frees all it allocates (variables were allocated before)
    assert len(first.copies) == report.swap_outs + report.swap_ins
    outs = [n for n in first.placements if "-lms-swapout-" in n]
    assert outs and all(first.placements[n].endswith("device:CPU:0") for n in outs)
    assert first.host_peak_bytes > 0  # the swap-outs hold real host copies


def _with_grappler_swap(meta_graph):
    """Grappler's memory optimizer style: a _CopyFromGpuToHost/_CopyFromHostToGpu pair on one input."""
    from tensorflow.core.framework import types_pb2

    meta = type(meta_graph)()
    meta.CopyFrom(meta_graph)
    nodes = meta.graph_def.node
    consumer = next(n for n in nodes if n.op == "ReluGrad")
    gpu = "/job:localhost/replica:0/task:0/device:GPU:0"
    out = nodes.add(name="swap_out_x", op="_CopyFromGpuToHost", device=gpu)
    out.input.append(consumer.input[1])
    out.attr["T"].type = types_pb2.DT_FLOAT
    into = nodes.add(name="swap_in_x", op="_CopyFromHostToGpu", device=gpu)
    into.input.extend(["swap_out_x", "^" + consumer.input[0].split(":")[0]])
    into.attr["T"].type = types_pb2.DT_FLOAT
    consumer.input[1] = "swap_in_x"
    return meta


def test_gpu_only_copy_ops_run_as_identity():
    model = api.load(str(SAMPLES / "cnn.meta"))
    other = api.Model("grappler.meta", "metagraph", _with_grappler_swap(model.meta_graph), model.fetches)
    result = verify.verify(model, other, steps=1)
    assert result.identical
    assert result.rewritten.swap_nodes == 2
    assert result.rewritten.measured.copies == ("swap_out_x", "swap_in_x")
    assert any("_CopyFromGpuToHost" in note for note in result.notes)


def test_refuses_ops_it_cannot_run(tmp_path):
    model = api.load(str(SAMPLES / "mlp.meta"))
    meta = type(model.meta_graph)()
    meta.CopyFrom(model.meta_graph)
    node = next(n for n in meta.graph_def.node if n.op == "Relu")
    node.op = "LmsNoSuchOp"
    path = tmp_path / "odd.meta"
    api.save(model, meta, str(path))
    result = _run(SAMPLES / "mlp.meta", path, "--no-measure")
    assert result.exit_code == 1
    assert "cannot run the graph on CPU: op type LmsNoSuchOp" in result.stderr



@pytest.mark.parametrize("gpu_mem", [(), ("--gpu-mem", "64MiB")], ids=["plain", "stand-in"])
def test_two_unrelated_graphs_are_no_original_and_rewrite(gpu_mem):
    """Graphs training different variables are not an original and its rewrite: a usage mistake
    (exit 1, before any step runs), not "different results" (exit 4; QA r45)."""
    result = _run(SAMPLES / "cnn.meta", SAMPLES / "two_gpu_cnn.meta", *gpu_mem)
    assert result.exit_code == 1, result.output
    assert "is not a rewrite of" in result.stderr and "their variables differ" in result.stderr


def test_a_graph_without_the_originals_step_is_no_rewrite_of_it():
    """QA r54: a graph lacking an op of the original's step read "--fetch names no node 'AdamD'",
    where no --fetch was given."""
    result = _run(SAMPLES / "cnn.meta", SAMPLES / "frozen_cnn.pb")
    assert result.exit_code == 1, result.output
    assert (f"{SAMPLES / 'frozen_cnn.pb'} is not a rewrite of {SAMPLES / 'cnn.meta'}: it has no node "
            "'apply_gradients', which the original's step runs (from train_op)") in result.stderr, result.stderr
    assert "--fetch" not in result.stderr


def test_chain_leaves_control_flow_alone():
    """Measuring in schedule order never chains into a while loop or after its Exit (that deadlocks)."""
    model = api.load(str(SAMPLES / "while_rnn.meta"))
    meta = type(model.meta_graph)()
    meta.CopyFrom(model.meta_graph)
    regions, _conds = measure._control_flow_regions(meta.graph_def)
    ops = {n.name: n.op for n in meta.graph_def.node}
    assert any(ops[n] == "Enter" for n in regions) and any(ops[n] == "Exit" for n in regions)
    assert any(n.startswith("apply_gradients/") for n in regions)  # downstream of the gradient loop
    before = {n.name: list(n.input) for n in meta.graph_def.node}
    assert measure.serialize(meta, [n.name for n in meta.graph_def.node]) > 0
    for node in meta.graph_def.node:
        if node.name in regions:
            assert list(node.input) == before[node.name]


def test_the_nodes_of_a_cond_branch_are_chained_among_themselves():
    """In a cond branch the measurement chains only nodes of the same branch: never a node outside
    the branch (a dead branch would stop it) nor one of the other branch."""
    from lmscli.graph.graphview import GraphView

    model = api.load(str(SAMPLES / "cond_cnn.meta"))
    meta = type(model.meta_graph)()
    meta.CopyFrom(model.meta_graph)
    _loops, conds = measure._control_flow_regions(meta.graph_def)
    before = {n.name: set(n.input) for n in meta.graph_def.node}
    tags = GraphView(meta.graph_def).branch_tags()
    index = {n.name: k for k, n in enumerate(meta.graph_def.node)}
    assert measure.serialize(meta, [n.name for n in meta.graph_def.node]) > 0
    inside = 0
    for node in meta.graph_def.node:
        for text in set(node.input) - before[node.name]:
            src = text.lstrip("^")
            assert (src in conds) == (node.name in conds)
            if node.name in conds:
                assert tags[index[src]] == tags[index[node.name]] and tags[index[src]]
                inside += 1
    assert inside


def test_live_curve_allocations_before_frees_at_equal_times():
    events = [(0, 100, "a"), (5, 50, "b"), (5, -100, "a"), (9, -50, "b")]
    peak, node, at_peak, curve, end = measure.live_curve(events)
    assert peak == 150 and node == "b" and dict(at_peak) == {"a": 100, "b": 50} and end == 0
    assert curve[-1] == (9, 0)


def test_compare_names_the_loss_step_and_the_variable():
    import numpy as np

    a = steps.StepRun((np.float32(1.0), np.float32(2.0)), {"w:0": np.zeros(3, np.float32), "b:0": np.ones(2)}, {})
    b = steps.StepRun((np.float32(1.0), np.float32(2.5)), {"w:0": np.array([0, 0, 1e-7], np.float32),
                                                            "b:0": np.ones(2)}, {})
    diff = steps.compare(a, b)
    assert diff.loss_step == 1 and diff.variable == "w:0"
    assert steps.first_difference(a, b).startswith("loss at step 1")
    assert steps.first_difference(a, a) is None


def test_measurement_copy_computes_the_same(rewritten):
    """DeepCopy (the copying op the measurement substitutes for swap nodes) is bit-identical."""
    original, out, _ = rewritten("cnn")
    model = api.load(str(original))
    copied = steps.run_steps(api.load(str(out)).meta_graph, model.fetches, steps=1, copies=True)
    plain = steps.run_steps(model.meta_graph, model.fetches, steps=1)
    assert steps.first_difference(plain, copied) is None


@pytest.mark.parametrize("name", ["mlp", "unknown_batch", "while_rnn", "cond_cnn", "two_gpu_cnn"])
def test_every_other_sample_verifies_identical(name, tmp_path):
    """The README's CI pipeline on the remaining samples: lms rewrite (TFLMS parameters that swap
    every distant tensor), then lms verify says identical (exit 0)."""
    from tests.conftest import invoke

    runner = CliRunner()
    out = tmp_path / f"{name}.lms.meta"
    extra = ["--batch-size", "4"] if name == "unknown_batch" else []
    made = invoke(runner, "rewrite", SAMPLES / f"{name}.meta", out, "--swapout-threshold", "2", "-q", *extra)
    assert made.exit_code == 0, made.output
    result = _run(SAMPLES / f"{name}.meta", out, "--no-measure", "--json", *extra)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["identical"] is True and doc["rewritten"]["swap_nodes"] > 0


def _frozen_skip_net(path):
    """A frozen inference GraphDef whose first activation is read again at the end (a skip)."""
    import numpy as np

    tf = tensorflow()
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 32, 32, 8], name="input")
        first = h = tf.nn.relu(tf.nn.conv2d(x, tf.constant(rng.normal(0, 0.1, (3, 3, 8, 8)).astype("float32")), 1, "SAME"))
        for k in range(4):
            h = tf.nn.relu(tf.nn.conv2d(h, tf.constant(rng.normal(0, 0.1, (3, 3, 8, 8)).astype("float32")), 1, "SAME"),
                           name=f"block{k}")
        tf.identity(tf.reduce_sum(tf.concat([h, first], -1), [1, 2]), name="output")
    path.write_bytes(graph.as_graph_def().SerializeToString(deterministic=True))
    return path


def test_frozen_graphs_compare_their_outputs(tmp_path):
    """A frozen inference graph has no loss and no variables: verify compares the fetched outputs,
    so a rewrite that changes a value (a swap-in turned into a negation) is caught."""
    from tests.conftest import invoke

    original = _frozen_skip_net(tmp_path / "skip.pb")
    out = tmp_path / "skip.lms.pb"
    made = invoke(CliRunner(), "rewrite", original, out, "--swapout-threshold", "2", "-q")
    assert made.exit_code == 0, made.output
    same = _run(original, out, "--no-measure", "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["outputs"] == 1
    model = api.load(str(out))
    swap_in = next(n for n in model.graph_def.node if "-lms-swapin-" in n.name)
    swap_in.op = "Neg"
    broken = tmp_path / "broken.pb"
    api.save(model, model.meta_graph, str(broken))
    result = _run(original, broken, "--no-measure", "--json")
    assert result.exit_code == 4 and "output" in json.loads(result.stdout)["first_difference"]


def test_a_rewrite_made_for_a_batch_size_is_verified_at_it(samples, tmp_path, runner):
    """QA: a rewrite made with --batch-size fixes the placeholders' unknown dimensions; verify
    without --batch-size fed the original its default instead, and reported a difference that is
    not there (exit 4). It now takes the size from the rewrite, and refuses another one."""
    out = tmp_path / "unknown_batch.lms.meta"
    made = invoke(runner, "rewrite", samples / "unknown_batch.meta", out, "--gpu-mem", "1.5MiB", "--reserve", "0",
                  "--batch-size", "8", "-q")
    assert made.exit_code == 0, made.output
    checked = invoke(runner, "verify", samples / "unknown_batch.meta", out, "--json")
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.stdout)["identical"]
    wrong = invoke(runner, "verify", samples / "unknown_batch.meta", out, "--batch-size", "4")
    assert wrong.exit_code == 1 and "made for batch size 8" in wrong.output
    # `lms measure ORIGINAL REWRITE` measures both at the rewrite's size too (QA: the original at
    # batch 1 beside its rewrite at 32), and refuses another one.
    from lmscli.prove import realmem

    asked = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(realmem, "measure_need", lambda models, batch_size=None, **_: asked.append(batch_size) or ())
        assert invoke(runner, "measure", samples / "unknown_batch.meta", out, "--json").exit_code == 0
        wrong = invoke(runner, "measure", samples / "unknown_batch.meta", out, "--batch-size", "4")
    assert asked == [8] and wrong.exit_code == 1 and "made for batch size 8" in wrong.output


def test_an_unused_placeholder_of_unknown_size_needs_no_batch_size(tmp_path):
    """A Keras functional model's graph keeps its ``Input`` placeholder (batch dimension unknown)
    beside the one the training step feeds; verify asked for --batch-size for it (QA: tf_keras
    MobileNetV2). Only the placeholders the step runs need a size."""
    tf = tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        v1.placeholder(tf.float32, [None, 8], name="input_1")  # nothing reads it
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        w = v1.get_variable("w", [8, 2], initializer=v1.glorot_uniform_initializer(seed=1))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        v1.add_to_collection("train_op", v1.train.GradientDescentOptimizer(0.1).minimize(loss))
        path = tmp_path / "unused_input.meta"
        v1.train.export_meta_graph(str(path), graph=graph)
    result = _run(path, path, "--no-measure", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"] is True


def test_a_savers_identity_on_the_host_is_no_swap_node():
    """QA: every verify of a TF1 SavedModel noted "1 of 1 swap nodes did not run (save/Identity)":
    the saver's Identity of the checkpoint path sits on the host and reads a string constant on
    the stand-in, as a hand-made swap-out reads a tensor. A string is nobody's swap."""
    from lmscli.prove.steps import place_on_cpu

    tf = tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant([1.0, 2.0], name="x")
        path = tf.constant("ckpt", name="path")
        with tf.device("/device:CPU:0"):
            tf.identity(x, name="x-swapout")
            tf.identity(path, name="save/Identity")
        meta = tf.compat.v1.train.export_meta_graph(graph=graph)
    placed = place_on_cpu(meta, copies=True)
    assert list(placed.swap_outs) == ["x-swapout"]
    assert not placed.notes


def test_a_loop_graph_is_measured_more_than_once_and_its_spread_said(monkeypatch):
    """QA: the executor runs a while loop's iterations in an order of its own, and one measured
    run of a TensorFlow 2 loop step gave 44 or 111 MiB, so a rewrite with no swap node read as
    -62% once and +148% another time. A graph with loops is measured LOOP_MEASUREMENTS times;
    the largest peak is shown and the spread is said. A graph without loops is measured once."""
    import itertools
    from dataclasses import replace

    real = measure.measure_peak
    peaks = itertools.cycle([30 << 20, 90 << 20, 60 << 20])
    calls = []

    def varying(*args, **kwargs):
        calls.append(args[0])
        found = real(*args, **kwargs)
        return replace(found, tensor_peak_bytes=next(peaks) - found.resident_bytes)

    monkeypatch.setattr(measure, "measure_peak", varying)
    model = api.load(str(SAMPLES / "while_rnn.meta"))
    notes: list[str] = []
    _meta, figures = verify._figures(model, tuple(model.fetches), None, True, notes, "original")
    assert len(calls) == verify.LOOP_MEASUREMENTS == 3
    assert figures.measured.peak_bytes == 90 << 20
    assert any("varies between runs, 30.00 MiB to 90.00 MiB in 3" in note for note in notes), notes
    calls.clear()
    plain = api.load(str(SAMPLES / "mlp.meta"))
    verify._figures(plain, tuple(plain.fetches), None, True, [], "original")
    assert len(calls) == 1


def test_an_unseeded_graph_verifies_as_itself_and_its_rewrite(tmp_path):
    """QA r47: random ops the graph left unseeded (initializers and a dropout without a seed:
    TensorFlow seeds them anew in every session) made `lms verify` find a graph different from
    itself. Each gets a seed from its name, the same in both graphs; a rewrite's real change is
    still caught."""
    from tests.conftest import v1_training_graph

    path = tmp_path / "unseeded.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        x = v1.placeholder(tf.float32, [64, 256], name="x")
        h = tf.nn.relu(tf.matmul(x, v1.get_variable("w0", [256, 256])))
        h = tf.nn.dropout(h, rate=0.5)
        graph.loss = tf.reduce_mean(tf.square(tf.matmul(h, v1.get_variable("w1", [256, 8]))))
    model = api.load(str(path))
    assert any(n.op == "RandomUniform" and n.attr["seed"].i == 0 and n.attr["seed2"].i == 0
               for n in model.graph_def.node)
    same = _run(path, path, "--no-measure", "--json")
    assert same.exit_code == 0, same.output
    out = tmp_path / "rewritten.meta"
    made = invoke(CliRunner(), "rewrite", path, out, "--swapout-threshold", "1", "--strategy", "tflms", "-q")
    assert made.exit_code == 0, made.output
    assert _run(path, out, "--no-measure").exit_code == 0
    broken = api.load(str(out))
    swap_in = next(n for n in broken.graph_def.node if "-lms-swapin-" in n.name)
    swap_in.op = "Neg"
    api.save(broken, broken.meta_graph, str(tmp_path / "broken.meta"))
    assert _run(path, tmp_path / "broken.meta", "--no-measure").exit_code == 4


def test_integer_feeds_cover_the_sizes_they_index(tmp_path):
    """QA r47: every integer placeholder was fed 0 or 1, so an embedding's sparse gradients were
    measured at two rows, and a loop bounded by a sequence length ran once, with no word. Ids,
    labels and segment ids are fed over the size they index (the smallest, when several); what
    indexes nothing known is fed 0 and 1 as before, and `lms verify` and `lms measure` say so."""
    from lmscli.prove.steps import feeds, import_graph, integer_bounds, unbounded_integers
    from tests.conftest import v1_training_graph

    path = tmp_path / "ids.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        ids = v1.placeholder(tf.int32, [256], name="ids")
        labels = v1.placeholder(tf.int64, [256], name="labels")
        lengths = v1.placeholder(tf.int32, [256], name="lengths")
        table = v1.get_variable("table", [1000, 16], initializer=v1.glorot_uniform_initializer(seed=1))
        rows = tf.nn.embedding_lookup(table, tf.identity(ids))
        rows = tf.math.unsorted_segment_sum(rows, ids % 256, 256)  # (read through a Mod: no bound from it)
        logits = tf.matmul(rows, v1.get_variable("w", [16, 10], initializer=v1.glorot_uniform_initializer(seed=2)))
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        graph.loss = tf.reduce_mean(xent) + tf.cast(tf.reduce_max(lengths), tf.float32) * 0.0
    model = api.load(str(path))
    imported = import_graph(model.meta_graph, list(model.fetches))
    by_name = {op.name: op for op in imported.placeholders}
    assert integer_bounds(by_name["ids"]) == 1000 and integer_bounds(by_name["labels"]) == 10
    assert integer_bounds(by_name["lengths"]) is None and unbounded_integers(imported.placeholders) == ["lengths"]
    fed = {t.op.name: v for t, v in feeds(imported.placeholders, 1, 0).items()}
    assert fed["ids"].max() > 100 and fed["ids"].max() < 1000 and set(fed["labels"]) == set(range(10))
    assert set(fed["lengths"]) == {0, 1}
    result = _run(path, path, "--no-measure")
    assert result.exit_code == 0, result.output
    assert "note: integer placeholder(s) lengths are fed 0 and 1" in result.stderr


def _length_bound_loop(path):
    """A tanh RNN over at most 64 steps of 128 sequences, its loop running max(lengths) times
    (lengths: an int32 placeholder no size bounds)."""
    from tests.conftest import v1_training_graph

    with v1_training_graph(path) as (tf, v1, graph):
        x = v1.placeholder(tf.float32, [64, 128, 64], name="x")
        lengths = v1.placeholder(tf.int32, [128], name="lengths")
        w = v1.get_variable("w", [64, 256], initializer=v1.glorot_uniform_initializer(seed=1))
        u = v1.get_variable("u", [256, 256], initializer=v1.glorot_uniform_initializer(seed=2))
        trips = tf.minimum(tf.reduce_max(lengths), 64)

        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(x[i], w) + tf.matmul(h, u))

        _, h = v1.while_loop(lambda i, h: i < trips, body, [tf.constant(0), tf.zeros([128, 256])])
        graph.loss = tf.reduce_mean(h)
    return path


@pytest.mark.slow
def test_feed_gives_a_sequence_length_its_value(tmp_path, runner):
    """QA r47 P3: a sequence length was fed 0 and 1, so the loop it bounds ran once in every proof
    and measurement, and lms's model counted it once. ``--feed lengths=64`` fills the placeholder
    in the steps lms runs (`lms verify`, the stand-in) and in the model's loop bounds (the 64
    iterations' gradient stacks counted); a name or a value the graph cannot take is an error."""
    from lmscli.errors import InputError
    from lmscli.prove.standin import StandIn

    path = _length_bound_loop(tmp_path / "rnn.meta")
    plain = json.loads(invoke(runner, "analyze", path, "--json").stdout)
    fed = json.loads(invoke(runner, "analyze", path, "--json", "--feed", "lengths=64").stdout)
    # (64 iterations each keep a 128 KiB state and a 32 KiB input for the gradient: 10 MiB of stacks)
    assert fed["peak_bytes"] - plain["peak_bytes"] > 8 << 20, (plain["peak_bytes"], fed["peak_bytes"])

    imported = steps.import_graph(api.load(str(path)).meta_graph, ["loss"])
    values = {t.op.name: v for t, v in steps.feeds(imported.placeholders, 1, 0, {"lengths": 64}).items()}
    assert values["lengths"].shape == (128,) and set(values["lengths"]) == {64} and values["x"].std() > 0.5
    with pytest.raises(InputError, match="no placeholder of that name"):
        steps.feeds(imported.placeholders, 1, 0, {"length": 64})
    with pytest.raises(InputError, match="takes an integer"):
        steps.feeds(imported.placeholders, 1, 0, {"lengths": 2.5})

    done = _run(path, path, "--no-measure", "--feed", "lengths=64")
    assert done.exit_code == 0, done.output
    assert "fed 0 and 1" not in done.stderr
    assert "fed 0 and 1" in _run(path, path, "--no-measure").stderr
    wrong = invoke(runner, "tune", path, "--gpu-mem", "8MiB", "--feed", "lengths=true")
    assert wrong.exit_code == 1 and "takes an integer" in wrong.stderr
    assert invoke(runner, "tune", path, "--gpu-mem", "8MiB", "--feed", "lengths").exit_code == 2

    # On the stand-in: the step fed 0 and 1 fits under 8 MiB; with 64 iterations it does not.
    model = api.load(str(path))
    with StandIn() as alone, StandIn(feed_values={"lengths": 64}) as fed_in:
        assert alone.run(model.meta_graph, model.fetches, 8 << 20, runs=1, values=False).fits
        assert not fed_in.run(model.meta_graph, model.fetches, 8 << 20, runs=1, values=False).fits


@pytest.mark.parametrize("control_flow_v2", [False, True])
def test_fed_values_decide_loop_counts_and_cond_branches(tmp_path, runner, control_flow_v2):
    """QA r48: a loop bounded by a fed scalar (``i < n``) was counted once (TensorFlow fetches no
    tensor it is fed, so the bound "could not be computed"), and a cond on a fed bool was planned
    with its larger branch. Both now follow --feed, with control flow v1 and v2; a
    PlaceholderWithDefault can be fed too."""
    from tests.conftest import v1_training_graph

    path = tmp_path / "fed.meta"
    with v1_training_graph(path, control_flow_v2=control_flow_v2) as (tf, v1, graph):
        n = v1.placeholder(tf.int32, [], name="n")
        wide = v1.placeholder(tf.bool, [], name="wide")
        x = v1.placeholder_with_default(tf.ones([64, 512]) * 0.1, [64, 512], name="x")
        w = v1.get_variable("w", [512, 512], initializer=v1.glorot_uniform_initializer(seed=1))
        _, h = v1.while_loop(lambda i, h: i < n, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))), [tf.constant(0), x])
        y = v1.cond(wide, lambda: tf.reduce_mean(tf.nn.relu(tf.tile(h, [8, 8]))), lambda: tf.reduce_mean(h))
        graph.loss = y

    def peak(*feeds):
        args = [a for f in feeds for a in ("--feed", f)]
        done = invoke(runner, "analyze", path, "--json", *args)
        assert done.exit_code == 0, done.output
        return json.loads(done.stdout)["peak_bytes"]

    # 50 iterations keep 50 of the loop's 128 KiB states for the gradient; the wide branch's 8 MiB tiles
    assert peak("n=50", "wide=false") - peak("n=2", "wide=false") > 5 << 20
    assert peak("n=2", "wide=true") - peak("n=2", "wide=false") > 8 << 20
    assert peak("n=2", "wide=true", "x=0.5") == peak("n=2", "wide=true")

    def simulated(wide: str) -> int:  # `lms verify`'s figure for the graph as written: one branch too
        done = invoke(runner, "verify", path, path, "--no-measure", "--json", "--feed", "n=2", "--feed", f"wide={wide}")
        assert done.exit_code == 0, done.output
        return json.loads(done.stdout)["original"]["simulated_peak_bytes"]

    assert simulated("true") - simulated("false") > 8 << 20
    wrong = invoke(runner, "analyze", path, "--feed", "wide=2")
    assert wrong.exit_code == 1 and "takes true or false" in wrong.stderr
