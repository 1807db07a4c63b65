"""Ops that free more than they make, run before their siblings (lmscli.plan.ordering)."""

from __future__ import annotations

import json

import pytest

from lmscli import api
from lmscli.graph.opdefs import StatefulOps
from lmscli.model.simulator import simulate
from lmscli.plan import ordering
from lmscli.plan.recompute import VARIABLE_READS, variable_of
from tests.conftest import SAMPLES, TRAINING_SAMPLES, invoke


def _variables(view, node) -> set:
    return {v for v in (variable_of(view, src) for src, _ in view.data_inputs[node]) if v is not None}


def _in_graph_order(prepared, schedule, written) -> None:
    """Every op of ``schedule`` comes after every op of it that it reads or waits for (but through
    a loop's back edge), every tensor's readers after its producer as in the step as ``written``,
    and tensor ids in producer order."""
    view = prepared.view
    pos = {node: k for k, node in enumerate(schedule.nodes)}
    for k, node in enumerate(schedule.nodes):
        for src in [s for s, _ in view.data_inputs[node]] + list(view.control_inputs[node]):
            if src in pos and not view.is_back_edge(src, node):
                assert pos[src] < k, (view.names[src], view.names[node])

    def reads(s):
        return {(s.names[t.producer], s.names[c]) for t in s.tensors for c in t.consumers if c > t.producer}

    assert reads(schedule) == reads(written)
    assert [t.producer for t in schedule.tensors] == sorted(t.producer for t in schedule.tensors)


@pytest.mark.parametrize("name", TRAINING_SAMPLES)
def test_moves_keep_a_valid_order_and_never_raise_the_peak(name):
    """On every sample: each move takes an op only past ops it does not depend on, to just before
    an op that makes a buffer; the moved schedule is an order of the graph; the same input gives
    the same moves; no moved op or waiting op is in a loop, a cond branch or off the GPU; of the
    stateful ops only optimizer updates move, never past an op that touches their variables, and
    no op moves past an update of a variable it reads; the peak does not rise, and no op but the
    moved ones runs with more memory held than in the step as written."""
    prepared = api.prepare(api.load(str(SAMPLES / f"{name}.meta")), batch_size=4 if name == "unknown_batch" else None)
    schedule, view = prepared.schedule, prepared.view
    moves = ordering.freeing_first(view, schedule, prepared.fused)
    assert moves == ordering.freeing_first(view, schedule, prepared.fused)
    index = {n: k for k, n in enumerate(schedule.names)}
    stateful = StatefulOps()
    for first, then in moves:
        b, a = index[first], index[then]
        assert a < b <= a + ordering.WINDOW
        op = schedule.ops[b]
        assert not stateful(op) or op.startswith(ordering.TRAINING_OPS)
        # an update never passes an op touching its variables, nor an op any variable it reads
        mine = _variables(view, schedule.nodes[b])
        for k in range(a, b):
            theirs = _variables(view, schedule.nodes[k])
            assert not (stateful(op) and mine & theirs), (first, schedule.names[k])
            assert not (stateful(schedule.ops[k]) and schedule.ops[k] not in VARIABLE_READS and mine & theirs)
        for node in (schedule.nodes[a], schedule.nodes[b]):
            assert not view.in_loop(node) and not view.conditional(node) and schedule.on_gpu[index[view.names[node]]]
    assert len({m[0] for m in moves}) == len(moves) == len({m[1] for m in moves})
    moved = ordering.applied(schedule, moves, view)
    assert moved == ordering.applied(schedule, moves)  # (its moves are legal by the graph's edges)
    assert sorted(moved.names) == sorted(schedule.names)
    _in_graph_order(prepared, moved, schedule)
    before, after = simulate(schedule), simulate(moved)
    assert after.peak_bytes <= before.peak_bytes
    held = dict(zip(schedule.names, before.memory_by_position))
    early = {first for first, _ in moves}  # (an op moved earlier runs among more live tensors itself)
    for k, n in enumerate(moved.names):
        assert n in early or after.memory_by_position[k] <= held[n], n


