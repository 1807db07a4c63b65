"""The tuning pass: both strategies, plans that fit per the simulator and Grappler, the CLI."""

import json
import re

import pytest

from lmscli import api
from lmscli.errors import NoFitError
from lmscli.plan.document import Plan
from lmscli.plan.planner import TflmsParams, TuneOptions, parse_levels
from tests.conftest import TRAINING_SAMPLES, invoke


def _prepared(samples, name, batch=None):
    model = api.load(str(samples / f"{name}.meta"))
    return api.prepare(model, batch_size=batch)


@pytest.fixture(scope="module")
def unet64():
    """A 3D U-Net at 64^3: ops take long enough for transfers to overlap compute."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("generate", pathlib.Path(__file__).parent.parent / "sample_graphs/generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    meta = gen.build("unet3d", volume=64, batch=1)
    model = api.Model(path="unet3d_64.meta", format="metagraph", meta_graph=meta, fetches=("train_op",),
                      fetch_source="train_op")
    return api.prepare(model)


def _device(prepared, share):
    """A device whose budget is ``share`` of the no-swap peak ("mid": half-way from the lower bound)."""
    facts = api.analyze(prepared)
    if share == "mid":
        return api.make_device(gpu_mem=(facts.lower_bound_bytes + facts.peak_bytes) // 2, reserve=0.0)
    return api.make_device(gpu_mem=int(facts.peak_bytes * share), reserve=0.0)


@pytest.mark.parametrize("name", TRAINING_SAMPLES)
def test_every_sample_at_standard_budgets(samples, name):
    """At 75%, 50% and 35% of the peak (where at least the lower bound): a plan that fits by the
    simulator and by Grappler, or a NoFitError that names the op where memory is stuck."""
    prepared = _prepared(samples, name, 4 if name == "unknown_batch" else None)
    facts = api.analyze(prepared)
    for share in (0.75, 0.5, 0.35):
        budget = int(facts.peak_bytes * share)
        if budget < facts.lower_bound_bytes:
            continue
        try:
            result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0))
        except NoFitError as exc:
            assert "needs" in str(exc) and "lower bound" in str(exc)
            continue
        assert result.fits and result.plan.predicted.get("run_peak_bytes", result.result.peak_bytes) <= budget
        assert result.plan.grappler["peak_bytes"] > 0  # Grappler's second opinion is recorded


@pytest.mark.parametrize("name,share", [("cnn", 0.75), ("unet3d", 0.75), ("resnet50", "mid")])
def test_plans_fit_where_expected(samples, name, share):
    prepared = _prepared(samples, name, 4 if name == "unknown_batch" else None)
    result = api.tune(prepared, _device(prepared, share))
    assert result.necessary and result.fits and result.plan.swaps
    assert result.plan.grappler["peak_bytes"] > 0  # recorded as a second opinion
    assert result.plan.predicted.get("run_peak_bytes", result.plan.predicted["peak_bytes"]) <= result.budget


def test_default_never_swaps_more_than_tflms(unet64):
    for share in (0.8, 0.75):
        device = _device(unet64, share)
        ours = api.tune(unet64, device, check=False)
        theirs = api.tune(unet64, device, TuneOptions(strategy="tflms"), check=False)
        assert ours.fits and theirs.fits
        assert ours.plan.swap_out_bytes <= theirs.plan.swap_out_bytes


def test_tflms_search_logs_parameter_sets(unet64):
    result = api.tune(unet64, _device(unet64, 0.8), TuneOptions(strategy="tflms"), check=False)
    found = [line for line in result.log if "Found a parameter set" in line]
    assert found and result.fits
    last = result.plan.parameters
    assert f"swapout_threshold {last['swapout_threshold']}" in found[-1]
    assert set(last) == {"swapout_threshold", "swapin_ahead", "swapin_groupby", "sync_mode"}


def test_not_necessary(samples):
    prepared = _prepared(samples, "cnn")
    result = api.tune(prepared, api.make_device(gpu_mem="16GiB"))
    assert not result.necessary and not result.plan.swaps
    assert any("LMS is not necessary" in line for line in result.log)


def test_manual_tflms_parameters_skip_the_search(samples):
    prepared = _prepared(samples, "cnn")
    options = TuneOptions(strategy="tflms", tflms=TflmsParams(3, 2, 5, 0))
    result = api.tune(prepared, api.make_device(gpu_mem="16GiB"), options, check=False)
    assert result.plan.parameters == {"swapout_threshold": 3, "swapin_ahead": 2, "swapin_groupby": 5, "sync_mode": 0}
    assert result.plan.swaps
    levels = dict(zip(prepared.schedule.names, prepared.schedule.levels))
    for swap in result.plan.swaps:
        producer = swap.tensor.rsplit(":", 1)[0]
        for group in swap.swap_ins:
            assert all(levels[c] - levels[producer] > 3 for c in group.consumers)


def test_budget_below_lower_bound_is_exit_3(samples, runner):
    result = invoke(runner, "tune", samples / "resnet50.meta", "--gpu-mem", "100MiB")
    assert result.exit_code == 3
    assert "no swap or recompute plan can fit" in result.stderr and "cannot be swapped" in result.stderr
    assert "Traceback" not in result.stderr
    # an answer, not a failure: one line, without the "error:" of exit 1 (QA r49 P8)
    assert result.stderr.startswith("lms: no swap or recompute plan") and len(result.stderr.splitlines()) == 1


def test_a_no_plan_answer_says_why_the_judge_moved_the_budget(samples):
    """When the tune loop's margin (the judge's) plans the graph as written for less than the
    budget and nothing fits, the answer says why: for the stand-in, its runs of earlier plans
    needed more than lms's model of them (QA: a message about "the graph TensorFlow runs" there
    misled, since it was the runs that needed more)."""
    from dataclasses import replace

    from lmscli.plan.planner import tune as plan_tune

    prepared = api.prepare(api.load(str(samples / "cnn.meta")))
    facts = api.analyze(prepared)
    device = api.make_device(gpu_mem=int(facts.peak_bytes * 0.9), reserve=0.0)
    margin = device.budget - facts.lower_bound_bytes - 1000
    said = []
    for which in (prepared, replace(prepared, stand_in=object())):  # (the planner only asks whether there is one)
        with pytest.raises(NoFitError) as raised:
            plan_tune(which, device, TuneOptions(), margin=margin)
        said.append(str(raised.value))
    assert "(the graph TensorFlow runs needs more than the graph as written, so it was planned as" in said[0]
    assert "(the stand-in's runs of the plans before needed more than lms's model of them, so it was planned" in said[1]
    for text in said:  # the need stands beside the target it missed (QA: "under 9 MiB ... needs 6.99" alone)
        planned = re.search(r"so it was planned as (.+?) for the graph as written", text).group(1)
        assert re.search(rf"still needs [0-9.]+ [KMG]?i?B as written, (just )?over the {re.escape(planned)} it was planned for",
                         text), text


def test_plan_json_round_trip_and_apply(samples, runner, tmp_path):
    plan_path = tmp_path / "plan.json"
    result = invoke(runner, "tune", samples / "cnn.meta", "--gpu-mem", "75%", "--reserve", "0",
                    "--plan-out", plan_path, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema"] == "lms.tune" and doc["fits"] is True
    plan = Plan.from_json(plan_path.read_text())
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["swaps"] == doc["plan"]["swaps"]
    a, b = tmp_path / "a.meta", tmp_path / "b.meta"
    assert invoke(runner, "rewrite", samples / "cnn.meta", a, "--plan", plan_path, "-q").exit_code == 0
    assert invoke(runner, "rewrite", samples / "cnn.meta", b, "--gpu-mem", "75%", "--reserve", "0", "-q").exit_code == 0
    assert a.read_bytes() == b.read_bytes()


def test_bad_plans(samples, runner, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = invoke(runner, "rewrite", samples / "cnn.meta", tmp_path / "o.meta", "--plan", bad)
    assert result.exit_code == 1 and "not valid JSON" in result.stderr
    other = tmp_path / "other.json"
    assert invoke(runner, "tune", samples / "unet3d.meta", "--gpu-mem", "75%", "--reserve", "0",
                  "--plan-out", other, "-q").exit_code == 0
    result = invoke(runner, "rewrite", samples / "cnn.meta", tmp_path / "o.meta", "--plan", other)
    assert result.exit_code == 1 and "different graph" in result.stderr


def test_find_max_batch(samples):
    model = api.load(str(samples / "unknown_batch.meta"))
    prepared = api.prepare(model, batch_size=8)
    device = api.make_device(gpu_mem=int(api.analyze(prepared).peak_bytes), reserve=0.0)
    batch, result, _ = api.find_max_batch(model, device)
    assert batch >= 8 and result.fits
    with pytest.raises(NoFitError):
        api.tune(api.prepare(model, batch_size=batch + 1), device, check=False)


def test_find_max_batch_steps_down_when_the_judge_turns_the_planners_size_down(samples, monkeypatch):
    """The planner's search proposes a batch size; the full tune loop (guard and judge) decides.
    Where its judge turns every plan down, smaller sizes are searched with the full loop, not
    answered with "no plan" (QA r50: an Inception-style net at 40 MiB)."""
    from lmscli.plan import tuning

    model = api.load(str(samples / "unknown_batch.meta"))
    prepared = api.prepare(model, batch_size=8)
    device = api.make_device(gpu_mem=int(api.analyze(prepared).peak_bytes), reserve=0.0)
    real = tuning.tune
    judged = []

    def tune(prepared, device, options=api.TuneOptions(), check=True, **kw):
        if check:
            judged.append(prepared.batch_size)
            if prepared.batch_size > 5:
                raise NoFitError(f"the judge turned batch {prepared.batch_size} down")
        return real(prepared, device, options, check=check, **kw)

    monkeypatch.setattr(tuning, "tune", tune)
    batch, result, prepared = api.find_max_batch(model, device)
    assert batch == 5 and prepared.batch_size == 5 and result.fits
    assert judged[0] >= 8 and judged[-1] in (5, 6) and set(judged) >= {5, 6}
    assert any("batch size 5 fits, 6 does not" in line for line in result.log)
    monkeypatch.setattr(tuning, "tune", lambda *a, check=True, **kw: (_ for _ in ()).throw(NoFitError("over"))
                        if check else real(*a, check=check, **kw))
    with pytest.raises(NoFitError, match="no batch size fits this device: the planner's search found .* at batch "
                                         "size 1: over"):
        api.find_max_batch(model, device)


def test_setup_cfg_defaults(samples, runner, tmp_path, monkeypatch):
    (tmp_path / "setup.cfg").write_text("[lms]\ngpu_mem = 16GiB\nlink = pcie3\n")
    monkeypatch.chdir(tmp_path)
    result = invoke(runner, "tune", samples / "cnn.meta", "--json")
    assert result.exit_code == 0, result.stderr
    device = json.loads(result.stdout)["plan"]["device"]
    assert device["gpu_mem_bytes"] == 16 << 30 and device["link"] == "pcie3"


def test_parse_levels():
    assert parse_levels("1,3:5,7") == (1, 3, 4, 5, 7)
    assert parse_levels("2:2") == (2,)
    from lmscli.errors import InputError

    for bad in ("5:3", "a", "-1"):
        with pytest.raises(InputError):
            parse_levels(bad)


def test_tune_is_deterministic(samples, runner):
    args = ("tune", samples / "unet3d.meta", "--gpu-mem", "75%", "--reserve", "0", "--json")
    assert invoke(runner, *args).stdout == invoke(runner, *args).stdout


def test_host_memory_warning(samples, runner):
    result = invoke(runner, "tune", samples / "unet3d.meta", "--gpu-mem", "75%", "--reserve", "0",
                    "--host-mem", "1KiB", "--no-color")
    assert result.exit_code == 0
    assert "more than --host-mem" in result.stdout


def test_cli_tune_renders(samples, runner):
    result = invoke(runner, "tune", samples / "unet3d.meta", "--gpu-mem", "75%", "--reserve", "0", "--no-color")
    assert result.exit_code == 0
    for text in ("predicted peak with plan", "Grappler's estimate", "swap-outs", "on pcie3"):
        assert text in result.stdout


def test_triggers_are_fit_ancestors_in_range(samples):
    """Every trigger the planner may pick is an ancestor of the consumer, inside the asked
    range, on the GPU and outside loops and cond branches (so no cycle, no frame crossing)."""
    import random

    from lmscli.plan.candidates import Filters
    from lmscli.plan.planner import _Context

    prepared = _prepared(samples, "resnet50")
    ctx = _Context(prepared, api.make_device(gpu_mem="1GiB"), Filters())
    n = len(prepared.schedule)
    rng = random.Random(7)
    for _ in range(300):
        consumer = rng.randrange(1, n)
        latest = rng.randrange(0, consumer)
        earliest = rng.randrange(0, latest + 1)
        found = ctx.trigger(consumer, latest, earliest)
        if found is None:
            continue
        assert earliest <= found <= latest and ctx.can_trigger[found]
        stack, seen = [consumer], set()
        while stack:
            x = stack.pop()
            for q in ctx.preds[x]:
                if q not in seen and q >= found:
                    seen.add(q)
                    stack.append(q)
        assert found in seen


def test_activations_fused_into_their_producer_stay_swappable():
    """oneDNN's Grappler folds a Relu into the batch norm before it (``_FusedBatchNormEx`` under the
    batch norm's name): the Relu's output is then the fused kernel's, and still worth swapping (on a
    tf_keras DenseNet-121 those outputs are most of the activations). Other fused-away nodes are not."""
    from lmscli.plan.candidates import absorbed
    from lmscli.graph.graphview import GraphView
    from tests.conftest import graph_def_from_nodes

    f32 = {"type": 1}
    view = GraphView(graph_def_from_nodes([
        ("x", "Placeholder", [], {"dtype": f32}),
        ("bn", "FusedBatchNormV3", ["x", "x", "x", "x", "x"], {"T": f32}),
        ("relu", "Relu", ["bn"], {"T": f32}),
        ("add", "AddV2", ["relu", "x"], {"T": f32}),
        ("relu2", "Relu", ["add"], {"T": f32}),
    ]))
    fused = frozenset({"relu", "relu2"})
    assert absorbed(view, view.index["relu"], fused)
    assert not absorbed(view, view.index["relu2"], fused)  # AddV2 -> Relu is not a fusion lms knows
    assert not absorbed(view, view.index["relu"], fused | {"bn"})  # its producer went too


def test_stand_in_plans_never_make_constants_wait(tmp_path):
    """Landing ops of stand-in plans are never constant-like ops or ops Grappler folds away: a
    control edge from a swap node into the Const of a SquaredDifference
    gradient made Grappler's constant folding and dependency optimizer build a cycle on a
    transformer, and Grappler then refused the rewritten graph. Here the rewrite of such a plan
    is optimized by Grappler like the original."""
    import importlib.util
    from dataclasses import replace

    from lmscli import api, grappler
    from lmscli.plan.candidates import CONSTANT_LIKE_OPS
    from lmscli.device import STAND_IN_LINK
    from lmscli.plan.planner import TuneOptions, tune
    from tests.conftest import SAMPLES

    spec = importlib.util.spec_from_file_location("lms_generate", SAMPLES / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    path = tmp_path / "transformer.meta"
    path.write_bytes(generate.build("transformer", batch=4, seq=128, d_model=128, heads=4, ffn=512, layers=2)
                     .SerializeToString(deterministic=True))
    prepared = api.prepare(api.load(str(path)))
    sched = prepared.schedule
    waited = replace(prepared, schedule=replace(sched, stand_in=True),
                     schedules=tuple(replace(s, stand_in=True) for s in prepared.schedules))
    facts = api.analyze(waited)
    budget = int(facts.lower_bound_bytes + 0.3 * (facts.peak_bytes - facts.lower_bound_bytes))
    result = tune(waited, api.make_device(gpu_mem=budget, reserve=0.0, link=STAND_IN_LINK), TuneOptions())
    ops = dict(zip(sched.names, sched.ops))
    landings = [g.landing for s in result.plan.swaps for g in s.swap_ins if g.landing]
    assert landings
    assert not [w for w in landings if ops[w] in CONSTANT_LIKE_OPS or w in prepared.fused]
    meta, _ = api.rewrite(waited, result.plan)
    assert grappler.optimize(meta, prepared.model.fetches) is not None


def test_a_fused_kernels_root_never_waits_for_a_swap_out(samples):
    """Grappler's remapper turns a batch norm followed by its ReLU into one ``_FusedBatchNormEx``
    under the batch norm's name (with oneDNN, TensorFlow's default on x86), and a control input
    into that batch norm stops the fusion. A U-Net's stand-in plans made batch norms wait for
    swap-outs; the optimizer guard then took a swap out of every plan, round after round, and no
    plan was found at 42 MiB where one trains under 39 (QA round 29). Waiters and landing ops now
    avoid such roots. (The tests run with oneDNN off, so the fusion is staged in the optimized
    graph lms compares against, as Grappler makes it with oneDNN on.)"""
    from dataclasses import replace

    from tensorflow.core.framework import graph_pb2

    from lmscli.device import STAND_IN_LINK
    from lmscli.plan.planner import TuneOptions, _Context, tune

    prepared = api.prepare(api.load(str(samples / "resnet50.meta")))
    sched, view = prepared.schedule, prepared.view
    fused = graph_pb2.GraphDef()
    fused.CopyFrom(prepared.optimized)
    relu_inputs = {n.input[0].split(":")[0] for n in fused.node if n.op == "Relu"}
    for node in fused.node:
        if node.op == "FusedBatchNormV3" and node.name in relu_inputs:
            node.op = "_FusedBatchNormEx"
    waited = replace(prepared, optimized=fused, schedule=replace(sched, stand_in=True),
                     schedules=tuple(replace(s, stand_in=True) for s in prepared.schedules))
    facts = api.analyze(waited)
    device = api.make_device(gpu_mem=int(facts.lower_bound_bytes + 0.8 * (facts.peak_bytes - facts.lower_bound_bytes)),
                             reserve=0.0, link=STAND_IN_LINK)
    ctx = _Context(waited, device, api.Filters())
    roots = {sched.names[k] for k, root in enumerate(ctx.fusion_root) if root}
    assert roots and all(view.ops[view.index[name]] == "FusedBatchNormV3" for name in roots)
    assert not any(ctx.can_land_at[k] or ctx.can_wait(k, next(iter(ctx.cands)))
                   for k in range(len(sched)) if ctx.fusion_root[k])
    result = tune(waited, device, TuneOptions(strategy="swap"))
    waiters = {w for s in result.plan.swaps for w in s.waiters} | {
        g.landing for s in result.plan.swaps for g in s.swap_ins if g.landing}
    assert waiters and not waiters & roots
    roomy = api.make_device(gpu_mem=int(facts.lower_bound_bytes + 0.85 * (facts.peak_bytes - facts.lower_bound_bytes)),
                            reserve=0.0, link=STAND_IN_LINK)
    first = tune(waited, roomy, TuneOptions(strategy="swap"))
    banned = frozenset(w for s in first.plan.swaps for w in s.waiters)  # as the guard can ask
    again = tune(waited, roomy, TuneOptions(strategy="swap", no_wait=banned))
    assert banned and again.plan.swaps and not {w for s in again.plan.swaps for w in s.waiters} & banned
    before = tune(replace(waited, optimized=prepared.optimized), device, TuneOptions(strategy="swap"))
    assert {w for s in before.plan.swaps for w in s.waiters} & roots  # (without the staged fusion, they may)


def test_the_default_strategy_is_never_beaten_by_the_other_searches(samples, monkeypatch):
    """The tune loop measures the hybrid against the swap planner's and TFLMS's own searches: it
    takes theirs when the judge refused every plan of its own (TFLMS's search also a little below
    the lower bound, whose order its synchronous swaps change; the swap planner only at or above
    it) or when theirs is predicted faster; `--strategy swap` falls back on TFLMS's search. (The
    searches are real plans of the cnn sample; which of them the judge refuses is staged.) On the
    stand-in, TFLMS's search is a fallback only."""
    from dataclasses import replace

    from lmscli.plan import tuning

    prepared = api.prepare(api.load(str(samples / "cnn.meta")))
    bound = api.analyze(prepared).lower_bound_bytes
    device = api.make_device(gpu_mem=(bound + prepared.run_peak_bytes) // 2, reserve=0.0, link="pcie3")
    real = {s: tuning.checked_tune(prepared, device, TuneOptions(strategy=s), check=False)
            for s in ("hybrid", "swap", "tflms")}
    assert all(r.fits and r.necessary for r in real.values())
    calls, refused, stated_bound = [], set(), [None]

    def staged(prepared, device, options, *args, **kwargs):
        calls.append(options.strategy)
        if options.strategy in refused:
            raise NoFitError("refused by the judge", bound_bytes=stated_bound[0], budget_bytes=device.budget)
        return real[options.strategy]

    monkeypatch.setattr(tuning, "checked_tune", staged)

    def tune(strategy, refuse=(), bound_bytes=None):
        calls.clear()
        refused.clear()
        refused.update(refuse)
        stated_bound[0] = bound_bytes
        return tuning.tune(prepared, device, TuneOptions(strategy=strategy), check=False)

    got = tune("hybrid", refuse=("hybrid",), bound_bytes=device.budget)  # the swap planner comes first
    assert calls == ["hybrid", "swap"] and got.plan.strategy == "swap"
    assert "the swap-only planner's plan does" in got.log[-1]
    got = tune("hybrid", refuse=("hybrid", "swap"), bound_bytes=device.budget + 1)  # just above the bound
    assert calls == ["hybrid", "tflms"] and got.plan.strategy == "tflms"
    assert "TFLMS's parameter search's plan does" in got.log[-1]
    with pytest.raises(NoFitError, match="refused"):  # far below the bound: nothing else is tried
        tune("hybrid", refuse=("hybrid",), bound_bytes=2 * device.budget)
    assert calls == ["hybrid"]
    got = tune("swap", refuse=("swap",), bound_bytes=device.budget)
    assert calls == ["swap", "tflms"] and got.plan.strategy == "tflms"
    with pytest.raises(NoFitError):  # an explicit strategy other than these two is not replaced
        tune("recompute", refuse=("recompute",))

    # Faster: the TFLMS-style search's plan, staged 20% faster than the hybrid's, is taken.
    fast = real["tflms"]
    real["tflms"] = replace(fast, result=replace(fast.result, step_time=real["hybrid"].result.step_time * 0.8))
    got = tune("hybrid")
    assert calls == ["hybrid", "swap", "tflms"] and got.plan.strategy == "tflms"
    assert "found a faster plan than the hybrid's" in got.log[-1]
    real["tflms"] = replace(fast, result=replace(fast.result, step_time=real["hybrid"].result.step_time * 2))
    assert tune("hybrid").plan.strategy == real["hybrid"].plan.strategy  # slower ones are not

    # On the stand-in, where each plan of TFLMS's search is judged by real runs, that search runs
    # only when the hybrid's found nothing (a DenseNet's greedy plans ran out of memory where its
    # synchronous swap-outs held), not to look for a faster plan.
    stand_in = replace(prepared, stand_in=object())
    assert tuning._others(stand_in, "hybrid") == ("swap",) and tuning._others(stand_in, "swap") == ()
    assert tuning._others(stand_in, "hybrid", fallback=True) == ("swap", "tflms")
    assert tuning._others(stand_in, "swap", fallback=True) == ("tflms",)


def test_a_bound_raised_by_the_guard_says_so(samples):
    """Tensors the optimizer guard leaves unswapped count in the lower bound of a no-plan answer,
    which is then above the one `lms analyze` gives: the message says why (QA: an attention
    model's bound read 16.0 MiB near 80% of its peak and 13.5 MiB at 50%)."""
    from lmscli.plan.planner import _Context, tune as plan_tune
    from lmscli.units import format_size

    prepared = api.prepare(api.load(str(samples / "cnn.meta")))
    bound = api.analyze(prepared).lower_bound_bytes
    device = api.make_device(gpu_mem=bound + (prepared.run_peak_bytes - bound) // 10, reserve=0.0)
    ctx = _Context(prepared, device, api.Filters())
    sched = prepared.schedule
    big = sorted(ctx.cands, key=lambda t: -sched.tensors[t].num_bytes)[:3]
    forbidden = frozenset(sched.label(t) for t in big)
    with pytest.raises(NoFitError) as caught:
        plan_tune(prepared, device, TuneOptions(forbidden=forbidden))
    assert caught.value.bound_bytes > bound
    assert "3 tensor(s) the optimizer guard leaves unswapped" in str(caught.value)
    assert sched.label(big[0]) in str(caught.value)  # named, largest first, with their sizes
    # (which tensors the guard keeps depends on the plans judged before: not found, not "can fit";
    # QA r54, a loop's accumulator kept "can fit" under no 1.5 MiB, and hosted, a plan fitted at 2.07)
    assert "no swap or recompute plan found under" in str(caught.value) and "can fit" not in str(caught.value)
    plan_tune(prepared, device, TuneOptions())  # without them, a plan
    with pytest.raises(NoFitError) as recomputing:  # (in the words of the strategy: QA r51)
        plan_tune(prepared, device, TuneOptions(strategy="recompute", forbidden=forbidden))
    assert "3 tensor(s) the optimizer guard keeps from being made again" in str(recomputing.value)
    assert "unswapped" not in str(recomputing.value) and "a clone there changes" in str(recomputing.value)

    # Planned for more as written (the graph TensorFlow runs needs less) and stuck there, with the
    # budget under the bound as written: the bound comes first, beside the budget (QA r51: "under
    # 13.75 MiB ... planned as 21.22 MiB ... (lower bound 15.72 MiB)" read as a contradiction)
    from lmscli.plan.planner import _Stuck, _stuck_message

    lb = caught.value.bound_bytes
    stuck = _Stuck(sched.tensors[big[0]].consumers[-1], None, need_bytes=lb + (4 << 20))
    text = _stuck_message(ctx, stuck, "hybrid", lb + (2 << 20) - sched.resident_bytes, lb, " (with 3 tensor(s) ...)")
    assert text.startswith(f"no swap or recompute plan found under {format_size(device.budget)}, below the lower "
                           f"bound of the graph as written, {format_size(lb)} (with 3 tensor(s) ...) (the graph "
                           "TensorFlow runs needs less than the graph as written, so it was planned as "
                           f"{format_size(lb + (2 << 20))} for the graph as written): at "), text
    assert text.count("lower bound") == 1 and text.count("(with 3") == 1 and text.count("; try ") == 1


def test_a_tf2_loop_accumulator_the_guard_keeps_is_named_as_one(tmp_path):
    """A TensorFlow 2 loop's accumulator (an ``EmptyTensorList`` handle) kept by the guard is
    named for what it keeps, as a v1 gradient stack is, not by its handle's 0 bytes (QA r54:
    "Tanh_0/accumulator 0 B", where it kept 1 MiB of pushes on the GPU)."""
    from lmscli.plan.planner import _guard_words
    from tests.conftest import stacked_tf2_rnn

    prepared = api.prepare(api.load(str(stacked_tf2_rnn(tmp_path / "rnn.meta", batch=4, steps=4, features=4,
                                                        units=8, layers=1))))
    view = prepared.view
    lists = [view.names[i] for i in range(view.size) if view.ops[i] == "EmptyTensorList"]
    assert lists
    text = _guard_words(TuneOptions(forbidden=frozenset(lists[:1])), view)
    assert f"{lists[0]} (a loop's gradient stack, kept on the GPU)" in text and " 0 B" not in text


def test_gradients_waiting_at_a_join_are_swapped_through_identities_grappler_removes(tmp_path):
    """A DenseNet-style net's concatenations send gradients back to every earlier layer; they
    wait at AddN joins, read through tf.gradients' ``tuple/control_dependency`` Identities, which
    Grappler removes. Such an Identity's output is swapped like any tensor (its consumers read the
    swap-in; Grappler still removes the Identity), and a later input of an AddN of three or more is
    swapped when the sum alone reads every input (the kernel accumulates into input 0 either way). Before,
    neither was: no plan at 40% of the peak (lower bound 62.3 MiB, budget 61.9 MiB; now 56.3)."""
    from lmscli.model.simulator import simulate
    from tests.conftest import densenet_meta
    from tests.test_recompute import _identical

    model = api.load(str(densenet_meta(tmp_path / "densenet.meta")))
    prepared = api.prepare(model)
    device = api.make_device(gpu_mem=int(simulate(prepared.schedule).peak_bytes * 0.4))
    result = api.tune(prepared, device)
    assert result.fits
    view = prepared.view
    producers = [view.index[s.tensor.rsplit(":", 1)[0]] for s in result.plan.swaps]
    assert any(view.ops[i] == "Identity" and view.names[i] in prepared.fused for i in producers)
    new_graph, _ = api.rewrite(prepared, result.plan)
    _identical(model, new_graph)


def test_the_greedy_plans_first_with_the_tensors_tflms_swapped(samples):
    """The outputs of removed Identities (and later AddN inputs) join the candidates only where
    the greedy finds nothing without them: with them, a transformer's hybrid plan on PCIe 3 at 75%
    swapped attention gradients it had recomputed (+41% against +5.3%)."""
    from lmscli.plan.planner import _Context

    prepared = api.prepare(api.load(str(samples / "cnn.meta")))
    ctx = _Context(prepared, api.make_device(gpu_mem="1GiB"), api.Filters())
    beyond = {t for t, c in ctx.cands.items() if c.beyond_tflms}
    assert beyond  # tf.gradients' tuple Identities
    narrow = ctx.narrowed()
    assert narrow is not ctx and not beyond & set(narrow.cands) and set(narrow.cands) | beyond == set(ctx.cands)
    assert sorted(narrow._cand_ids.tolist()) == sorted(narrow.cands) and beyond <= set(ctx.cands)
    assert narrow.narrowed() is narrow


def test_a_swap_out_keeps_only_the_waiters_that_do_not_wait_through_another(samples):
    """Planning adds a waiter wherever a swapped tensor was still held; a waiter that descends from
    another waiter of the same swap-out waits already (QA: a ViT plan's swap-outs had dozens each,
    into Gelu and dropout ops Grappler fuses, and the optimizer guard left eight tensors
    unswapped). Plans keep one waiter per independent path; the simulation is the same."""
    from lmscli.plan.planner import _Context
    from lmscli.model.simulator import SimSwap, SwapIn, simulate

    prepared = api.prepare(api.load(str(samples / "cond_branch.meta"))).observed(())
    sched, view = prepared.schedule, prepared.view
    device = api.make_device(gpu_mem=int(0.6 * api.analyze(prepared).peak_bytes), reserve=0.0)
    ctx = _Context(prepared, device, api.Filters())
    result = api.tune(prepared, device, check=False)
    pos = {name: k for k, name in enumerate(sched.names)}
    assert any(s.waiters for s in result.plan.swaps)
    for swap in result.plan.swaps:
        nodes = [sched.nodes[pos[w]] for w in swap.waiters]
        for node in nodes:
            assert not (set(nodes) - {node}) & view.ancestors([node]), swap.tensor
    # By hand: a tensor of the forward pass, waited for by its next consumer and by the last op.
    t = next(t for t in sched.tensors if t.consumers and len(t.consumers) == 2 and t.id in ctx.cands
             and t.consumers[0] + 3 < t.consumers[1] and not ctx.tags[t.producer])
    first, last = t.producer + 1, len(sched) - 1
    assert sched.nodes[first] in view.ancestors([sched.nodes[last]])
    swap = SimSwap(t.id, (t.consumers[0],), (SwapIn((t.consumers[1],), t.consumers[1] - 1),), waiters=(first, last))
    assert ctx.essential(swap).waiters == (first,)
    assert simulate(sched, [swap]).peak_bytes == simulate(sched, [ctx.essential(swap)]).peak_bytes


def test_a_chosen_swap_is_brought_back_later_when_nothing_else_is_left(tmp_path):
    """An MLP fed an 8 MiB input: the greedy swaps the input where the step first runs over, and
    brings it back in time for its one later reader (the first layer's weight gradient), so it
    lands before the next layer's gradients, which then run over with nothing left to swap (QA: no
    plan from 20 to 25 MiB). Bringing the input back later, from an op after that point (a short
    stall), plans down to 20 MiB; the rewrite trains bit-identically."""
    from lmscli.prove import steps
    from tests.conftest import v1_training_graph

    path = tmp_path / "mlp.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        init = v1.glorot_uniform_initializer(seed=1)
        h = v1.placeholder(tf.float32, [2048, 1024], name="inputs")
        for k, width in enumerate((512, 512, 256, 10)):
            w = v1.get_variable(f"w{k}", [h.shape[1], width], initializer=init, use_resource=True)
            h = tf.matmul(h, w, name=f"d{k}")
            h = tf.nn.relu(h) if width > 10 else h
        graph.loss = tf.reduce_mean(tf.square(h))
    model = api.load(str(path))
    prepared = api.prepare(model)
    result = api.tune(prepared, api.make_device(gpu_mem="20MiB", reserve=0.0), TuneOptions(strategy="swap"))
    assert result.fits
    swap = next(s for s in result.plan.swaps if s.tensor == "inputs:0")
    order = {name: k for k, name in enumerate(prepared.schedule.names)}
    (swap_in,) = swap.swap_ins
    assert order[swap_in.trigger] > order["gradients/d1_grad/MatMul_1"]
    new_graph, _ = api.rewrite(prepared, result.plan)
    before = steps.run_steps(model.meta_graph, model.fetches, steps=2)
    after = steps.run_steps(new_graph, model.fetches, steps=2)
    assert steps.first_difference(before, after) is None


def test_tflms_sync_swap_outs_make_no_op_wait_that_may_not(tmp_path):
    """TFLMS's sync_mode 1 makes a swapped tensor's near consumers wait for its swap-out. On a
    GPU (and on a CPU with oneDNN's kernels; the tests run without them) Grappler's remapper fuses
    a DenseNet's batch norms with their ReLUs, and a control input into one stops that fusion: the
    optimizer guard then forbade its concatenations and first convolution (27 MiB) for every later
    plan, which stopped at 2.1x the lower bound. Only the near consumers that may wait
    (:meth:`_Context.can_wait`: not a fused kernel's root, nor an op the guard named) do; here the
    batch norms are named as the guard would."""
    from lmscli.plan import planner
    from tests.conftest import densenet_meta

    prepared = api.prepare(api.load(str(densenet_meta(tmp_path / "densenet.meta"))))
    sched = prepared.schedule
    norms = frozenset(name for k, name in enumerate(sched.names) if sched.ops[k] == "FusedBatchNormV3")
    ctx = planner._Context(prepared, api.make_device(gpu_mem="1GiB"), api.Filters(), no_wait=norms)
    swaps = planner.tflms_swaps(ctx, planner.TflmsParams(1, 1, 0, 1))
    split = [s for s in swaps if any(sched.names[c] in norms for c in s.near)]
    assert split  # the concatenations (and conv0), read next by a batch norm
    for swap in swaps:
        waiting = set((swap.near if swap.sync_out else ()) + swap.waiters)
        assert waiting == {c for c in swap.near if ctx.can_wait(c, swap.tensor)}
        assert not {sched.names[c] for c in waiting} & norms
    assert all(not s.sync_out for s in split)
    whole = planner.tflms_swaps(planner._Context(prepared, api.make_device(gpu_mem="1GiB"), api.Filters()),
                                planner.TflmsParams(1, 1, 0, 1))
    assert all(s.sync_out and not s.waiters for s in whole)  # (with no op named, TFLMS's own)


def test_a_swap_in_brought_back_later_keeps_its_swap_out(samples):
    """When nothing is left to swap at a position its swap-in lands before, a chosen swap is
    brought back later (:func:`_later_swap_in`). On the stand-in, whose swap-outs leave only when an
    op waits for them, that is tried too, and only the swap-in moves: the swap-out keeps its
    waiters and frees the tensor where it did (before, the new swap was made to wait at the
    position, in the backward pass, and held the tensor through the forward pass; a DenseNet's
    18 MiB concatenation, brought in two ops before the filter gradient that ran over, stopped its
    plans there)."""
    from lmscli.plan import planner

    prepared = api.prepare(api.load(str(samples / "cnn.meta")))
    sched = prepared.schedule
    ctx = planner._Context(prepared, api.make_device(gpu_mem="1GiB"), api.Filters())
    ctx.waited_out = True  # (as on the stand-in)
    baseline = planner._judge(ctx, [])
    tid = next(t.id for t in sched.tensors if sched.names[t.producer] == "images" and t.id in ctx.cands)
    t = sched.tensors[tid]
    old = planner._gap_swap(ctx, ctx.cands[tid], (t.consumers[-2] + t.consumers[-1]) // 2, baseline.result,
                            baseline.d2h)
    assert old.swap.waiters and old.hi + 1 < t.consumers[-1]
    judged = planner._judge(ctx, [old.swap])
    later = [(p, planner._later_swap_in(ctx, {tid: old}, p, judged)) for p in range(old.hi + 1, t.consumers[-1])]
    later = [(p, c) for p, c in later if c is not None]
    assert later
    for p, choice in later:
        assert choice.replaces is old and choice.swap.waiters == old.swap.waiters and choice.lo == old.lo
        assert choice.swap.near == old.swap.near and p <= choice.swap.groups[0].trigger == choice.hi


def test_a_tensor_read_on_both_sides_of_the_largest_op_comes_back_twice(tmp_path):
    """A CNN's first activation is read by its layer's filter gradient and, after the input
    gradient, by the ReLU gradient below: brought back once, it sat beside the input gradient's
    two tensors, the largest of the step, and every plan stopped at 1.24x the lower bound (QA: no
    plan from 1.05x to 1.2x). Brought back for the filter gradient, freed, and back again for the
    ReLU gradient, with the input gradient waiting for the filter gradient (the order the plan
    needs), it plans at 1.1x; the rewrite trains bit-identically."""
    from lmscli.prove import steps
    from tests.conftest import six_conv_cnn

    model = api.load(str(six_conv_cnn(tmp_path / "cnn.meta")))
    prepared = api.prepare(model)
    budget = int(api.analyze(prepared).lower_bound_bytes * 1.1)
    result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0), TuneOptions(strategy="swap"))
    assert result.fits and result.plan.predicted["run_peak_bytes"] <= budget
    twice = [s for s in result.plan.swaps if len(s.swap_ins) == 2]
    assert twice
    order = {name: k for k, name in enumerate(prepared.schedule.names)}
    for swap in twice:
        first, second = swap.swap_ins
        last = max(order[c] for c in first.consumers)
        assert last < order[second.trigger] < min(order[c] for c in second.consumers)
        # the op between the two waits for the consumers of the first, unless it depends on them
        between = [b for a, b in result.plan.serialize if order[a] == last]
        assert all(last < order[b] <= order[second.trigger] for b in between)
    assert ("gradients/Conv2D_1_grad/Conv2DBackpropFilter",
            "gradients/Conv2D_1_grad/Conv2DBackpropInput") in result.plan.serialize
    new_graph, _ = api.rewrite(prepared, result.plan)
    node = next(n for n in new_graph.graph_def.node if n.name == "gradients/Conv2D_1_grad/Conv2DBackpropInput")
    assert "^gradients/Conv2D_1_grad/Conv2DBackpropFilter" in node.input
    before = steps.run_steps(model.meta_graph, model.fetches, steps=2)
    after = steps.run_steps(new_graph, model.fetches, steps=2)
    assert steps.first_difference(before, after) is None


