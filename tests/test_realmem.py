"""Memory claims checked by real runs under a hard limit, on the stand-in GPU (lmscli.prove).

The graph of the proof is the generator's residual MLP (``synthetic``) at a batch where
activations dominate: 135 MiB without swapping on the stand-in, 26 MiB lower bound, no
convolutions (whose default CPU kernels' scratch once set the minimum of small conv nets; the
stand-in now runs Eigen kernels for their gradients: see lmscli/prove/standin.py).
"""

from __future__ import annotations

import json

import pytest

from lmscli import api
from lmscli.prove.standin import MIB, StandIn
from tests.conftest import SAMPLES, assert_within_fidelity, invoke, stacked_tf2_rnn


def _generated(tmp_path_factory, model: str, **shape):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lms_generate", SAMPLES / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    path = tmp_path_factory.mktemp(model) / f"{model}.meta"
    path.write_bytes(generate.build(model, **shape).SerializeToString(deterministic=True))
    return path


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    return _generated(tmp_path_factory, "synthetic", nodes=600, batch=2048, width=512)


@pytest.fixture(scope="module")
def stand_in():
    with StandIn() as s:
        yield s


@pytest.fixture(scope="module")
def proven(residual, tmp_path_factory):
    """``lms rewrite --stand-in`` half-way from the lower bound to the peak (the default room,
    ``--reserve``, held back), then ``lms verify --gpu-mem`` at that size: (limit, rewritten path,
    verify's JSON, exit code). The rewrite's judge ran the plan on the stand-in at that size."""
    from click.testing import CliRunner

    prepared = api.for_stand_in(api.prepare(api.load(str(residual))))
    bound = api.analyze(prepared).lower_bound_bytes
    out = tmp_path_factory.mktemp("proof") / "residual.lms.meta"
    runner = CliRunner()
    limit = int(bound + 0.5 * (prepared.run_peak_bytes - bound)) // MIB * MIB
    done = invoke(runner, "rewrite", residual, out, "--gpu-mem", limit, "--stand-in", "--judge-runs", "2", "-q", "--plan-out",
                  out.with_suffix(".plan.json"))
    assert done.exit_code == 0, done.output
    checked = invoke(runner, "verify", residual, out, "--gpu-mem", limit, "--json")
    return limit, out, json.loads(checked.stdout), checked.exit_code


@pytest.mark.slow
def test_a_stand_in_plan_applies_as_it_was_made_without_the_flag(proven, residual):
    """A plan made with --stand-in says so, and `lms rewrite --plan` applies it to the step as the
    stand-in runs it (its triggers follow that order, its fetches that step) without being told:
    the same graph as the rewrite that made it (QA: `tune --stand-in --plan-out` then `rewrite
    --plan` failed on a trigger "which runs after ... a consumer" and did not name the flag)."""
    from click.testing import CliRunner

    _limit, out, _doc, _code = proven
    plan = json.loads(out.with_suffix(".plan.json").read_text())
    assert plan["stand_in"] is True and plan["swaps"] + plan.get("recomputes", [])
    judged = plan["predicted"]["stand_in"]  # (--judge-runs 2: two runs under the limit, two under the headroom's)
    assert judged["fits"] and judged["runs_per_limit"] == 2 and judged["runs"] == 4 and judged["headroom_limit_bytes"]
    again = out.with_name("again.meta")
    done = invoke(CliRunner(), "rewrite", residual, again, "--plan", out.with_suffix(".plan.json"))
    assert done.exit_code == 0, done.output
    assert "was made for the stand-in GPU (--stand-in)" in done.stderr
    assert again.read_bytes() == out.read_bytes()


@pytest.mark.slow
def test_original_runs_out_of_memory_and_the_rewrite_trains_bit_identically(proven):
    limit, _out, doc, code = proven
    proof = doc["limit"]
    assert code == 0 and proof["proven"], proof
    assert not proof["original"]["fits"] and proof["original"]["oom_node"]
    assert proof["rewritten"]["fits"] and proof["rewritten"]["runs"] == 3 and proof["rewritten"]["failures"] == 0
    assert proof["identical"] is True and doc["identical"] is True
    assert proof["line"].startswith(f"original: out of memory at {limit / MIB:.2f} MiB; rewritten: trains at")
    # (Under the limit the residual MLP's results now and then differ from its own run without one,
    # as another allocator can make them: the verdict then says so.)
    if proof["limited_difference"] is None:
        assert proof["line"].endswith("bit-identical")
    else:
        assert proof["line"].endswith("bit-identical without a limit (under it, the rewrite's results differ from "
                                      "its own without one: see the note)")
    # The simulator predicted the rewrite under the limit, and the original over it.
    assert doc["rewritten"]["predicted_standin_bytes"] <= limit < doc["original"]["predicted_standin_bytes"]


@pytest.mark.slow
def test_the_rewrites_prediction_is_within_the_fidelity_bounds(proven, stand_in):
    """The fidelity bound on lms's rewrite, not only on originals: the proof's plan (made by `lms
    rewrite --stand-in`), predicted on the stand-in in its own traced order, fits at P / 0.97 and
    runs out of memory at P / 1.10."""
    from lmscli.prove import realmem

    _limit, out, _doc, _code = proven
    model = api.load(str(out))
    assert any("-lms-swapin-" in node.name for node in model.meta_graph.graph_def.node)
    prediction, _ = realmem.predict(model, stand_in=stand_in)
    assert_within_fidelity(stand_in, model, prediction.predicted_standin_bytes)


@pytest.mark.slow
def test_a_broken_plan_is_caught(proven, residual, tmp_path):
    """The same rewrite with every swap-in started by its swap-out (the trigger edges dropped): the
    tensors come straight back, nothing is saved, and verify says so with exit code 5."""
    from click.testing import CliRunner

    limit, out, _doc, _code = proven
    meta = api.load(str(out)).meta_graph
    changed = 0
    for node in meta.graph_def.node:
        if "-lms-swapin-" in node.name:
            data = [i for i in node.input if not i.startswith("^")]
            del node.input[:]
            node.input.extend(data)
            changed += 1
    assert changed
    path = tmp_path / "broken.meta"
    path.write_bytes(meta.SerializeToString())
    done = invoke(CliRunner(), "verify", residual, path, "--gpu-mem", limit, "--runs", "1", "--json")
    assert done.exit_code == 5, done.output
    assert not json.loads(done.stdout)["limit"]["rewritten"]["fits"]