def test_the_3d_unets_filter_gradients_run_before_its_input_gradients():
    """The sample 3D U-Net in the stand-in's traced order: a decoder convolution's filter gradient
    (the last reader of the concatenation it convolved) is moved before its input gradient (which
    makes a buffer that size), and the planner's floor follows: it plans for less than without the
    moves (9 to 9.5 MiB against 10 to 10.5, in three traced orders); the plan's figures are the
    step's as written, and replaying the plan (its JSON) gives its peak."""
    from lmscli.device import STAND_IN_LINK
    from lmscli.plan.planner import tune as plan_tune

    prepared = api.for_stand_in(api.prepare(api.load(str(SAMPLES / "unet3d.meta"))))
    moves = ordering.freeing_first(prepared.view, prepared.schedule, prepared.fused)
    # (of the convolutions with an input gradient: the first one's filter gradient, which has none,
    # may move before another op, such as a loss's Mean the executor ran last)
    convs = [m for m in moves if m[0].endswith("Conv3DBackpropFilterV2")
             and m[0].replace("FilterV2", "InputV2") in prepared.schedule.names]
    assert convs and all(then == first.replace("FilterV2", "InputV2") for first, then in convs)
    def floor(options):
        for half_mib in range(16, 40):  # 8 to 20 MiB
            device = api.make_device(gpu_mem=half_mib << 19, reserve=0.0, link=STAND_IN_LINK)
            try:
                return device, plan_tune(prepared, device, options)
            except api.NoFitError:
                continue
        raise AssertionError("no plan up to 20 MiB")

    kept, _ = floor(api.TuneOptions(reorder=False))
    device, result = floor(api.TuneOptions())
    assert device.budget < kept.budget
    assert result.result.peak_bytes <= device.budget and set(moves) <= set(result.plan.serialize)
    assert result.plan.predicted["peak_bytes_without_plan"] == simulate(prepared.schedule).peak_bytes
    replayed = api.replay(prepared, api.Plan.from_json(result.plan.to_json()))
    assert replayed.result.peak_bytes == result.result.peak_bytes


def test_moves_are_made_on_the_stand_in_by_default_and_keep_order_makes_none(runner):
    """`--keep-order` is ``reorder=False``; by default (``None``) a GPU's plan keeps the order (see
    planner._moves) and ``reorder=True`` moves there too."""
    from lmscli.cli import _tune_options
    from lmscli.plan.planner import tune as plan_tune

    common = dict(strategy="hybrid", swapout_threshold=None, swapin_ahead=None, swapin_groupby=None, sync_mode=None,
                  include_scope=(), exclude_scope=(), include_type=(), exclude_type=(), exclude_consumer_scope=(),
                  exclude_consumer_type=())
    assert _tune_options(**common, keep_order=True).reorder is False and _tune_options(**common).reorder is None
    assert "--keep-order" in invoke(runner, "rewrite", "--help").output
    prepared = api.prepare(api.load(str(SAMPLES / "cnn.meta")))
    device = api.make_device(gpu_mem=int(simulate(prepared.schedule).peak_bytes * 0.8), reserve=0.0)
    assert not plan_tune(prepared, device).plan.serialize
    assert plan_tune(prepared, device, api.TuneOptions(reorder=True)).plan.serialize


@pytest.mark.slow
def test_a_reordered_plan_trains_bit_identically_where_the_original_runs_out_of_memory(runner, tmp_path):
    """`lms rewrite --stand-in --gpu-mem 12MiB` on the sample 3D U-Net (no plan under 14 MiB
    without the moves), then `lms verify --gpu-mem 12MiB`: the original runs out of memory, the
    rewrite, with its control edges, trains bit-identically."""
    out = tmp_path / "unet_12.meta"
    # (--time-limit: the first judged plan after 40 s, not the one that swaps least; the suite's
    # longest test took 40-275 s refining it; with 20 s, 18 s had passed before the first plan's
    # runs in one run of three on an idle machine, and no plan was judged; --judge-runs 2:
    # verify proves it next)
    done = invoke(runner, "rewrite", SAMPLES / "unet3d.meta", out, "--gpu-mem", "12MiB", "--stand-in", "--judge-runs", "2",
                  "--json", "-v", "--time-limit", "40")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["plan"]["serialize"]
    assert "[LMS] round 1: a plan of " in done.stderr and " run(s) on the stand-in" in done.stderr  # (-v)
    proof = invoke(runner, "verify", SAMPLES / "unet3d.meta", out, "--gpu-mem", "12MiB")
    assert proof.exit_code == 0, proof.output
    assert "original: out of memory at 12.00 MiB; rewritten: trains at 12.00 MiB, bit-identical" in proof.output