def test_a_swap_in_lands_after_its_tensors_producer(samples):
    """A stand-in plan's swap-in lands before the op after its trigger (:func:`planner.landed`).
    A trigger may come before the tensor's producer (the stand-in's order reshaped a label late,
    after the logits it was swapped from), and the op after the trigger was then the producer
    itself, or one of its inputs: waiting for the swap-in of its own output, it closed a cycle (QA
    r38: "the rewritten graph is invalid: the graph has a cycle through 93 node(s)", exit 1)."""
    from lmscli.model.simulator import SimSwap, SwapIn
    from lmscli.plan.candidates import Filters
    from lmscli.plan.planner import _Context, landed

    prepared = _prepared(samples, "cnn")
    ctx = _Context(prepared, api.make_device(gpu_mem="1GiB"), Filters())
    sched = ctx.schedule
    cases = [t for t in sched.tensors if t.producer > 3 and t.consumers and t.consumers[-1] > t.producer + 4
             and any(ctx.can_land_at[k] for k in range(t.producer - 2, t.producer + 1))]
    assert cases
    for t in cases:
        (swap,) = landed(ctx, [SimSwap(t.id, (), (SwapIn((t.consumers[-1],), t.producer - 3),))])
        assert swap.groups[0].landing == -1 or t.producer < swap.groups[0].landing < t.consumers[-1]