@pytest.fixture(scope="module")
def cnn64(tmp_path_factory):
    return _generated(tmp_path_factory, "cnn", batch=64)


@pytest.fixture(scope="module")
def unet64(tmp_path_factory):
    return _generated(tmp_path_factory, "unet3d", volume=64, batch=1)


@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    """A text classifier over a 4.9 MiB embedding table (``embedding_lookup``: a sparse gradient,
    and a table read by copy), conv1d layers and Adagrad (QA round 37's embedding model)."""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int32, [16, 128], name="ids")
        labels = v1.placeholder(tf.int32, [16], name="labels")

        def weight(name, shape, seed):
            return v1.get_variable(name, shape, initializer=v1.glorot_uniform_initializer(seed=seed), use_resource=True)

        h = tf.nn.embedding_lookup(weight("embedding", [20000, 64], 1), ids)
        for k, width in enumerate((128, 128, 96)):
            h = tf.nn.relu(tf.nn.conv1d(h, weight(f"conv{k}", [5, int(h.shape[-1]), width], 2 + k), 1, "SAME"))
        logits = tf.matmul(tf.reduce_max(h, 1), weight("out", [96, 50], 9))
        loss = tf.identity(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)),
                           name="loss")
        v1.add_to_collection("train_op", v1.train.AdagradOptimizer(0.05).minimize(loss, name="train_op"))
        path = tmp_path_factory.mktemp("embedding") / "embedding.meta"
        v1.train.export_meta_graph(str(path), graph=graph, clear_devices=True)
    return path


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
    """Three Inception blocks (1x1, 3x3 and 5x5 convolutions and a pooling branch, concatenated)
    at 32x32, batch 8, Momentum, its ``train_op`` a group of the update (QA round 39's concat-heavy
    net): the CPU's max-pooling gradients take scratch before their outputs and write over their
    input. Predicted 23 MiB before that was modelled, needs 26. (Built here, not with
    :func:`tests.conftest.v1_training_graph`: with the update itself as ``train_op`` the executor's
    order differs, and the step needs 23, which the old model predicted too.)"""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        images = v1.placeholder(tf.float32, [8, 32, 32, 3], name="images")
        labels = v1.placeholder(tf.float32, [8, 10], name="labels")
        seeds = iter(range(1, 100))

        def conv(h, width, size, name):
            with v1.variable_scope(name):
                w = v1.get_variable("w", [size, size, int(h.shape[-1]), width], use_resource=True,
                                    initializer=v1.glorot_uniform_initializer(seed=next(seeds)))
                b = v1.get_variable("b", [width], initializer=v1.zeros_initializer(), use_resource=True)
                return tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w, 1, "SAME"), b))

        def block(h, name, widths):
            c1, c3r, c3, c5r, c5, cp = widths
            with v1.variable_scope(name):
                return tf.concat([conv(h, c1, 1, "b1"), conv(conv(h, c3r, 1, "b3r"), c3, 3, "b3"),
                                  conv(conv(h, c5r, 1, "b5r"), c5, 5, "b5"),
                                  conv(tf.nn.max_pool2d(h, 3, 1, "SAME"), cp, 1, "bp")], axis=3)

        h = block(block(conv(images, 32, 3, "stem"), "inc1", (16, 16, 24, 4, 8, 8)), "inc2", (24, 24, 32, 8, 16, 16))
        h = block(tf.nn.max_pool2d(h, 3, 2, "SAME"), "inc3", (32, 24, 48, 8, 16, 16))
        w = v1.get_variable("head", [int(h.shape[-1]), 10], initializer=v1.glorot_uniform_initializer(seed=99),
                            use_resource=True)
        logits = tf.matmul(tf.reduce_mean(h, axis=[1, 2]), w)
        loss = tf.identity(tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)),
                           name="loss")
        update = v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="apply_gradients")
        v1.add_to_collection("train_op", tf.group(update, name="train_op"))
        path = tmp_path_factory.mktemp("inception") / "inception.meta"
        v1.train.export_meta_graph(str(path), graph=graph, clear_devices=True)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("graph", ["resnet50", "cnn64", "stack_rnn", "embedding", "inception"])
def test_the_prediction_is_within_ten_percent_of_the_real_need(graph, request, stand_in):
    """The stand-in's predicted need P (executor model of the graph TensorFlow runs, in the CPU
    executor's observed order, with its kernel scratch and the allocator's fragmentation) against
    the smallest limit M that really runs: 0.97 M <= P <= 1.10 M, checked with two runs: the step
    fits at P / 0.97 and runs out of memory at P / 1.10. Measured: ResNet-50 P 399.6 MiB, M 403;
    the CNN at batch 64 P 71.8, M 72, when a 27 MiB convolution col buffer in a fragmented region
    set its need (the stand-in now runs Eigen kernels for convolution gradients, which take none);
    the tanh RNN over 128 steps P 14, M 14, where its gradient loop's iterations running at once
    hold ten weight gradients (P 13 when the model counted one iteration in flight); the embedding
    model P 17, M 17, once the check reads the variables after the step a few at a time (read in
    one run, the copies of its table and slot needed 24 MiB: QA round 37).
    (The tanh RNN's plan is not held here: at 5 MiB both its need, 5 to 7 MiB under load, and its
    prediction, 5 or now and then 7 MiB with another observed order, move by more than 10%.)
    Three Inception blocks: P 26, M 26, once the max-pooling gradients take their scratch before
    their outputs and write over their input, as the CPU kernel does (P 23 before: the 3.5 MiB
    argmax buffer took the 5.9 MiB chunk whole, where the model had put the output)."""
    from lmscli.prove import realmem

    model = api.load(str(SAMPLES / f"{graph}.meta") if graph in ("resnet50", "stack_rnn")
                     else str(request.getfixturevalue(graph)))
    prediction, _ = realmem.predict(model, stand_in=stand_in)
    assert_within_fidelity(stand_in, model, prediction.predicted_standin_bytes)