@pytest.mark.parametrize("name", ["cnn", "resnet50"])
def test_chains_that_cannot_be_run_in_their_order_leave_the_schedule_an_order(name):
    """`--serialize` chains of one level's ops, each way round: an op is moved ahead of another only
    when what it reads is made before it, so the simulated schedule stays an order of the graph."""
    prepared = api.prepare(api.load(str(SAMPLES / f"{name}.meta")))
    levels = sorted(set(prepared.view.levels[n] for n in prepared.schedule.nodes))
    chains = api.serialization_chains(prepared, levels)
    assert chains
    for each in (chains, tuple(tuple(reversed(c)) for c in chains)):
        _in_graph_order(prepared, ordering.applied(prepared.schedule, each, prepared.view), prepared.schedule)


@pytest.mark.parametrize("graph", ["resource-variables", "reference-variables", "sample-cnn"])
def test_a_plan_with_moves_trains_bit_identically(tmp_path, graph):
    """Plans with moves train two steps bit-identically: a batch-norm CNN with dropout and momentum
    (a filter gradient ahead of an input gradient; with reference variables also a ReLU gradient
    ahead of a momentum update it does not touch), and the sample CNN, whose plan moves the
    optimizer's updates ahead (each frees the weight gradient it reads)."""
    from tests.test_recompute import _between, _bn_cnn, _identical

    path = SAMPLES / "cnn.meta" if graph == "sample-cnn" else _bn_cnn(tmp_path / "cnn.meta",
                                                                      resource=graph == "resource-variables")
    model = api.load(str(path))
    prepared = api.prepare(model)
    result = api.tune(prepared, api.make_device(gpu_mem=_between(prepared, 0.6), reserve=0.0),
                      api.TuneOptions(reorder=True), check=False)
    assert result.fits and result.plan.serialize
    if graph == "sample-cnn":
        assert any(first.rsplit("/", 1)[-1].startswith(ordering.TRAINING_OPS) for first, _ in result.plan.serialize)
    new_graph, _ = api.rewrite(prepared, result.plan)
    nodes = {n.name: n for n in new_graph.graph_def.node}
    for first, then in result.plan.serialize:
        assert f"^{first}" in nodes[then].input
    _identical(model, new_graph)


def test_updates_held_to_the_end_of_the_step_run_as_early_as_their_gradients():
    """The stand-in's executor ran a residual MLP's first nine optimizer updates at the end of the
    step, and their weight gradients stayed through the backward pass. An update that makes
    nothing may move back any distance (not only :data:`ordering.WINDOW` positions): the sample
    CNN with its updates run last holds 0.54 MB more at its peak; moved, its peak is within 0.1%
    of the step as traced."""
    prepared = api.prepare(api.load(str(SAMPLES / "cnn.meta")))
    sched, view = prepared.schedule, prepared.view
    index = {name: k for k, name in enumerate(sched.names)}
    updates = [k for k, op in enumerate(sched.ops) if op.startswith(ordering.TRAINING_OPS)]
    order = [k for k in range(len(sched)) if k not in set(updates)]
    for u in updates:  # each just before the first op waiting for it
        order.insert(next((i for i, k in enumerate(order) if u in ordering._needs(sched, k, view, index)),
                          len(order)), u)
    late = sched.reordered(order)
    _in_graph_order(prepared, late, sched)
    moves = ordering.freeing_first(view, late)
    pos = {name: k for k, name in enumerate(late.names)}
    back = [pos[b] - pos[a] for b, a in moves if late.ops[pos[b]].startswith(ordering.TRAINING_OPS)]
    assert max(back) > ordering.WINDOW
    moved = ordering.applied(late, moves, view)
    _in_graph_order(prepared, moved, sched)
    peak, held, freed = (simulate(s).peak_bytes for s in (sched, late, moved))
    assert held > peak + 500_000 and freed <= peak * 1.001