def test_a_stand_in_plan_stays_within_its_budget_when_its_swap_ins_are_made_to_land(samples, monkeypatch):
    """On the stand-in each swap-in is made to land before a chosen op (planner.landed), which
    moves where its buffer is taken; near the budget that could cost a few KiB, and a 3D U-Net plan
    for 14 MiB came out 3 KiB over it. A landing that takes the plan over its budget is not
    applied: here every landing is made to fail that way (the planner's landing gives back no
    swaps at all), and the plan still fits as chosen."""
    from dataclasses import replace

    from lmscli.plan import planner

    prepared = api.prepare(api.load(str(samples / "cnn.meta")))
    schedule = prepared.schedule.on_stand_in()
    prepared = replace(prepared, schedule=schedule, schedules=(schedule,))
    device = _device(prepared, "mid")
    monkeypatch.setattr(planner, "landed", lambda ctx, swaps: [])
    result = planner.tune(prepared, device, TuneOptions())
    assert result.plan.swaps and result.result.peak_bytes <= device.budget


def test_a_reshape_grappler_keeps_once_can_still_be_swapped(tmp_path):
    """QA r47 (a WaveNet): each gated layer convolves its input twice, for the filter and the gate,
    and ``conv1d`` expands it each time; Grappler keeps one of the two identical ``ExpandDims``,
    both share the input's buffer, and the removed one was no candidate, so no plan could free
    the buffer (stuck at 3x the lower bound here, 1.6x on the WaveNet). The removed one is
    swapped like its twin (a GPU plan at 10 MiB, none before), and the rewrite trains
    bit-identically."""
    from lmscli.plan.candidates import candidates
    from tests.conftest import v1_training_graph

    path = tmp_path / "gated.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        h = v1.placeholder(tf.float32, [8, 1024, 32], name="x")
        for i in range(6):
            with tf.name_scope(f"l{i}"):
                f = tf.nn.conv1d(h, v1.get_variable(f"wf{i}", [1, 32, 32]), 1, "VALID")
                g = tf.nn.conv1d(h, v1.get_variable(f"wg{i}", [1, 32, 32]), 1, "VALID")
                h = h + tf.tanh(f) * tf.sigmoid(g)
        graph.loss = tf.reduce_mean(tf.square(h))
    model = api.load(str(path))
    prepared = api.prepare(model)
    view, sched = prepared.view, prepared.schedule
    removed = {n for n in prepared.fused if view.ops[view.index[n]] == "ExpandDims"}
    assert len(removed) == 6  # one of each layer's two
    cands = candidates(view, sched, fused=frozenset(prepared.fused))
    swappable = {sched.names[sched.tensors[t].producer] for t in cands}
    assert removed <= swappable
    gpu = api.tune(prepared, api.make_device(gpu_mem=10 << 20), TuneOptions(strategy="swap"))  # (stuck at 12.05 MiB)
    assert gpu.fits and removed & {s.tensor.split(":")[0] for s in gpu.plan.swaps}
    # (trained bit-identically; a proof under a limit is left out: on the stand-in a plan for this
    # net near its limit held in some runs and not others under the suite's load)
    from lmscli.prove import steps

    rewritten = api.rewrite(prepared, gpu.plan)[0]
    before = steps.run_steps(model.meta_graph, model.fetches, steps=2)
    assert steps.first_difference(before, steps.run_steps(rewritten, model.fetches, steps=2)) is None