@pytest.mark.slow
def test_the_holes_a_tf2_rnns_dropped_accumulators_leave_are_predicted(tmp_path, stand_in):
    """The stacked TensorFlow 2 RNN needs 26 to 27 MiB on the stand-in: after each loop, 48 holes
    of 192 KiB lie between the states its gradient keeps, and the 2.25 MiB sequences made next go
    above them. The model, each loop's stores made an iteration at a time, predicts 25 to 26 MiB;
    with its stores one after the other it predicted 23 (-15%), and the step ran out of memory
    there. Held here: the step fits at P / 0.92 and runs out of memory at P / 1.10 (the -3% of
    the fidelity target is not met on this graph)."""
    from lmscli.prove import realmem

    model = api.load(str(stacked_tf2_rnn(tmp_path / "rnn3.meta")))
    predicted = realmem.predict(model, stand_in=stand_in)[0].predicted_standin_bytes
    assert_within_fidelity(stand_in, model, predicted, low=0.92)


@pytest.mark.slow
def test_kernel_scratch_is_what_the_kernel_asked_for(unet64, stand_in):
    """The traced step that observes kernel scratch records requested bytes: with the CPU's default
    kernel (asked for by its label), a 3D U-Net's input gradient at 64^3 asks for a 432 MiB
    temporary (27 taps of a 16 MiB volume); traced on the BFC allocator it was the 512 MiB chunk
    it got, and the prediction of the step's need was 14% high. The stand-in runs convolution
    gradients with TensorFlow's Eigen kernels, which take none."""
    from lmscli.prove import steps

    model = api.load(str(unet64))
    meta = steps.map_gpu_ops(model.meta_graph)[0]
    grad = "gradients/up1/conv_a/Conv3D_grad/Conv3DBackpropInputV2"
    assert stand_in.observe(meta, model.fetches).scratch.get(grad, 0) < MIB
    for node in meta.graph_def.node:
        if node.op.startswith("Conv3DBackprop"):
            node.attr["_kernel"].s = b"custom"
    assert stand_in.observe(meta, model.fetches).scratch[grad] == 27 * 64**3 * 16 * 4


def test_no_plan_is_a_json_document_too(runner, samples):
    done = invoke(runner, "tune", samples / "cnn.meta", "--gpu-mem", "30%", "--json")
    assert done.exit_code == 3
    doc = json.loads(done.stdout)
    assert doc["schema"] == "lms.tune" and doc["fits"] is False and doc["plan"] is None
    assert set(doc["no_fit"]) == {"reason", "budget_bytes", "lower_bound_bytes", "binding_op"}
    assert doc["no_fit"]["lower_bound_bytes"] > doc["no_fit"]["budget_bytes"] and doc["no_fit"]["binding_op"]
    rewritten = invoke(runner, "rewrite", samples / "cnn.meta", "/tmp/never-written.meta", "--gpu-mem", "30%", "--json")
    assert rewritten.exit_code == 3 and json.loads(rewritten.stdout)["schema"] == "lms.rewrite"


@pytest.mark.slow
def test_measure_finds_the_smallest_limit(runner, samples):
    done = invoke(runner, "measure", samples / "mlp.meta", "--runs", "1", "--json")
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert doc["schema"] == "lms.measure" and len(doc["graphs"]) == 1
    need = doc["graphs"][0]
    assert need["min_limit_bytes"] % MIB == 0 and need["min_limit_bytes"] >= MIB
    assert need["predicted_bytes"] > 0 and need["grappler_bytes"] > need["predicted_bytes"]
    assert [fits for _limit, fits in need["probes"]][-1] is True
    assert any(limit == need["min_limit_bytes"] - MIB and not fits for limit, fits in need["probes"])


def test_measure_names_each_graph_below_their_common_folder(tmp_path, monkeypatch):
    """QA: two long paths folded every 10 characters in measure's table ("/work/qa/r | ound29/out |
    m_70MiB.me | ta"), and which row was which could be told only from their order."""
    from lmscli.verify_cli import _short_paths

    monkeypatch.chdir(tmp_path)
    deep = tmp_path.parent / "elsewhere" / "out"
    assert _short_paths([str(deep / "unet_45MiB.meta"), str(deep / "embcond_70MiB.meta")]) == (
        str(deep), ["unet_45MiB.meta", "embcond_70MiB.meta"])
    assert _short_paths(["graphs/a.meta", "graphs/b/c.meta"]) == ("graphs", ["a.meta", "b/c.meta"])
    assert _short_paths(["a.meta"]) == ("", ["a.meta"])
    assert _short_paths(["/opt/models/a.meta", "/var/out/a.lms.meta"]) == (
        "/opt/models, /var/out", ["a.meta", "a.lms.meta"])  # (nothing in common but the root)


def test_measure_runs_an_unrelated_graphs_own_step(samples):
    """`lms measure A B` runs B's step as A's (a rewrite of A has A's train op); a graph without
    those ops runs its own rather than failing (QA: "--fetch names no node 'apply_gradients'" for
    two unrelated graphs, with no --fetch given). An explicit --fetch still applies to all."""
    from lmscli import api
    from lmscli.errors import InputError
    from lmscli.verify_cli import _load_like

    first = api.load(str(samples / "cnn.meta"))
    other = _load_like(str(samples / "tf2_step"), first, None)
    assert list(other.fetches) == list(api.load(str(samples / "tf2_step")).fetches) != list(first.fetches)
    assert list(_load_like(str(samples / "cnn.meta"), first, None).fetches) == list(first.fetches)
    with pytest.raises(InputError, match="--fetch names no node"):
        _load_like(str(samples / "tf2_step"), first, list(first.fetches))


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    """The generator's transformer (two layers of attention and GELU MLP, layer norm): 23 MiB on
    the stand-in, 9.6 MiB lower bound, no convolution scratch."""
    return _generated(tmp_path_factory, "transformer", batch=4, seq=128, d_model=128, heads=4, ffn=512, layers=2)