def test_moved_ops_the_optimizer_guard_names_are_moved_no_more(monkeypatch):
    """The optimizer guard names the ops of the plan's moves it finds changing what Grappler's
    optimizations make of the graph (QA: a loss's Mean made to wait for a softmax gradient; the
    rewrite trained, not bit-identically). Those ops are then never moved nor made to wait, and the
    step is planned again (before, the guard's ops were dropped on the floor)."""
    from lmscli.plan import tuning

    prepared = api.prepare(api.load(str(SAMPLES / "cnn.meta")))
    device = api.make_device(gpu_mem=int(simulate(prepared.schedule).peak_bytes * 0.8), reserve=0.0)
    options = api.TuneOptions(reorder=True)
    first = api.tune(prepared, device, options, check=False, guard=False).plan.serialize
    assert first
    named = frozenset(first[0])
    calls = []
    real = tuning.optimizer_culprits

    def culprits(prepared, plan, rewritten, optimized=None, waiters=None):
        calls.append(plan.serialize)
        found = tuple(sorted(op for chain in plan.serialize for op in chain if op in named))
        return ((), found) if found else real(prepared, plan, rewritten, optimized, waiters)

    monkeypatch.setattr(tuning, "optimizer_culprits", culprits)
    result = api.tune(prepared, device, options, check=False)
    plan = result.plan
    assert any("op(s) in their place" in line for line in result.log)
    assert len(calls) >= 2 and calls[0] == first
    assert plan.serialize and not {op for chain in plan.serialize for op in chain} & named
    assert not {op for m in ordering.freeing_first(prepared.view, prepared.schedule, prepared.fused, named)
                for op in m} & named


def test_no_placeholder_or_variable_is_moved_or_made_to_wait(tmp_path):
    """A placeholder is fed (a control input into it is lost) and a variable op waiting for the
    step's ops would make its initialisation run them: neither takes part in a move. QA: a
    stand-in's traced order ran a mixed-precision net's label placeholder just before the float16
    cast of its images, the cast (which frees the float32 images) was moved ahead of it, and the
    rewriter refused the plan ("makes 'labels' (Placeholder) wait for 'Cast'"), exit 1."""
    from lmscli.graph.graphview import UNWAITING_OPS
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        images = v1.placeholder(tf.float32, [16, 32, 32, 8], name="images")
        labels = v1.placeholder(tf.float32, [16, 10], name="labels")
        w = v1.get_variable("w", [3, 3, 8, 16], initializer=v1.glorot_uniform_initializer(seed=1), use_resource=True)
        y = tf.nn.relu(tf.nn.conv2d(tf.cast(images, tf.float16, name="Cast"), tf.cast(w, tf.float16), 1, "SAME"))
        d = v1.get_variable("d", [16, 10], initializer=v1.glorot_uniform_initializer(seed=2), use_resource=True)
        logits = tf.cast(tf.reduce_mean(y, [1, 2]), tf.float32) @ d
        loss = tf.identity(tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)),
                           name="loss")
        v1.add_to_collection("train_op", v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train_op"))
        v1.train.export_meta_graph(str(tmp_path / "mixed.meta"), graph=graph, clear_devices=True)
    prepared = api.prepare(api.load(str(tmp_path / "mixed.meta")))
    order = [name for name in prepared.schedule.names if name != "labels"]
    order.insert(order.index("Cast"), "labels")  # (as the stand-in ran it)
    seen = prepared.observed(order)
    assert seen.schedule.names.index("labels") + 1 == seen.schedule.names.index("Cast")
    moves = ordering.freeing_first(seen.view, seen.schedule, seen.fused)
    ops = dict(zip(seen.schedule.names, seen.schedule.ops))
    assert not [m for m in moves if {ops[m[0]], ops[m[1]]} & UNWAITING_OPS]
    # (the cast still frees the images when it runs where it is)
    assert ("Cast", "labels") not in moves


def _accumulating(path) -> None:
    """A conv net whose step runs two micro-batches through the same weights and sums their
    gradients (gradient accumulation): two inputs, two tf.gradients, one update."""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        weights = {}

        def net(x, scope):
            with v1.variable_scope("net", reuse=v1.AUTO_REUSE):
                for k, width in enumerate((16, 32, 32, 16)):
                    w = v1.get_variable(f"w{k}", [3, 3, int(x.shape[-1]), width], use_resource=True,
                                        initializer=v1.glorot_uniform_initializer(seed=k))
                    weights[w.name] = w
                    x = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME", name=f"{scope}_conv{k}"))
                fc = v1.get_variable("fc", [16, 10], use_resource=True, initializer=v1.glorot_uniform_initializer(seed=9))
                weights[fc.name] = fc
                return tf.reduce_mean(x, [1, 2]) @ fc

        grads = []
        for m in range(2):
            images = v1.placeholder(tf.float32, [8, 32, 32, 3], name=f"images{m}")
            labels = v1.placeholder(tf.float32, [8, 10], name=f"labels{m}")
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=net(images, f"m{m}")))
            grads.append(tf.gradients(loss, list(weights.values())))
        summed = [tf.add_n(pair) for pair in zip(*grads)]
        train = v1.train.GradientDescentOptimizer(0.01).apply_gradients(zip(summed, weights.values()), name="train_op")
        v1.add_to_collection("train_op", train)
        v1.train.export_meta_graph(str(path), graph=graph, clear_devices=True)