def test_attentions_head_split_transposes_are_swapped_and_matrix_transposes_are_not(tmp_path):
    """Grappler folds a transpose of the last two dimensions into the matrix product reading it
    (its adjoint flags), so a swap node on that edge changes the kernel: such a transpose's output
    is never rewired. Attention's head split (``[0, 2, 1, 3]``) is no such transpose: queries,
    keys and values, which the backward pass reads, may be swapped where the plans without them
    reach no plan (a 2-layer encoder's swap plans stopped at 12.98 MiB for 10.80; the greedy
    plans take them last, as they do what TFLMS did not swap), and the rewrite trains
    bit-identically."""
    from lmscli.plan.candidates import candidates
    from lmscli.prove import steps
    from tests.conftest import load_generator, v1_training_graph

    path = tmp_path / "heads.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        x = v1.placeholder(tf.float32, [256, 32], name="x")
        q = tf.transpose(tf.reshape(tf.matmul(x, v1.get_variable("wq", [32, 32])), [4, 64, 4, 8]), [0, 2, 1, 3],
                         name="heads_q")
        k = tf.transpose(tf.reshape(tf.matmul(x, v1.get_variable("wk", [32, 32])), [4, 64, 4, 8]), [0, 2, 1, 3],
                         name="heads_k")
        kt = tf.transpose(k, [0, 1, 3, 2], name="keys_t")  # folded into the product (adj_y)
        graph.loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.softmax(tf.matmul(q, kt)), q)))
    prepared = api.prepare(api.load(str(path)))
    view, sched = prepared.view, prepared.schedule
    cands = candidates(view, sched, fused=frozenset(prepared.fused))
    assert "heads_q:0" in {sched.label(t) for t in cands}  # (heads_k is read by keys_t only)
    assert "keys_t:0" not in {sched.label(t) for t in cands}

    path = tmp_path / "transformer.meta"
    path.write_bytes(load_generator().build("transformer", batch=4, d_model=128, ffn=512, heads=4, layers=2,
                                            seq=128).SerializeToString(deterministic=True))
    model = api.load(str(path))
    prepared = api.prepare(model)
    plan = api.tune(prepared, api.make_device(gpu_mem=int(10.8 * 2**20), reserve=0.0),
                    TuneOptions(strategy="swap")).plan
    assert any("attention/transpose" in s.tensor for s in plan.swaps)
    rewritten = api.rewrite(prepared, plan)[0]
    before = steps.run_steps(model.meta_graph, model.fetches, steps=2)
    assert steps.first_difference(before, steps.run_steps(rewritten, model.fetches, steps=2)) is None