@pytest.mark.slow
def test_an_attention_model_is_proven_under_a_hard_limit(attention, tmp_path):
    """`lms rewrite --stand-in --gpu-mem 15MiB` on the transformer, then `lms verify --gpu-mem
    15MiB`: the original runs out of memory there, the rewrite trains, bit-identical. (Its smallest
    accepted limit measured 13-14 MiB, the original's need 23 MiB: bench/REAL-MEMORY.md.)"""
    from click.testing import CliRunner

    runner = CliRunner()
    out = tmp_path / "transformer.lms.meta"
    # (--time-limit: the first judged plan after 20 s, not the one that swaps least)
    done = invoke(runner, "rewrite", attention, out, "--gpu-mem", "15MiB", "--stand-in", "--json", "--time-limit", "20")
    assert done.exit_code == 0, done.output
    plan = json.loads(done.stdout)["plan"]
    landings = [g for s in plan["swaps"] for g in s["swap_ins"] if g.get("landing")]
    assert plan["swaps"] and landings  # stand-in swap-ins land at a fixed place
    judged = plan["predicted"]["stand_in"]  # the judge's real runs, recorded in the plan
    assert judged["fits"] and judged["limit_bytes"] == 15 * MIB
    assert judged["runs"] == 2 * api.STAND_IN_JUDGE_RUNS  # five under 15 MiB, five under 14
    assert judged["headroom_limit_bytes"] == 14 * MIB
    assert 0 < judged["peak_in_use_bytes"] <= 15 * MIB
    checked = invoke(runner, "verify", attention, out, "--gpu-mem", "15MiB", "--json")
    doc = json.loads(checked.stdout)
    proof = doc["limit"]
    assert checked.exit_code == 0 and proof["proven"], proof
    assert not proof["original"]["fits"] and proof["rewritten"]["fits"] and proof["identical"] is True
    # The model of the stand-in predicted both: the rewrite within the limit, the original over it.
    assert doc["rewritten"]["predicted_standin_bytes"] <= 15 * MIB < doc["original"]["predicted_standin_bytes"]


@pytest.mark.slow
def test_analyze_on_the_stand_in_gives_its_own_figures(runner, attention):
    """`lms analyze --stand-in`: the peak and lower bound of the step as the stand-in runs it (what
    `--stand-in` plans work with)."""
    done = invoke(runner, "analyze", attention, "--stand-in", "--json")
    assert done.exit_code == 0, done.output
    here = json.loads(done.stdout)
    assert 0 < here["lower_bound_bytes"] <= here["peak_bytes"]
    # The limit the attention test proves a plan at (15 MiB, 10% reserve) is within reach.
    assert here["lower_bound_bytes"] <= 0.9 * 15 * MIB < here["peak_bytes"]