@pytest.fixture(scope="module")
def accumulating(tmp_path_factory):
    path = tmp_path_factory.mktemp("accumulating") / "accumulating.meta"
    _accumulating(path)
    return path


def test_the_work_on_one_input_waits_until_the_work_on_another_has_run(accumulating):
    """Gradient accumulation's two micro-batches, run interleaved (as the stand-in's executor ran
    them), hold both micro-batches' activations at once. The delays make the first op of one
    micro-batch wait for each op that ends the other's work (its weight gradients, which the
    executor leaves for later, and with them the activations they read): the schedule they make is
    an order of the graph and its peak is about one micro-batch's; no placeholder, variable or
    stateful op takes part. (QA round 37: 16 MiB on the stand-in before, planned at 11 and 12 after,
    where every plan ran out of memory before.)"""
    from lmscli.graph.graphview import UNWAITING_OPS

    prepared = api.prepare(api.load(str(accumulating)))
    sched, view = prepared.schedule, prepared.view
    index = {name: k for k, name in enumerate(sched.names)}
    interleaved = _interleaved(prepared)
    _in_graph_order(prepared, interleaved, sched)
    delays = ordering.later_branches(view, interleaved, prepared.fused)
    assert delays and ordering.later_branches(view, interleaved, prepared.fused) == delays
    assert len({x for _y, x in delays}) == 1 and len(delays) <= ordering.MAX_WAITS
    stateful = StatefulOps()
    for y, x in delays:
        for name in (y, x):
            assert sched.ops[index[name]] not in UNWAITING_OPS and not stateful(sched.ops[index[name]])
    moved = ordering.applied(interleaved, delays, view)
    _in_graph_order(prepared, moved, sched)
    waiter = delays[0][1]
    pos = {name: k for k, name in enumerate(moved.names)}
    assert all(pos[y] < pos[waiter] for y, _x in delays)
    peak, woven_peak, delayed_peak = (simulate(s).peak_bytes for s in (sched, interleaved, moved))
    assert delayed_peak < 0.8 * woven_peak and delayed_peak <= peak
    # Nothing to delay once the step is under the budget.
    assert ordering.later_branches(view, interleaved, prepared.fused, budget=woven_peak) == ()
    # With the moves that follow them (which leave the ops of a delay alone), every edge holds in
    # the planned order and the written graph has no cycle.
    from dataclasses import replace

    from lmscli.plan import planner

    woven_step = replace(prepared, schedule=interleaved, schedules=(interleaved,))
    device = api.make_device(gpu_mem=int(0.7 * woven_peak), reserve=0.0)
    chains, planned, _after, delays_made, waiting = planner._moves(woven_step, device, api.TuneOptions(reorder=True), 0)
    assert delays_made == len(delays) and waiting == 1
    pos = {name: k for k, name in enumerate(planned.names)}
    assert all(pos[a] < pos[b] for a, b in chains)
    plan = planner.tune(woven_step, api.make_device(gpu_mem="1GiB", reserve=0.0)).plan
    api.rewrite(woven_step, replace(plan, serialize=tuple(chains)))  # (validated: no cycle)