@pytest.fixture(scope="module")
def silu_net(tmp_path_factory):
    """Four EfficientNet-style blocks (4x32x32x16): a 1x1 expansion and a 3x3 depthwise convolution,
    each with a batch norm and the swish tf_keras uses (``tf.nn.silu``: a custom gradient whose
    results pass an IdentityN, and which computes ``beta * x`` and ``x`` squared again), a
    squeeze-and-excitation gate, a 1x1 projection and a residual add; the optimizer's step waits for
    the batch norms' moving-average updates, as tf_keras models make it."""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    v1 = tf.compat.v1
    path = tmp_path_factory.mktemp("silu") / "silu.meta"
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(0)

        def var(shape):
            k = len(v1.global_variables())
            return v1.get_variable(f"v{k}", shape, use_resource=True, initializer=v1.glorot_uniform_initializer(seed=k))

        def batch_norm(h, name):
            width = h.shape[-1]
            with v1.variable_scope(name):
                scale = v1.get_variable("gamma", [width], initializer=v1.ones_initializer(), use_resource=True)
                offset = v1.get_variable("beta", [width], initializer=v1.zeros_initializer(), use_resource=True)
                moving = v1.get_variable("moving_mean", [width], initializer=v1.zeros_initializer(),
                                         use_resource=True, trainable=False)
                h, mean, _var = v1.nn.fused_batch_norm(h, scale, offset, is_training=True)
                v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign_sub(moving, (moving - mean) * 0.01))
            return h

        h = v1.placeholder(tf.float32, [4, 32, 32, 16], name="images")
        for k in range(4):
            c = h.shape[-1]
            e = tf.nn.silu(batch_norm(tf.nn.conv2d(h, var([1, 1, c, c * 4]), 1, "SAME"), f"e{k}"))
            d = tf.nn.silu(batch_norm(tf.nn.depthwise_conv2d(e, var([3, 3, c * 4, 1]), [1, 1, 1, 1], "SAME"),
                                      f"d{k}"))
            se = tf.nn.silu(tf.nn.conv2d(tf.reduce_mean(d, [1, 2], keepdims=True), var([1, 1, c * 4, c]), 1, "SAME"))
            se = tf.sigmoid(tf.nn.conv2d(se, var([1, 1, c, c * 4]), 1, "SAME"))
            h = h + batch_norm(tf.nn.conv2d(d * se, var([1, 1, c * 4, c]), 1, "SAME"), f"p{k}")
        loss = tf.identity(tf.reduce_mean(tf.square(tf.reduce_mean(h, [1, 2]))), name="loss")
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            v1.add_to_collection("train_op", v1.train.AdamOptimizer(1e-3).minimize(loss))
        v1.train.export_meta_graph(str(path), graph=graph)
    return path