@pytest.mark.slow
def test_the_stand_in_judges_a_plan_even_when_the_model_cannot_read_the_run_graph(residual, monkeypatch):
    """QA: when the graph TensorFlow runs could not be modelled (``run_peak_bytes`` None), the
    judge was skipped, its real runs on the stand-in too, and a plan over the budget was written
    (exit 0) and ran out of memory in `lms verify`. The stand-in's judge now runs regardless, and
    a plan the judge finds over the budget is no plan (exit 3)."""
    from dataclasses import replace

    from lmscli.plan import tuning
    from lmscli.device import STAND_IN_LINK

    prepared = api.for_stand_in(api.prepare(api.load(str(residual))), judge_runs=2)
    bound = api.analyze(prepared).lower_bound_bytes
    limit = int(bound + 0.5 * (prepared.run_peak_bytes - bound)) // MIB * MIB
    unread = replace(prepared)
    unread.__dict__["run_peak_bytes"] = None  # (a cached property)
    result = api.tune(unread, api.make_device(gpu_mem=limit, link=STAND_IN_LINK))
    assert result.fits and result.plan.predicted["stand_in"]["fits"]
    monkeypatch.setattr(tuning, "_tune", lambda *args: replace(result, budget=result.budget // 2))
    with pytest.raises(api.NoFitError, match="the best one found needs"):
        api.tune(unread, api.make_device(gpu_mem=limit, link=STAND_IN_LINK))


@pytest.mark.slow
def test_time_limit_settles_before_another_round_of_real_runs(residual, monkeypatch):
    """QA: `--stand-in --time-limit 20` took 46 s: a round of the judge's real runs (five runs of
    the step) started though it would end past the limit. Once a judged plan is at hand, no round
    starts that, as long as the last, would end past it."""
    import time

    from lmscli import timing
    from lmscli.plan import judge
    from lmscli.plan import tuning
    from lmscli.device import STAND_IN_LINK

    prepared = api.for_stand_in(api.prepare(api.load(str(residual))), judge_runs=2)
    bound = api.analyze(prepared).lower_bound_bytes
    limit = int(bound + 0.5 * (prepared.run_peak_bytes - bound)) // MIB * MIB
    rounds = []
    judged = judge.stand_in_need

    def counted(*args):
        rounds.append(1)
        # The first plan judged needs more than the budget (the search goes on), the next fits.
        need = judged(*args)
        return need if len(rounds) > 1 else args[2].budget + MIB

    monkeypatch.setattr(judge, "stand_in_need", counted)
    # A deadline that a round as long as the first would pass once a plan is judged.
    with timing.Clock(deadline=time.monotonic() + 3600) as clock:
        monkeypatch.setattr(tuning.timing, "round_took", lambda seconds: setattr(
            clock, "round_s", 3600 if len(rounds) >= 2 else 0.0))
        result = api.tune(prepared, api.make_device(gpu_mem=limit, link=STAND_IN_LINK))
    assert result.fits and len(rounds) == 2  # (without the limit, the swap planner's search runs a third)


@pytest.mark.slow
def test_a_plan_the_allocator_model_finds_no_room_for_is_planned_for_more(stand_in, monkeypatch):
    """The planner counts the bytes in use; the stand-in's allocator can need more for them, the
    region cut up by what is live (a 3D U-Net 64³ plan with 66 MiB in use ran out of memory under
    78 MiB, a 16 MiB request failing with 47 MiB in use, in each of the judge's five rounds). On
    the sample 3D U-Net at 14 MiB (its ops left in their order) the first plan fits the budget in
    use and, the allocator model says, needs 16 MiB (it ran out of memory under 14 in two traced
    orders of three, and trained in the third); the tune loop then plans for a larger margin until
    the model finds room under the judge's tighter limit, and that plan trains. (Swap-ins brought
    back later are off here: with them the plans for larger margins differ, and in about one
    traced order of three none of the sixteen was placed, so the plan at hand went to the real
    runs as it is. Without them that still happens in about one traced order of six: the loop
    then returns the plan at hand, and the test observes the step again, up to three times; so it
    does when the fitted plan does not train: under load, in about one suite run of five, the
    plan fitted in that traced order needed 14.8 MiB.)"""
    from lmscli.device import STAND_IN_LINK
    from lmscli.emit.rewriter import emit
    from lmscli.plan import judge, planner, tuning
    from lmscli.plan.planner import tune as plan_tune

    monkeypatch.setattr(planner, "_later_swap_in", lambda *args: None)

    base = api.prepare(api.load(str(SAMPLES / "unet3d.meta")))
    device = api.make_device(gpu_mem=14 * MIB, link=STAND_IN_LINK)
    _, tighter = judge.judged_limits(device)
    options = api.TuneOptions(reorder=False)  # (with the ops' moves of lmscli.plan.ordering, the first plan fits)
    trained = []
    for _attempt in range(3):
        prepared = api.for_stand_in(base, stand_in=stand_in)
        first = plan_tune(prepared, device, options)
        need = judge.region_need(prepared, first.plan, device)
        if need <= tighter:
            continue  # (this order places the first plan: nothing to show)
        assert first.result.peak_bytes <= device.budget < tighter < need
        margins, search = {}, tuning._RunSearch(device.budget, 0)
        fitted = tuning._fitting_the_region(prepared, device, options, margins, first, search)
        if fitted.plan.predicted["region_need_bytes"] > tighter:
            assert fitted.plan.edits == first.plan.edits and not margins  # none placed: the plan at hand goes
            continue
        assert margins[prepared.schedule.device] == search.margin > 0 and "allocator model" in fitted.log[-1]
        again = tuning._fitting_the_region(prepared, device, options, margins, fitted, search)
        assert again.plan.edits == fitted.plan.edits and margins[prepared.schedule.device] == search.margin
        meta, _ = emit(prepared, fitted.plan, force=True)
        verdict = stand_in.run(meta, tuple(prepared.model.fetches), 14 * MIB, runs=3, steps=judge.STAND_IN_JUDGE_STEPS)
        trained.append(verdict.fits)
        if verdict.fits:
            break
    assert trained and trained[-1], trained


def test_a_plan_must_also_fit_with_half_the_reserve_less():
    """QA: a decoder plan left 1.2 MiB free under 20 MiB in the judge's five runs, then ran out of
    memory in 1 of 18 `lms verify` runs; an Inception plan peaked at 23.5 MiB in use under 29 in
    five runs, then needed 29.7 in one verify run of ten; a two-loss net showed 53.9 of 54 MiB in
    use in every run (BFC hands a large request a free chunk whole) and was refused, yet it
    trains under 51. Every plan is judged by as many runs again under the limit less half the
    reserve, whatever its peak in use."""
    from types import SimpleNamespace

    from tensorflow.core.protobuf import meta_graph_pb2

    from lmscli.plan import judge
    from lmscli.prove.standin import StepVerdict

    class Fake:
        def __init__(self, verdicts):
            self.verdicts, self.limits, self.last_verdict, self.judged = list(verdicts), [], None, {}

        def run(self, meta, fetches, limit, **kw):
            self.limits.append(limit)
            self.runs = kw["runs"]
            self.last_verdict = self.verdicts.pop(0)
            return self.last_verdict

    def verdict(fits, peak, need=None):
        return StepVerdict(fits, None, 5 if fits else 3, 0 if fits else 1, False, None,
                           None if fits else "out of memory", None, 1.0, peak, None, need)

    device = api.make_device(gpu_mem=20 * MIB, reserve=0.1)  # budget 18 MiB; half the reserve: 1 MiB
    cases = (([verdict(True, 16 * MIB), verdict(True, 16 * MIB)], [20, 19], True),
             ([verdict(True, int(18.8 * MIB)), verdict(True, int(18.5 * MIB))], [20, 19], True),
             ([verdict(True, 16 * MIB), verdict(False, None, int(19.2 * MIB))], [20, 19], False),  # QA: Inception
             ([verdict(True, 20 * MIB), verdict(False, None, int(19.5 * MIB))], [20, 19], False),
             ([verdict(False, None, 21 * MIB)], [20], False))
    for verdicts, limits, fits in cases:
        fake = Fake(verdicts)
        prepared = SimpleNamespace(stand_in=fake, model=SimpleNamespace(fetches=()), batch_size=1, judge_runs=None)
        need = judge.stand_in_need(prepared, meta_graph_pb2.MetaGraphDef(), device)
        assert [x // MIB for x in fake.limits] == limits
        assert judge.stand_in_need(prepared, meta_graph_pb2.MetaGraphDef(), device) == need  # judged once
        assert len(fake.limits) == len(limits)
        assert (need <= device.budget) == fits
        if len(limits) == 2:  # recorded as one verdict at the limit, of both sets of runs
            assert fake.last_verdict.limit_bytes == 20 * MIB and fake.last_verdict.runs == 5 + verdicts[1].runs
            assert fake.last_verdict.headroom_limit_bytes == 19 * MIB
            assert fake.last_verdict.fits == fits and (fits or "19.00 MiB" in fake.last_verdict.message)
    # --judge-runs: that many runs under each limit, and judged anew (another key)
    fake = Fake([verdict(True, 16 * MIB), verdict(True, 16 * MIB)])
    prepared = SimpleNamespace(stand_in=fake, model=SimpleNamespace(fetches=()), batch_size=1, judge_runs=None)
    judge.stand_in_need(prepared, meta_graph_pb2.MetaGraphDef(), device)
    assert fake.runs == judge.STAND_IN_JUDGE_RUNS
    fake.verdicts = [verdict(True, 16 * MIB), verdict(True, 16 * MIB)]
    prepared.judge_runs = 2
    judge.stand_in_need(prepared, meta_graph_pb2.MetaGraphDef(), device)
    assert fake.runs == 2 and len(fake.limits) == 4


@pytest.mark.slow
def test_a_gpu_plans_swap_outs_leave_the_stand_in_when_its_sends_run(attention, stand_in):
    """A plan made for a GPU has no op waiting for its swap-outs; on the stand-in, whose sends are
    expensive CPU kernels queued behind the ops it runs inline, they leave late. The observed order
    takes the host's swap-out nodes where they really started, so the stand-in's prediction
    follows: QA, a ViT plan predicted at 27 MiB needed 51 (now predicted 51); here the
    transformer's plan at half its peak needs 20-22 MiB, predicted 12 without the host's nodes in
    the order, 20-23 with them. (The point is the floor: the upper bound is 20% here, as the
    largest need over the traced orders, whose sends land at different moments, reached 23 MiB
    against a need of 20 in two suite runs beside a benchmark.)"""
    from dataclasses import replace as _replace

    from lmscli.analysis import run_graph, run_peak_of
    from lmscli.prove import realmem, steps

    model = api.load(str(attention))
    prepared = api.prepare(model)
    budget = int(0.5 * api.analyze(prepared).peak_bytes)
    plan = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0)).plan
    meta, _ = api.rewrite(prepared, plan)
    rewritten = _replace(model, meta_graph=meta)
    prediction, seen = realmem.predict(rewritten, stand_in=stand_in)
    swap_outs = {n for n in seen.order if "-lms-swapout-" in n}
    assert len(swap_outs) == len(plan.swaps)
    need = stand_in.find_min(steps.map_gpu_ops(meta)[0], model.fetches).limit_bytes
    p = prediction.predicted_standin_bytes
    assert 0.85 * need <= p <= 1.20 * need, (p / MIB, need / MIB)
    run = run_graph(rewritten, meta, api.prepare(rewritten).optimized)
    device_only = run_peak_of(run, seen.scratch, tuple(n for n in seen.order if n not in swap_outs), seen.micros)
    assert device_only < 0.7 * need, (device_only / MIB, p / MIB, need / MIB)


def test_the_judges_runs_are_told_under_both_limits():
    """QA: "10 run(s) under 20.00 MiB ... peak 19.01" covered five runs under 20 MiB and five under 19."""
    from lmscli.report.terminal import _stand_in_line

    line = _stand_in_line({"limit_bytes": 20 * MIB, "runs": 10, "steps": 2, "fits": True,
                           "peak_in_use_bytes": 19 * MIB, "failure": None, "headroom_limit_bytes": 19 * MIB})
    assert line.startswith("5 run(s) of 2 step(s) under 20.00 MiB and 5 under 19.00 MiB: trained")
    assert "in use under 20.00 MiB" in line
    failed = _stand_in_line({"limit_bytes": 20 * MIB, "runs": 6, "steps": 2, "fits": False, "peak_in_use_bytes": None,
                             "failure": "under 19.00 MiB: out of memory", "headroom_limit_bytes": 19 * MIB})
    assert failed.startswith("5 run(s) of 2 step(s) under 20.00 MiB and 1 under 19.00 MiB: under 19.00 MiB")
    fewer = _stand_in_line({"limit_bytes": 20 * MIB, "runs": 4, "runs_per_limit": 2, "steps": 2, "fits": True,
                            "peak_in_use_bytes": None, "failure": None, "headroom_limit_bytes": 19 * MIB})
    assert fewer.startswith("2 run(s) of 2 step(s) under 20.00 MiB and 2 under 19.00 MiB: trained")  # (--judge-runs 2)


def test_the_verdict_says_when_the_run_under_the_limit_differs_from_the_rewrites_own():
    """QA r40: verify printed "rewritten: trains at 26.00 MiB, bit-identical" while a note said the
    rewrite's results under the limit differed from its own without one (another allocator: other
    buffer addresses, other code paths in some kernels). The verdict says so itself, and the JSON
    document carries the difference; identical runs keep the plain verdict."""
    import numpy as np

    from lmscli.prove.realmem import prove_at_limit
    from lmscli.prove.standin import StepVerdict
    from lmscli.prove.steps import StepRun

    def run(loss: float) -> StepRun:
        return StepRun((np.float32(loss),), {"w:0": np.array([loss], np.float32)}, {})

    original, rewritten = (api.load(str(SAMPLES / "mlp.meta")) for _ in range(2))

    class StandIn:
        def __init__(self, squeezed: float):
            self.squeezed = squeezed

        def run(self, meta, fetches, limit, **_):
            fits = limit is None or meta is rewritten.meta_graph
            result = (run(0.5) if limit is None else run(self.squeezed)) if fits else None
            return StepVerdict(fits, limit, 1, 0 if fits else 1, False, None, None, result, 0.0)

    differs = prove_at_limit(original, rewritten, 12 * MIB, loss="loss:0", stand_in=StandIn(0.50000006))
    assert differs.proven and differs.limited_difference
    assert differs.line().startswith("original: out of memory at 12.00 MiB; rewritten: trains at 12.00 MiB, "
                                     "bit-identical without a limit (under it, the rewrite's results differ")
    assert differs.to_dict()["limited_difference"] == differs.limited_difference
    same = prove_at_limit(original, rewritten, 12 * MIB, loss="loss:0", stand_in=StandIn(0.5))
    assert same.line().endswith("rewritten: trains at 12.00 MiB, bit-identical") and same.limited_difference is None


def test_measure_explains_a_varying_need():
    """A need marked "(varies)" is explained under the table (QA round 30: the mark had no legend)."""
    from rich.console import Console

    from lmscli.prove.realmem import Need, Prediction
    from lmscli.verify_cli import _render_needs

    prediction = Prediction(20 * MIB, 21 * MIB, 0, 25 * MIB)
    for varies in (False, True):
        console = Console(record=True, width=100)
        _render_needs(console, [Need("a.meta", 22 * MIB, ((22 * MIB, True),), varies, 1.0, prediction)])
        text = console.export_text()
        assert ("(varies) = a smaller limit fitted once" in text) is varies


def test_a_no_plan_answer_after_turned_down_runs_names_them_and_the_bound(samples):
    """When the stand-in's runs turned down every plan and planning for less then found none, the
    answer is the runs' verdict (QA: only the last planning target's failure, below the lower
    bound, was given), and like every no-plan answer it carries a lower bound and an op (QA: both
    null in the JSON document)."""
    from lmscli.errors import NoFitError
    from lmscli.plan.tuning import _RunSearch, _with_bound
    from lmscli.units import format_size

    search = _RunSearch(budget=30 * MIB, margin=0)
    search.rounds, search.note = 3, "out of memory under 36 MiB while running the step: allocating 1 MiB for x failed"
    search.oom_node = "x"
    planning = NoFitError("no swap or recompute plan found under 25 MiB: at y the strategy still needs 40 MiB; "
                          "try a larger --gpu-mem or a smaller batch", bound_bytes=20 * MIB, binding_op="y")
    exc = search.turned_down(planning)
    text = str(exc)
    assert text.startswith("no plan made held on the stand-in after 3 round(s); the last one: out of memory")
    assert "planning for less, to make room, found nothing (no swap or recompute plan found under 25 MiB" in text
    assert text.count("; try ") == 1
    assert (exc.bound_bytes, exc.binding_op, exc.budget_bytes) == (20 * MIB, "x", 30 * MIB)
    prepared = api.prepare(api.load(str(samples / "mlp.meta")))
    bare = _with_bound(NoFitError("turned down"), prepared)
    bound = api.analyze(prepared)
    assert (bare.bound_bytes, bare.binding_op) == (bound.lower_bound_bytes, bound.lower_bound_op)
    # (QA: "no plan can fit under the lower bound, 9.84 MiB" read as if the limit, 14 MiB, were under it)
    lowest = format_size(bound.lower_bound_bytes)
    assert str(bare) == f"turned down (the step's lower bound, under which no plan fits, is {lowest})"


def test_verify_knows_a_rewrite_planned_for_the_stand_in():
    """Only stand-in plans make a model op wait until a swap-in has landed; verify's advice on an
    out-of-memory rewrite depends on it (QA: it advised `lms rewrite --stand-in` for a plan made so)."""
    from tensorflow.core.framework import graph_pb2

    from lmscli.verify_cli import _made_for_stand_in

    graph = graph_pb2.GraphDef()
    graph.node.add(name="t-lms-landed-0-0", op="Identity", input=["t-lms-swapin-0-0"])
    graph.node.add(name="b", op="Relu", input=["t-lms-landed-0-0"])
    assert not _made_for_stand_in(graph)
    graph.node.add(name="c", op="Relu", input=["a", "^t-lms-landed-0-0"])
    assert _made_for_stand_in(graph)


def test_a_graph_on_several_gpus_is_not_planned_for_the_stand_in(runner, samples, tmp_path):
    """The stand-in runs every GPU's ops in one process under one limit: a plan made per GPU is
    not judged there (QA: `lms rewrite --stand-in` on a two-tower graph said "not necessary" for
    each GPU alone, and `lms verify --gpu-mem` then ran out of memory at that limit and advised
    `--stand-in`). `--stand-in` refuses such a graph with exit 1, and verify says why a per-GPU
    plan may not fit under one limit."""
    from tensorflow.core.framework import graph_pb2

    from lmscli.verify_cli import _gpus

    result = invoke(runner, "rewrite", samples / "two_gpu_cnn.meta", tmp_path / "out.meta", "--stand-in",
                    "--gpu-mem", "16MiB")
    assert result.exit_code == 1 and "2 GPUs" in result.output and "one process" in result.output
    assert not (tmp_path / "out.meta").exists()
    graph = graph_pb2.GraphDef()
    graph.node.add(name="a", op="Relu", device="/device:GPU:1")
    graph.node.add(name="b", op="Relu")
    graph.node.add(name="c", op="Relu", device="/device:CPU:0")
    assert _gpus(graph) == {"/device:GPU:0", "/device:GPU:1"}
    alone = graph_pb2.GraphDef()  # a read of a CPU variable, unplaced, runs on the CPU: one GPU
    alone.node.add(name="v", op="VarHandleOp", device="/device:CPU:0")
    alone.node.add(name="r", op="ReadVariableOp", input=["v"])
    alone.node.add(name="a", op="Relu", input=["r"], device="/device:GPU:1")
    assert _gpus(alone) == {"/device:GPU:1"}


def test_a_plan_running_loops_one_iteration_at_a_time_drops_what_iterations_ahead_held(stand_in):
    """On the stand-in the RNN's prediction counts what its loops' iterations running at once held
    in the traced steps (ten 256 KiB weight gradients in its gradient loop); a plan runs such
    loops one iteration at a time (the default) and is planned without them, or with them under
    --keep-loop-parallelism. A plan of serial loops says what the graph as written needs with
    them (QA: its report compared only with the serial figure)."""
    from lmscli.plan.planner import TuneOptions, tune

    prepared = api.for_stand_in(api.prepare(api.load(str(SAMPLES / "stack_rnn.meta"))), stand_in=stand_in)
    assert sum(size for _first, _last, size in prepared.schedule.ahead) >= 2 << 20
    device = api.make_device(gpu_mem="64MiB", reserve=0.0)
    serial = tune(prepared, device, TuneOptions())
    parallel = tune(prepared, device, TuneOptions(serial_loops=False))
    assert parallel.baseline.peak_bytes > serial.baseline.peak_bytes
    plan = tune(prepared, api.make_device(gpu_mem="20MiB", reserve=0.0), TuneOptions()).plan  # loops made serial
    assert plan.serial_loops and plan.predicted["peak_bytes_with_parallel_loops"] > plan.predicted["peak_bytes_without_plan"]


_STAND_IN_GRAPPLER = """
import json, sys
from lmscli import api, grappler
from lmscli.plan.candidates import remapped

prepared = api.prepare(api.load(sys.argv[1]))
stand_in = api.for_stand_in(prepared)
meta = api.with_graph_def(stand_in.model.meta_graph, stand_in.graph_def)
relus = sorted(n for n in prepared.view.names if n.endswith("/relu"))
print(json.dumps({"onednn": grappler.onednn(), "relus": relus,
                  "roots_here": sorted(remapped(prepared.view, prepared.optimized)),
                  "roots_stand_in": sorted(remapped(stand_in.view, stand_in.optimized)),
                  "relus_fused_here": sorted(set(relus) & prepared.fused),
                  "relus_fused_stand_in": sorted(set(relus) & stand_in.fused),
                  "guard_here": sorted(n.op for n in grappler.optimize(meta, stand_in.model.fetches).node
                                       if n.op.startswith("_Fused")),
                  "guard_stand_in": sorted(n.op for n in stand_in.grappler(meta).node if n.op.startswith("_Fused"))}))
"""


def test_a_stand_in_step_is_planned_by_what_the_stand_ins_grappler_fuses(tmp_path):
    """The stand-in's processes run Grappler without oneDNN, and then its remapper fuses no batch
    norm with its ReLU on a CPU; with oneDNN on (TensorFlow's default on x86; the tests turn it
    off) it does. A step prepared for the stand-in in such a process takes what is fused, and the
    optimizer guard's Grappler, from the stand-in's processes (bench-real: a DenseNet's stand-in
    plans made no batch norm wait for a swap-out, as a fused kernel's root may not, and needed
    1.7x the lower bound)."""
    import os
    import subprocess
    import sys

    from tests.conftest import load_generator

    path = tmp_path / "densenet.meta"
    path.write_bytes(load_generator().build("densenet", batch=2, image_size=16, growth=8, blocks=2,
                                            layers_per_block=2).SerializeToString(deterministic=True))
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _STAND_IN_GRAPPLER, str(path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["onednn"] and seen["relus"]
    assert seen["roots_here"] and seen["relus_fused_here"]  # this process fuses ...
    assert "_FusedBatchNormEx" in seen["guard_here"]
    assert seen["roots_stand_in"] == [] and seen["relus_fused_stand_in"] == []  # ... the stand-in does not
    assert "_FusedBatchNormEx" not in seen["guard_stand_in"]


def test_a_swap_out_sends_through_an_identity_so_the_kernel_still_writes_over_its_input(stand_in, tmp_path):
    """An output another process reads (the stand-in's swap-out to its host process) is allocated
    so that the network can send from it, so a ReLU whose output is swapped took a buffer of its
    own instead of writing over its bias add's: one activation more at each swapped ReLU (QA: a
    CNN's plan for 12 MiB needed 18 on the stand-in, as much as the original). lms's swap-outs read
    the tensor through an Identity on the GPU, which forwards the buffer: the same plan needs 15.
    Here: the rewrite fits at its prediction (plus 3%; in one of three runs), where the same graph with its swap-outs
    reading the ReLUs directly runs out of memory. (The plan is made on lms's GPU model for speed,
    and applied as a stand-in plan is: ``"stand_in": true``.)"""
    from dataclasses import replace

    from lmscli.prove.realmem import predict
    from tests.conftest import six_conv_cnn

    model = api.load(str(six_conv_cnn(tmp_path / "cnn.meta")))
    prepared = api.prepare(model)
    budget = int(api.analyze(prepared).lower_bound_bytes * 1.1)
    result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0))
    relus = [s for s in result.plan.swaps if s.tensor.startswith("Relu")]
    assert relus
    assert api.rewrite(prepared, result.plan)[1].sent == 0  # (a GPU plan: see lmscli.emit.rewriter)
    rewritten, report = api.rewrite(prepared, replace(result.plan, stand_in=True))
    assert report.sent == report.swap_outs
    nodes = {node.name: node for node in rewritten.graph_def.node}
    for swap in result.plan.swaps:
        producer = swap.tensor.split(":")[0]
        send = nodes[f"{producer}-lms-send-0"]
        assert send.op == "Identity" and send.input[0] == producer and send.device == nodes[producer].device
        assert nodes[f"{producer}-lms-swapout-0"].input[0] == send.name
    done = tmp_path / "cnn.lms.meta"
    api.save(model, rewritten, str(done))
    again = api.load(str(done))
    predicted = predict(again, stand_in=stand_in)[0].predicted_standin_bytes
    limit = -(-int(predicted / 0.97) // MIB) * MIB
    # (One of three runs: under load the moments the transfers land vary, and with them the
    # region's holes; at P 14 MiB one run in a few failed at 15 and at 16 while another worker
    # ran stand-in tests (CI, stop 41), where the swap-outs reading the ReLUs failed at 18.)
    assert any(stand_in.run(again.meta_graph, again.fetches, limit, runs=1).fits for _ in range(3))
    # The swap-outs reading the ReLUs themselves: each ReLU allocates beside its input.
    direct = type(again.meta_graph)()
    direct.CopyFrom(again.meta_graph)
    sends = {node.name: node.input[0] for node in direct.graph_def.node if "-lms-send-" in node.name}
    for node in direct.graph_def.node:
        node.input[:] = [sends.get(i, i) for i in node.input]
    kept = [node for node in direct.graph_def.node if node.name not in sends]
    del direct.graph_def.node[:]
    direct.graph_def.node.extend(kept)
    assert not stand_in.run(direct, again.fetches, limit, runs=1).fits


def test_a_stand_in_plan_is_judged_as_it_will_be_written(residual):
    """The judge's real runs run the rewrite of a plan as it will be written: a plan made for the
    stand-in says so from the planner on, so its swap-outs send through Identities in the judged
    rewrites too (when only the finished plan said so, the judged rewrites went without them, their
    ReLUs took buffers of their own, and the residual MLP of `make bench-real` had no plan at 52
    or 66 MiB where one at 50 trains)."""
    from lmscli.device import STAND_IN_LINK
    from lmscli.emit.rewriter import emit
    from lmscli.plan import planner

    prepared = api.for_stand_in(api.prepare(api.load(str(residual))))
    bound = api.analyze(prepared).lower_bound_bytes
    limit = int(bound + 0.5 * (prepared.run_peak_bytes - bound)) // MIB * MIB
    plan = planner.tune(prepared, api.make_device(gpu_mem=limit, link=STAND_IN_LINK)).plan
    assert plan.stand_in and plan.swaps
    assert emit(prepared, plan, force=True)[1].sent == len(plan.swaps)