def _interleaved(prepared):
    """The accumulating net's schedule with its two micro-batches interleaved, op by op."""
    sched, view = prepared.schedule, prepared.view
    index = {name: k for k, name in enumerate(sched.names)}
    first = [k for k, n in enumerate(sched.names) if "m0_" in n or n.startswith("gradients/")]
    second = [k for k, n in enumerate(sched.names) if "m1_" in n or n.startswith("gradients_1/")]
    rest = [k for k in range(len(sched)) if k not in set(first) | set(second)]
    woven = [k for pair in zip(first, second) for k in pair] + first[len(second):] + second[len(first):]
    return sched.reordered(_an_order(sched, view, rest[:len(rest) // 2] + woven + rest[len(rest) // 2:], index))


def _an_order(sched, view, wanted, index) -> list:
    """``wanted`` (positions) made a valid order: each op as soon as what it needs has run."""
    done, out, pending = set(), [], list(wanted)
    while pending:
        for i, k in enumerate(pending):
            if all(m in done for m in ordering._needs(sched, k, view, index)):
                out.append(k)
                done.add(k)
                del pending[i]
                break
    return out


@pytest.mark.slow
def test_micro_batches_run_one_after_the_other_train_bit_identically_in_less(accumulating, runner, tmp_path):
    """The delays of the interleaved accumulating net, written with nothing else: `lms verify
    --gpu-mem 6MiB --runs 8` proves that the original runs out of memory and the rewrite, its
    micro-batches one after the other, trains bit-identically in every run (it needs 6). The
    original's need varies with the executor's order: up to 8 MiB when it interleaves the
    micro-batches, 6 to 7 when it happens to run them one after the other, so a run of it fits at
    7 MiB now and then, and under load all three of a default proof did (CI, stop 40); at 6 MiB
    about half its runs fail, and the proof stops at its first failure. (The delays are made from
    an interleaved order.)"""
    from dataclasses import replace

    from lmscli.plan import planner

    model = api.load(str(accumulating))
    prepared = api.prepare(model)
    delays = ordering.later_branches(prepared.view, _interleaved(prepared), prepared.fused)
    assert delays
    plan = planner.tune(prepared, api.make_device(gpu_mem="1GiB", reserve=0.0)).plan
    meta, _ = api.rewrite(prepared, replace(plan, swaps=(), recomputes=(), serialize=tuple(delays)))
    out = tmp_path / "accumulating_delayed.meta"
    api.save(model, meta, str(out))
    proof = invoke(runner, "verify", accumulating, out, "--gpu-mem", "6MiB", "--runs", "8")
    assert proof.exit_code == 0, proof.output
    assert "original: out of memory at 6.00 MiB; rewritten: trains at 6.00 MiB, bit-identical" in proof.output


def test_a_gpu_plan_reorders_when_no_plan_in_the_steps_order_passes_the_judge(accumulating):
    """On a GPU the step's order is kept, unless no plan made in it passes the judge: the graph
    TensorFlow runs interleaves the two micro-batches' backward passes (QA r54: two towers of one
    net on one GPU had no plan at 75% of its peak). At 60% of the accumulating net's peak every
    plan in the step's order needs more than the budget there (``--keep-order``: no plan); with
    the fallback's moves one fits, and its rewrite trains bit-identically."""
    from lmscli.prove import steps

    model = api.load(str(accumulating))
    prepared = api.prepare(model)
    device = api.make_device(gpu_mem=int(prepared.run_peak_bytes * 0.6), reserve=0.0)
    with pytest.raises(api.NoFitError):
        api.tune(prepared, device, api.TuneOptions(reorder=False))
    result = api.tune(prepared, device)
    assert result.fits and result.plan.serialize
    assert result.plan.predicted["run_peak_bytes"] <= device.budget
    assert any("no plan made in the step's order passed the judge" in line for line in result.log)
    meta, _ = api.rewrite(prepared, result.plan)
    before = steps.run_steps(model.meta_graph, model.fetches, steps=2)
    assert steps.first_difference(before, steps.run_steps(meta, model.fetches, steps=2)) is None


def test_a_stand_in_step_is_planned_in_the_traced_order_that_needs_the_most():
    """The traced steps' orders can differ much (QA: a gradient accumulation net's micro-batches one
    after the other in two, interleaved in the third, 10.1 against 14.2 MiB): the step is planned
    in the order that needs the most by the executor model, whichever step traced it."""
    from types import SimpleNamespace

    from lmscli.api import _in_the_worst_order

    prepared = api.prepare(api.load(str(SAMPLES / "cnn.meta")))
    sched, view = prepared.schedule, prepared.view
    index = {name: k for k, name in enumerate(sched.names)}
    updates = [k for k, op in enumerate(sched.ops) if op.startswith(ordering.TRAINING_OPS)]
    late = [sched.names[k] for k in range(len(sched)) if k not in set(updates)] + [sched.names[k] for k in updates]
    late = [sched.names[k] for k in _an_order(sched, view, [index[n] for n in late], index)]
    early = list(sched.names)
    needs = {}
    for first in (early, late):
        seen = SimpleNamespace(order=tuple(first), orders=(tuple(late if first is early else early),), scratch={},
                               micros={}, scratch_first=frozenset())
        chosen = _in_the_worst_order(prepared, seen)
        needs[len(needs)] = simulate(chosen.schedule).peak_bytes
        assert chosen.observed_order == tuple(late)
    assert needs[0] == needs[1] > simulate(prepared.observed(early).schedule).peak_bytes


def test_a_chain_whose_first_op_depends_on_the_next_is_left_out_of_the_plan():
    """A control edge from an op to one it depends on closes a cycle: :func:`ordering.applied`
    leaves such a pair out of the order, and :func:`ordering.feasible` out of the chains a plan
    keeps (emitted, it would make the rewrite invalid). A chain is split at the pair left out."""
    prepared = api.prepare(api.load(str(SAMPLES / "cnn.meta")))
    sched, view = prepared.schedule, prepared.view
    index = {name: k for k, name in enumerate(sched.names)}
    # a producer and a consumer of its output, and two later ops that depend on neither
    t = next(t for t in sched.tensors if t.consumers and t.consumers[0] > t.producer + 3)
    producer, consumer = sched.names[t.producer], sched.names[t.consumers[0]]
    free = [name for k, name in enumerate(sched.names) if k > t.consumers[0]
            and not {sched.nodes[t.producer], sched.nodes[t.consumers[0]]} & view.ancestors([sched.nodes[k]])][:2]
    assert len(free) == 2
    chains = ((consumer, producer), (free[0], free[1]), (free[0], consumer, producer, free[1]))
    kept = ordering.feasible(sched, chains, view)
    assert kept == ((free[0], free[1]), (free[0], consumer), (producer, free[1]))
    assert ordering.applied(sched, kept, view).names == ordering.applied(sched, chains, view).names
    assert ordering.feasible(sched, kept, view) == kept
    assert index[producer] < index[consumer]


@pytest.mark.parametrize("reordered_closest", [105_000, 150_000])
def test_a_no_plan_answer_gives_the_closer_of_the_two_orders(monkeypatch, reordered_closest):
    """When the reordered search fails too, the answer whose closest judged plan came nearer the
    budget is given (QA r54: the towers' answer said 1.41x, from the step's order, where with ops
    reordered a plan needed 1.02x)."""
    from lmscli.errors import NoFitError
    from lmscli.plan import planner, tuning

    def no_plan(prepared, device, options, *args, **kwargs):
        exc = NoFitError("planned for the graph as written, but ...; try it", budget_bytes=100_000)
        exc.closest_bytes = reordered_closest if options.reorder else 141_000
        raise exc

    monkeypatch.setattr(tuning, "checked_tune", no_plan)
    monkeypatch.setattr(planner, "_moves", lambda *args: ((("a", "b"),), None, 0, 0, 0))
    prepared = api.prepare(api.load(str(SAMPLES / "mlp.meta")))
    with pytest.raises(NoFitError) as caught:
        tuning.tune(prepared, api.make_device(gpu_mem=100_000, reserve=0.0), api.TuneOptions(strategy="recompute"))
    reordered = reordered_closest < 141_000
    assert caught.value.closest_bytes == min(reordered_closest, 141_000)
    assert str(caught.value).startswith("no plan passed the judge in the step's order, nor with ops reordered") == reordered
    assert caught.value.to_dict()["closest_bytes"] == caught.value.closest_bytes