@pytest.mark.slow
def test_a_graph_grappler_shrinks_unevenly_is_planned_for_more_as_written(silu_net, runner, tmp_path, monkeypatch):
    """QA r50 (a tf_keras EfficientNet-style net): the swish gradients' ops that read only the
    activation wait for the moving-average updates, so as written they run when the forward pass
    ends and hold their outputs through the backward pass, where no swap can move them; Grappler's
    optimizations fold them away (here 39.3 MiB as written, 31.2 run). The budget scaled by that
    ratio was out of reach as written: no plan at 40% of the peak (less the 10% reserve), though
    the graph TensorFlow runs fitted with a plan made for more. The tune loop now plans for
    targets between the scaled one and the peak as written, and the judge decides. The plan
    swaps swish outputs (IdentityN), and trains bit-identically."""
    from lmscli.model.simulator import simulate
    from lmscli.plan import tuning

    prepared = api.prepare(api.load(str(silu_net)))
    device = api.make_device(gpu_mem=int(simulate(prepared.schedule, detail=False).peak_bytes * 0.40), link="pcie3")
    with monkeypatch.context() as patched:
        patched.setattr(tuning, "FOR_MORE_STEPS", 0)
        with pytest.raises(NoFitError, match="it was planned for"):
            api.tune(prepared, device)
    result = api.tune(prepared, device)
    assert result.plan.changes and result.plan.predicted["run_peak_bytes"] <= device.budget
    view = prepared.view
    assert any(view.ops[view.index[s.tensor.rsplit(":", 1)[0]]] == "IdentityN" for s in result.plan.swaps)
    out = tmp_path / "out.meta"
    api.save(prepared.model, api.rewrite(prepared, result.plan)[0], str(out))
    verified = invoke(runner, "verify", silu_net, out, "--no-measure")
    assert verified.exit_code == 0 and "bit-identical" in verified.output
    # Below what any plan reached, the answer gives what the judge found, not the last (smallest)
    # planning target alone (it said the graph TensorFlow runs needs more than as written)
    low = api.make_device(gpu_mem=int(simulate(prepared.schedule, detail=False).peak_bytes * 0.30), link="pcie3")
    with pytest.raises(NoFitError, match=r"the graph TensorFlow runs needed .* or more with each of the \d+ plan"):
        api.tune(prepared, low)


def test_custom_gradient_outputs_are_candidates(silu_net):
    """``tf.custom_gradient`` (every ``tf.nn.silu``) returns its results through an IdentityN
    Grappler removes; its outputs are candidates like a removed Identity's (QA r50: none were, and
    an EfficientNet-style net's first plan was at 60% of its peak; now at 38%)."""
    from lmscli.plan.planner import _Context

    prepared = api.prepare(api.load(str(silu_net)))
    ctx = _Context(prepared, api.make_device(gpu_mem=1 << 30), TuneOptions().filters)
    sched, view = prepared.schedule, prepared.view
    swish = [t.id for t in sched.tensors if view.ops[sched.nodes[t.producer]] == "IdentityN" and t.output == 0
             and t.num_bytes >= 1 << 20]
    assert len(swish) == 8 and all(tid in ctx.cands for tid in swish)


def test_no_swap_in_waits_for_an_identity_grappler_removes(attention):
    """A control edge from a node Grappler's dependency optimizer removes (tf.gradients'
    ``tuple/control_dependency`` Identities) keeps that node, and a kept Identity stops the
    constant push-down across it: a GELU gradient's product came out grouped otherwise, and the
    guard forbade the tensors whose swap-ins waited for such Identities. The encoder found no
    swap plan on PCIe 3 at half its peak (the guard left a GELU product unswapped); triggers
    are now taken before those Identities, and the plan trains bit-identically."""
    from lmscli.prove import steps

    model = api.load(str(attention))
    prepared = api.prepare(model)
    device = api.make_device(gpu_mem=int(prepared.run_peak_bytes * 0.5), link="pcie3")
    result = api.tune(prepared, device, TuneOptions(strategy="swap"))
    view = prepared.view
    triggers = {g.trigger for s in result.plan.swaps for g in s.swap_ins}
    assert triggers and not {t for t in triggers if t in prepared.fused and view.ops[view.index[t]] == "Identity"}
    assert not result.plan.grappler.get("left_alone")
    rewritten, _ = api.rewrite(prepared, result.plan)
    before = steps.run_steps(model.meta_graph, model.fetches, steps=2)
    assert steps.first_difference(before, steps.run_steps(rewritten, model.fetches, steps=2)) is None
