"""Gradient stacks of v1 while loops kept on the host (lmscli.plan.hoststacks).

``stack_rnn.meta`` is a tanh RNN over 128 steps whose gradient stacks (each step's hidden state,
kept by two stacks that share its buffer, and each step's input) are most of the peak: no swap
plan reaches below them, keeping them on the host does, and the rewrite trains bit for bit as the
original, under a hard limit where the original runs out of memory.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmscli import api
from lmscli.plan import hoststacks
from lmscli.plan import optguard
from lmscli.errors import PlanError
from lmscli.plan.document import Plan, PlannedHostStack
from lmscli.model.schedule import Schedule, SimTensor
from lmscli.model.simulator import simulate
from tests.conftest import invoke, stacked_tf2_rnn, v1_training_graph
from tests.test_control_flow import _lstm_loop


@pytest.fixture(scope="module")
def stack_rnn(samples):
    model = api.load(str(samples / "stack_rnn.meta"))
    return model, api.prepare(model)


def _plain_bound(prepared) -> int:
    """The lower bound of plans that only swap (every stack stays on the GPU)."""
    from lmscli.analysis import lower_bound
    from lmscli.plan.candidates import candidates

    cands = candidates(prepared.view, prepared.schedule, untaken=prepared.untaken, fused=prepared.fused)
    return lower_bound(prepared, set(cands))[0]


def test_the_peak_is_the_loops_gradient_stacks(stack_rnn):
    _model, prepared = stack_rnn
    a = api.analyze(prepared)
    units = hoststacks.hostable(prepared.view)
    # The hidden state is pushed on two stacks (as tanh's output and as the next step's input):
    # one buffer, so the two move together or not at all.
    assert any(len(h.stacks) == 2 and h.copy_bytes == 2 * h.num_bytes for h in units)
    assert a.host_stacks == sum(len(h.stacks) for h in units) >= 3
    assert a.peak_in_host_stacks >= 0.8 * a.peak_in_loops > 0
    assert a.lower_bound_bytes < 0.5 * a.peak_bytes < _plain_bound(prepared)


def test_below_what_swaps_reach_the_stacks_go_to_the_host(stack_rnn, runner, tmp_path):
    model, prepared = stack_rnn
    budget = (api.analyze(prepared).lower_bound_bytes + _plain_bound(prepared)) // 2
    result = api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0))
    plan = result.plan
    assert result.fits and plan.host_stacks
    assert plan.predicted["run_peak_bytes"] <= budget and plan.predicted["stack_copy_bytes"] > 0
    # A unit moves whole, and the plan reads back as written and replays to the same figures.
    units = {prepared.view.index[h.stack] for h in plan.host_stacks}
    for h in hoststacks.hostable(prepared.view):
        assert set(h.stacks) <= units or not set(h.stacks) & units
    # The report names what is live at the peak on the schedule the plan was simulated on (QA:
    # names were shifted, and moved stacks listed).
    from lmscli.report.terminal import plan_details

    top = plan_details(prepared, result)["top_live_at_peak"]
    moved_pushes = {op for h in plan.host_stacks for op in h.ops if "StackPush" in op}
    assert top and not any(row["name"].split(" ")[0] in moved_pushes for row in top)
    _sizes_match(prepared.view, top)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert api.replay(prepared, again).result.peak_bytes == result.result.peak_bytes
    # The rewrite moves the stack ops to the host, runs the loops one iteration at a time, and
    # changes nothing else.
    meta, report = api.rewrite(prepared, plan)
    assert report.host_stacks == len(plan.host_stacks) and not report.added_nodes
    assert plan.serial_loops and report.serial_loops == len(plan.serial_loops)
    moved = {h.stack for h in plan.host_stacks} | {op for h in plan.host_stacks for op in h.ops}
    before = {n.name: n for n in model.meta_graph.graph_def.node}
    for node in meta.graph_def.node:
        if node.name in moved:
            assert node.device == "/device:CPU:0" and "_class" not in node.attr
        elif node.op == "Enter":
            assert node.attr["parallel_iterations"].i == 1
            node.attr["parallel_iterations"].i = before[node.name].attr["parallel_iterations"].i
            assert node == before[node.name]
        else:
            assert node == before[node.name]
    # ... and trains bit-identically (lms verify, in-process).
    out = tmp_path / "hosted.meta"
    done = invoke(runner, "rewrite", model.path, out, "--plan", _write(tmp_path / "plan.json", plan.to_json()),
                  "--json")
    assert done.exit_code == 0, done.output
    checked = invoke(runner, "verify", model.path, out, "--json")
    assert checked.exit_code == 0 and json.loads(checked.stdout)["identical"] is True


def _write(path, text: str):
    path.write_text(text)
    return path


def test_recomputation_only_keeps_every_stack_on_the_gpu(stack_rnn):
    """QA: ``--strategy recompute`` put a GRU's stacks on the host; it promises recomputation only
    (nothing in host memory). At a budget only hosting reaches, it has no plan."""
    _model, prepared = stack_rnn
    budget = (api.analyze(prepared).lower_bound_bytes + _plain_bound(prepared)) // 2
    with pytest.raises(api.NoFitError) as caught:
        api.tune(prepared, api.make_device(gpu_mem=budget, reserve=0.0), api.TuneOptions(strategy="recompute"))
    # (the stacks are what it cannot make again; "cannot be swapped" read as if nothing could host
    # them, QA r49 P8)
    assert "cannot be made again (this strategy moves nothing to the host)" in str(caught.value)


def test_plans_naming_stacks_wrongly_are_refused(stack_rnn):
    _model, prepared = stack_rnn
    view = prepared.view
    pair = next(h for h in hoststacks.hostable(view) if len(h.stacks) == 2)
    half = PlannedHostStack(view.names[pair.stacks[0]], (), 0, 128)
    with pytest.raises(PlanError, match="must move together"):
        hoststacks.named(view, [half])
    with pytest.raises(PlanError, match="not a gradient stack"):
        hoststacks.named(view, [PlannedHostStack("loss", (), 0, 1)])
    plan = api.replay(prepared, _empty_plan(prepared)).plan
    with pytest.raises(PlanError, match="not an op of that stack"):
        api.rewrite(prepared, replace(plan, host_stacks=(PlannedHostStack(half.stack, ("loss",), 0, 128),)))


def _empty_plan(prepared) -> Plan:
    from lmscli.plan.document import graph_fingerprint

    return Plan(model=prepared.model.name, graph_sha256=graph_fingerprint(prepared.graph_def),
                fetches=tuple(prepared.model.fetches), batch_size=None, device={}, strategy="swap", parameters={},
                swaps=())


def test_the_guard_names_a_stack_whose_move_changes_grapplers_work():
    plan = replace(_bare(), host_stacks=(PlannedHostStack("s", ("push", "pop"), 10, 4),
                                         PlannedHostStack("t", ("push2",), 10, 4)))
    tensors, _ops = optguard.culprits(plan, frozenset({"pop"}))
    assert tensors == ("s",)
    assert [h.stack for h in optguard.without(plan, tensors, ()).host_stacks] == ["t"]


def test_a_swap_its_waiter_alone_involves_gives_up_the_waiter_not_the_tensor():
    """A control input from a swap-out into a waiter can change Grappler's optimizations near that
    waiter (a TensorFlow 2 step's stand-in plan: both its swaps were left out, and no plan found at
    60 MiB where one trains); asked, the guard names the waiter, and the planner picks another."""
    from lmscli.plan.document import PlannedSwap, PlannedSwapIn

    swap = PlannedSwap("a:0", 8, (), (PlannedSwapIn(("c",), "t"),), waiters=("w",))
    plan = replace(_bare(), swaps=(swap, replace(swap, tensor="b:0", waiters=("c",))))
    waiters: set = set()
    assert optguard.culprits(plan, frozenset({"w"}), waiters) == ((), ()) and waiters == {"w"}
    assert optguard.culprits(plan, frozenset({"w"})) == (("a:0",), ())  # (not asked: the tensor)
    waiters = set()  # an op that also reads the swap-in: the tensor is the culprit
    assert optguard.culprits(plan, frozenset({"c"}), waiters) == (("a:0", "b:0"), ()) and not waiters


def _bare() -> Plan:
    return Plan(model="m", graph_sha256="0", fetches=(), batch_size=None, device={}, strategy="swap", parameters={},
                swaps=())


def test_copies_beyond_the_loops_compute_delay_the_step():
    """Two ops of 10 us; the loop's copies take 1000 bytes at 1e6 bytes/s = 1000 us, of which the
    loop's compute hides 300: the op at position 1 ends 700 us late. On an infinite link, nothing."""
    tensors = (SimTensor(0, 0, 0, 100, (1,)),)
    s = Schedule(nodes=(0, 1), names=("a", "b"), ops=("Op", "Op"), levels=(0, 1), compute=(10, 10),
                 on_gpu=(True, True), tensors=tensors, inputs=((), (0,)), variable_bytes=0, constant_bytes=0,
                 stack_copies=((1, 1000, 300),), host_held=((0, 1, 1000),))
    assert simulate(s, link_bandwidth=1e6).step_time == pytest.approx(720e-6)
    assert simulate(s).step_time == pytest.approx(20e-6)
    assert simulate(s).host_peak_bytes == 1000 and simulate(s).stack_copy_bytes == 1000


@pytest.mark.slow
def test_an_lstm_as_dynamic_rnn_writes_it_fits_with_its_stacks_on_the_host(tmp_path):
    """dynamic_rnn's LSTM (gates saved per step): no swap plan goes below its stacks; a plan
    keeping them on the host fits, and the rewrite trains bit-identically."""
    source = str(_lstm_loop(tmp_path / "lstm.meta"))
    model = api.load(source)
    prepared = api.prepare(model)
    bound = api.analyze(prepared).lower_bound_bytes
    plain = _plain_bound(prepared)
    assert bound < plain
    result = api.tune(prepared, api.make_device(gpu_mem=(bound + plain) // 2, reserve=0.0))
    assert result.fits and result.plan.host_stacks
    meta, _ = api.rewrite(prepared, result.plan)
    out = tmp_path / "lstm.lms.meta"
    api.save(model, meta, str(out))
    from click.testing import CliRunner

    checked = invoke(CliRunner(), "verify", source, out, "--json")
    assert checked.exit_code == 0 and json.loads(checked.stdout)["identical"] is True, checked.output


@pytest.mark.slow
def test_stacks_on_the_host_are_proven_under_a_hard_limit(samples, tmp_path):
    """`lms rewrite --stand-in --gpu-mem 10MiB`, then `lms verify --gpu-mem 10MiB`: the original
    runs out of memory on the stand-in (it needs 14 MiB there), the rewrite trains, bit-identical."""
    from click.testing import CliRunner

    runner = CliRunner()
    source, out = samples / "stack_rnn.meta", tmp_path / "stack_rnn.lms.meta"
    done = invoke(runner, "rewrite", source, out, "--gpu-mem", "10MiB", "--stand-in", "--judge-runs", "2", "--json")
    assert done.exit_code == 0, done.output
    plan = json.loads(done.stdout)["plan"]
    assert plan["host_stacks"] and plan["predicted"]["stand_in"]["fits"]
    checked = invoke(runner, "verify", source, out, "--gpu-mem", "10MiB", "--json")
    proof = json.loads(checked.stdout)["limit"]
    assert checked.exit_code == 0 and proof["proven"], proof
    assert not proof["original"]["fits"] and proof["rewritten"]["fits"] and proof["identical"] is True


def _gated_loop(path, batch=16, steps=24, hidden=64):
    """A hand-written loop (``h = tanh(z) * sigmoid(z + 1)``, one iteration at a time) whose
    gradient keeps four stacks; in Grappler's order of the body, some stacks are pushed after
    others are popped."""
    with v1_training_graph(path) as (tf, v1, graph):
        x = v1.placeholder(tf.float32, [steps, batch, hidden], name="x")
        y = v1.placeholder(tf.float32, [batch, hidden], name="y")
        init = v1.glorot_uniform_initializer(seed=4)
        w = v1.get_variable("W", [hidden, hidden], initializer=init, use_resource=True)
        u = v1.get_variable("U", [hidden, hidden], initializer=init, use_resource=True)

        def body(i, h):
            z = tf.matmul(h, w) + tf.matmul(x[i], u)
            return i + 1, tf.tanh(z) * tf.sigmoid(z + 1.0)

        _, h = v1.while_loop(lambda i, h: i < steps, body, [tf.constant(0), tf.zeros([batch, hidden])],
                             parallel_iterations=1)
        graph.loss = tf.reduce_mean(tf.square(h - y))
    return path


def test_every_stack_of_a_loop_is_full_when_the_loop_ends(tmp_path):
    """The schedule runs a loop body once, and Grappler's order may pop one stack before it pushes
    another; a real step holds them all at once when the forward loop ends (QA: a loop's 20 MiB of
    stacks counted as 10, and a GPU plan that fitted by that count needed 12 MiB where 7 were
    predicted). Each stack is held at least to the end of its loop, so all count at the peak."""
    prepared = api.prepare(api.load(str(_gated_loop(tmp_path / "gated.meta"))))
    a = api.analyze(prepared)
    assert a.host_stacks >= 3
    assert a.peak_in_host_stacks == a.host_stack_bytes
    # With some stacks on the host, the report's live tensors are those of the plan's own schedule.
    from lmscli.report.terminal import plan_details

    result = api.tune(prepared, api.make_device(gpu_mem=(a.lower_bound_bytes + _plain_bound(prepared)) // 2,
                                                reserve=0.0))
    moved = {op for h in result.plan.host_stacks for op in h.ops}
    top = plan_details(prepared, result)["top_live_at_peak"]
    assert moved and top and not any(row["name"].split(" ")[0] in moved for row in top)
    _sizes_match(prepared.view, top)


def _sizes_match(view, top) -> None:
    """Each tensor a report names has its own size (allocations are rounded up to 256 B)."""
    for row in top:
        if ":" in row["name"] and "kept across" not in row["name"]:
            node, output = row["name"].rsplit(":", 1)
            assert row["bytes"] == -(-view.tensor_bytes(view.index[node], int(output)) // 256) * 256, row


def test_a_stack_popped_in_a_cond_inside_the_loop_stays_on_the_gpu(tmp_path):
    """A v1 cond inside a loop body: the gradient pops the values its branch saved through an
    ``Enter`` and a ``Switch`` colocated with the forward value; moved with the stack to the host,
    they were placed against that colocation and TensorFlow refused the rewrite (QA: exit 0 from
    ``lms rewrite``, then "Cannot colocate nodes" in verify). Those stacks stay; the others move,
    and the rewrite trains bit-identically."""
    from lmscli.prove import steps

    path = tmp_path / "cond_loop.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        x = v1.placeholder(tf.float32, [24, 16, 64], name="x")
        y = v1.placeholder(tf.float32, [16, 64], name="y")
        init = v1.glorot_uniform_initializer(seed=4)
        w = v1.get_variable("W", [64, 64], initializer=init, use_resource=True)

        def body(i, h):
            z = tf.tanh(tf.matmul(h, w) + x[i])
            return i + 1, v1.cond(tf.equal(i % 3, 0), lambda: tf.sigmoid(z) * z, lambda: z * 0.9)

        _, h = v1.while_loop(lambda i, h: i < 24, body, [tf.constant(0), tf.zeros([16, 64])],
                             parallel_iterations=1)
        graph.loss = tf.reduce_mean(tf.square(h - y))
    model = api.load(str(path))
    prepared = api.prepare(model)
    view = prepared.view
    in_cond = [s for s in range(view.size) if view.ops[s] == "StackV2"
               and any(view.ops[p] == "Switch" for p in hoststacks.handle_path(view, s)[1])]
    assert in_cond, "the cond's gradient keeps no stack"
    units = hoststacks.hostable(view)
    assert units and not {s for u in units for s in u.stacks} & set(in_cond)
    a = api.analyze(prepared)
    result = api.tune(prepared, api.make_device(gpu_mem=(a.lower_bound_bytes + a.peak_bytes) // 2, reserve=0.0))
    assert result.plan.host_stacks
    rewritten, _ = api.rewrite(prepared, result.plan)
    before = steps.run_steps(model.meta_graph, model.fetches, steps=2)
    assert steps.first_difference(before, steps.run_steps(rewritten, model.fetches, steps=2)) is None


# ---------------------------------------------------------------------------- TensorFlow 2 loops
def _v2_lstm(path, batch=32, steps=48, hidden=192, features=32):
    """An LSTM over 48 steps as ``tf.while_loop`` writes it with control flow v2 in a v1 graph (as a
    tf_keras LSTM is built): a functional While, which lms lowers; the gradient keeps each step's
    gates and states in TensorList accumulators, pushed in the forward loop and popped in the
    gradient loop. 18 MiB on the stand-in, most of it those accumulators."""
    with v1_training_graph(path, control_flow_v2=True) as (tf, v1, graph):
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [batch, steps, features], name="inputs")
        y = v1.placeholder(tf.float32, [batch, 8], name="labels")
        init = v1.glorot_uniform_initializer(seed=1)
        kernel = v1.get_variable("kernel", [features + hidden, 4 * hidden], initializer=init, use_resource=True)
        bias = v1.get_variable("bias", [4 * hidden], initializer=v1.zeros_initializer(), use_resource=True)
        xs = tf.TensorArray(tf.float32, size=steps).unstack(tf.transpose(x, [1, 0, 2]))

        def body(t, c, h):
            gates = tf.matmul(tf.concat([xs.read(t), h], 1), kernel) + bias
            i, j, f, o = tf.split(gates, 4, axis=1)
            c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(j)
            return t + 1, c, tf.sigmoid(o) * tf.tanh(c)

        zeros = tf.zeros([batch, hidden])
        _, _, h = tf.while_loop(lambda t, *_: t < steps, body, [tf.constant(0), zeros, zeros])
        w = v1.get_variable("w", [hidden, 8], initializer=init, use_resource=True)
        graph.loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - y))
    return path


@pytest.fixture(scope="module")
def v2_lstm(tmp_path_factory):
    return _v2_lstm(tmp_path_factory.mktemp("v2_lstm") / "lstm.meta")


def test_a_tf2_loops_accumulators_move_to_the_host_whole(v2_lstm):
    """Each TensorList accumulator is a unit with every op its list passes through (the loops'
    Enter, Merge, Switch, NextIteration and Exit; a list changes device only as a whole copy), and
    the step's tensors all have sizes (QA: a tf_keras LSTM's gradient loop had 48 of unknown size,
    and its accumulators were not hostable: no plan went below its need)."""
    prepared = api.prepare(api.load(str(v2_lstm)))
    view = prepared.view
    units = hoststacks.hostable(view)
    assert units and all(view.ops[s] in hoststacks.LIST_MAKERS for h in units for s in h.stacks)
    for h in units:
        moved = {view.ops[i] for i in h.users}
        assert moved <= hoststacks.LIST_USERS | hoststacks.PASS_THROUGH
        assert {"TensorListPushBack", "Enter", "Merge", "Switch", "NextIteration", "Exit"} <= moved
    assert any(view.ops[i] == "TensorListPopBack" for h in units for i in h.users)
    assert not [view.names[i] for i in prepared.schedule.nodes for t in view.outputs(i) if t.num_bytes is None]
    analysis = api.analyze(prepared)
    assert analysis.host_stacks == sum(len(h.stacks) for h in units) and analysis.peak_in_host_stacks > 0
    assert analysis.lower_bound_bytes < 0.5 * _plain_bound(prepared)


@pytest.mark.slow
def test_a_tf2_loops_accumulators_on_the_host_train_where_the_original_runs_out_of_memory(v2_lstm, tmp_path):
    """`lms rewrite --stand-in --gpu-mem 11MiB` (the original needs 18 MiB there), then `lms verify
    --gpu-mem 11MiB`: the lists live on the host, the original runs out of memory, the rewrite
    trains, bit-identical."""
    from click.testing import CliRunner

    runner = CliRunner()
    out = tmp_path / "lstm.lms.meta"
    done = invoke(runner, "rewrite", v2_lstm, out, "--gpu-mem", "11MiB", "--stand-in", "--judge-runs", "2", "--json")
    assert done.exit_code == 0, done.output
    plan = json.loads(done.stdout)["plan"]
    written = {node.name: node for node in api.load(str(out)).graph_def.node}
    assert plan["host_stacks"] and all(written[h["stack"]].op in hoststacks.LIST_MAKERS for h in plan["host_stacks"])
    for h in plan["host_stacks"]:
        assert h.get("dropped") or all("CPU" in written[name].device for name in (h["stack"], *h["ops"]))
    checked = invoke(runner, "verify", v2_lstm, out, "--gpu-mem", "11MiB", "--json")
    proof = json.loads(checked.stdout)["limit"]
    assert checked.exit_code == 0 and proof["proven"], proof
    assert not proof["original"]["fits"] and proof["rewritten"]["fits"] and proof["identical"] is True


def test_a_loops_ops_on_the_host_do_not_hold_what_the_gpu_keeps_for_it(v2_lstm):
    """What a loop keeps on the GPU is held to the loop's end on the GPU, not to the last of its ops
    anywhere: the Exit of a list a plan keeps on the host runs in the host's process, and a traced
    step listed one after the next loop and its gradient (QA r40's three-layer SimpleRNN: its
    plan predicted at 38 MiB, 22 planned; 29 when each loop ends on the GPU, and it needed 29)."""
    from lmscli.model.schedule import STORAGE_OUTPUT, _describe

    prepared = api.prepare(api.load(str(v2_lstm)))
    view, order = prepared.view, list(prepared.schedule.nodes)
    host = next(i for i in order if view.ops[i] == "Exit" and view.frames[i] and "grad" not in view.frames[i])
    order.remove(host)
    order.append(host)
    schedule = _describe(view, order, {i: 1 for i in order}, [i != host for i in order], prepared.schedule.device)
    stores = [t for t in schedule.tensors if t.output == STORAGE_OUTPUT and t.filled_in == view.frames[host]]
    assert stores and not any(len(order) - 1 in t.consumers for t in stores)


def test_each_list_of_the_graph_tensorflow_runs_keeps_its_own_pops(v2_lstm):
    """Grappler's optimizations make the loop's identical EmptyTensorList ops one; the lists are
    still values of their own, each popped by its own pops (QA: a tf_keras LSTM's 14 accumulators
    were each held until the last of all their pops, and the step's need predicted 14% high)."""
    from lmscli.analysis import run_graph, with_graph_def
    from lmscli.model.schedule import loop_storage

    prepared = api.prepare(api.load(str(v2_lstm)))
    seen = run_graph(prepared.model, with_graph_def(prepared.model.meta_graph, prepared.graph_def),
                     prepared.optimized, prepared.view.tensor_facts())
    makers = [n for n in seen.graph_def.node if n.op == "EmptyTensorList"]
    assert len(makers) < len([n for n in prepared.graph_def.node if n.op == "EmptyTensorList"])  # (made one)

    def pops(p):
        return {p.view.names[s.writer]: sorted(p.view.names[r] for r in s.readers)
                for s in loop_storage(p.view) if p.view.ops[s.writer] == "TensorListPushBack"}

    assert pops(seen) == pops(prepared) and all(len(r) <= 2 for r in pops(seen).values())


def _v2_sequence_rnn(path, batch=64, steps=48, hidden=256):
    """A recurrent net over 48 steps in TensorFlow 2's control flow (a functional While in a v1
    graph, as a tf_keras RNN is built) that reads its inputs from a list made whole before the loop
    (``TensorArray.unstack``: ``TensorListFromTensor``) and writes every step's state to another,
    stacked after it and read by the loss: its gradient is a third whole list
    (``TensorListFromTensor`` of the loss's gradient), which the gradient loop reads. Each list
    holds 48 buffers of 64 KiB. Needs 28 MiB on the stand-in (``lms measure``); predicted 26 when
    the lists counted for nothing, 31 with them (the list the gradient loop carries for the inputs'
    gradient, unread, was made while the loop's first ten iterations ran, when the model's stacks
    are still full)."""
    with v1_training_graph(path, control_flow_v2=True) as (tf, v1, graph):
        init = v1.glorot_uniform_initializer(seed=1)
        x = v1.placeholder(tf.float32, [batch, steps, hidden], name="inputs")
        y = v1.placeholder(tf.float32, [steps, batch, hidden], name="labels")
        u = v1.get_variable("u", [hidden, 2 * hidden], initializer=init, use_resource=True)
        xs = tf.TensorArray(tf.float32, size=steps).unstack(tf.transpose(x, [1, 0, 2]))

        def body(t, h, out):
            z, r = tf.split(tf.matmul(h, u), 2, axis=1)
            h = tf.sigmoid(z) * h + tf.tanh(xs.read(t) * tf.sigmoid(r))
            return t + 1, h, out.write(t, h)

        _, _, out = tf.while_loop(lambda t, *_: t < steps, body,
                                  [tf.constant(0), tf.zeros([batch, hidden]), tf.TensorArray(tf.float32, size=steps)])
        graph.loss = tf.reduce_mean(tf.square(out.stack() - y))
    return path


@pytest.fixture(scope="module")
def v2_sequence_rnn(tmp_path_factory):
    return _v2_sequence_rnn(tmp_path_factory.mktemp("v2_seq") / "rnn.meta")


def test_the_lists_a_tf2_loop_reads_whole_hold_every_element(v2_sequence_rnn):
    """The inputs' list and the list of the loss's gradient hold 48 buffers of 64 KiB each from
    the ``TensorListFromTensor`` that makes them to their last reader, through the loops that read
    them. An element the forward loop pushes for its gradient (the input it read) is the list's
    own buffer: no stack of its own, and the inputs' list is held until that element's pop in the
    gradient loop (QA: a tf_keras LSTM+GRU's plan was predicted at 10 MiB and needed 12; its
    lists were counted nowhere)."""
    from lmscli.analysis import run_graph, with_graph_def
    from lmscli.model.schedule import loop_storage

    prepared = api.prepare(api.load(str(v2_sequence_rnn)))
    for p in (prepared, run_graph(prepared.model, with_graph_def(prepared.model.meta_graph, prepared.graph_def),
                                  prepared.optimized, prepared.view.tensor_facts())):
        view = p.view
        kept = loop_storage(view)
        lists = {view.names[s.writer]: s for s in kept if view.ops[s.writer] == "TensorListFromTensor"}
        inputs = lists.pop("TensorArrayUnstack/TensorListFromTensor")
        (grads,) = lists.values()
        assert "gradients" in view.names[grads.writer] and {inputs.kind, grads.kind} == {"tensor list"}
        for s in (inputs, grads):
            assert (s.num_bytes, s.trips) == (48 * 64 * 1024, 48)
        assert "TensorListGetItem" in {view.ops[r] for r in grads.readers}
        assert any(view.ops[r] == "TensorListPopBack" and "while_grad" in view.names[r] for r in inputs.readers)
        assert "ZerosLike" in {view.ops[r] for r in inputs.readers}  # (the zeros of its gradient: made late)
        pushed = {view.names[view.data_inputs[s.writer][1][0]] for s in kept if s.kind == "stack"}
        assert pushed and not any(name.endswith("TensorListGetItem") for name in pushed)



def test_what_a_tf2_loop_writes_to_a_tensor_array_is_held_until_it_is_stacked(v2_sequence_rnn, tmp_path):
    """A TensorArray a TensorFlow 2 loop writes (``TensorListSetItem`` into a ``TensorListReserve``
    list) keeps each iteration's value until it is stacked after the loop: counted as the loop's
    storage, trips x value, unless a gradient stack keeps the value already (the sequence RNN's
    states: counted once, with their stack). Before, per-step outputs the gradient does not need
    (a projection of the state, as a decoder's logits) were counted for one iteration only."""
    from lmscli.model.schedule import loop_storage

    path = tmp_path / "proj.meta"
    with v1_training_graph(path, control_flow_v2=True) as (tf, v1, graph):
        init = v1.glorot_uniform_initializer(seed=1)
        y = v1.placeholder(tf.float32, [24, 16, 96], name="labels")
        u = v1.get_variable("u", [64, 64], initializer=init, use_resource=True)
        v = v1.get_variable("v", [64, 96], initializer=init, use_resource=True)

        def body(t, h, out):
            h = tf.tanh(tf.matmul(h, u))
            return t + 1, h, out.write(t, tf.matmul(h, v))

        start = v1.placeholder(tf.float32, [16, 64], name="start")
        _, _, out = tf.while_loop(lambda t, *_: t < 24, body,
                                  [tf.constant(0), start, tf.TensorArray(tf.float32, size=24)])
        graph.loss = tf.reduce_mean(tf.square(out.stack() - y))
    view = api.prepare(api.load(str(path))).view
    written = [s for s in loop_storage(view) if view.ops[s.writer] == "TensorListSetItem"]
    assert [(s.num_bytes, s.trips, s.kind) for s in written] == [(24 * 16 * 96 * 4, 24, "tensor list")]
    assert "TensorListStack" in {view.ops[r] for r in written[0].readers}
    view = api.prepare(api.load(str(v2_sequence_rnn))).view
    assert not [s for s in loop_storage(view) if view.ops[s.writer] == "TensorListSetItem"]


# ------------------------------------------------------- accumulators no op reads (tf_keras RNNs)
@pytest.fixture(scope="module")
def keras_rnn(tmp_path_factory):
    """Two tanh RNN layers over 32 steps as a tf_keras ``SimpleRNN`` stack builds them: each loop
    accumulates every intermediate of its cell, and the gradient pops only the state and the step
    counter. 8 MiB on the stand-in, 6 of it in the lists no op reads."""
    return stacked_tf2_rnn(tmp_path_factory.mktemp("keras_rnn") / "rnn.meta", batch=32, steps=32, units=192,
                           layers=2)


def test_the_accumulators_no_op_reads_are_found(keras_rnn):
    """Per layer, the lists of MatMul, BiasAdd, MatMul_1, add and the counter's add are never
    popped and every value they get has another reader: they are to be dropped. The lists the
    gradient pops (the state, the counter) are not; nor is a list whose Exit is fetched."""
    prepared = api.prepare(api.load(str(keras_rnn)))
    view = prepared.view
    units = hoststacks.hostable(view, keep=frozenset(prepared.model.fetches))
    dropped = [h for h in units if h.dropped]
    pushed = sorted(view.names[view.data_inputs[p][1][0]].rsplit("/", 1)[1] for h in dropped for p in h.pushes)
    assert pushed == sorted(2 * ["MatMul", "BiasAdd", "MatMul_1", "add", "add_2_0"])
    assert all(not h.pops for h in dropped) and all(h.pops for h in units if not h.dropped)
    analysis = api.analyze(prepared)
    assert analysis.unread_accumulators == 10 and analysis.unread_accumulator_bytes == 8 * 32 * 32 * 192 * 4 + 2 * 128
    exit_node = next(view.names[i] for i in dropped[0].users if view.ops[i] == "Exit")
    kept = hoststacks.hostable(view, keep=frozenset({exit_node}))
    assert not next(h for h in kept if h.stacks == dropped[0].stacks).dropped


def test_a_plan_may_not_drop_a_list_the_gradient_reads(keras_rnn):
    prepared = api.prepare(api.load(str(keras_rnn)))
    view = prepared.view
    popped = next(h for h in hoststacks.hostable(view) if h.pops)
    planned = [PlannedHostStack(view.names[s], (), 0, h.trips, dropped=True) for h in [popped] for s in h.stacks]
    with pytest.raises(PlanError, match="only accumulators no op reads can be dropped"):
        hoststacks.named(view, planned)
    unread = next(h for h in hoststacks.hostable(view) if h.dropped)  # (kept on the host instead: allowed)
    assert not hoststacks.named(view, [PlannedHostStack(view.names[unread.stacks[0]], (), 0, unread.trips)])[0].dropped


@pytest.mark.slow
def test_dropped_accumulators_train_under_a_limit_the_original_runs_out_of_memory_at(keras_rnn, runner, tmp_path):
    """`lms rewrite --stand-in --gpu-mem 6MiB`, then `lms verify --gpu-mem 6MiB`: the original
    needs 8 MiB on the stand-in and runs out of memory; the rewrite trains, bit-identically. Every
    list no op reads is in the plan as dropped (the optimizer guard let all of them through: it
    looks through the pushes taken out), and its pushes are Identities of the list in the
    rewritten graph, under their own names."""
    out = tmp_path / "rnn.lms.meta"
    done = invoke(runner, "rewrite", keras_rnn, out, "--gpu-mem", "6MiB", "--reserve", "0", "--stand-in", "--judge-runs", "2",
                  "--json")
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    dropped = [h for h in doc["plan"]["host_stacks"] if h.get("dropped")]
    assert len(dropped) == 10 == doc["dropped_accumulators"]
    assert "took out the pushes of 10 loop accumulator(s)" in doc["summary"]
    original = {node.name: node for node in api.load(str(keras_rnn)).graph_def.node}
    written = {node.name: node for node in api.load(str(out)).graph_def.node}
    for h in dropped:
        assert written[h["stack"]].op == "EmptyTensorList" and "CPU" not in written[h["stack"]].device
        for name in h["ops"]:
            if original[name].op == "TensorListPushBack":
                node = written[name]
                assert node.op == "Identity" and list(node.input) == list(original[name].input[:1])
    checked = invoke(runner, "verify", keras_rnn, out, "--gpu-mem", "6MiB", "--json")
    proof = json.loads(checked.stdout)["limit"]
    assert checked.exit_code == 0 and proof["proven"], proof
    assert not proof["original"]["fits"] and proof["rewritten"]["fits"] and proof["identical"] is True


def test_a_swap_its_trigger_alone_involves_is_a_culprit_only_without_others():
    """The nodes Grappler treats differently come with the nodes their inputs come from, and a
    swap-in's trigger among those is often a bystander (a transformer's attention probabilities
    were left unswapped beside a GELU product's swap): the swaps whose rewired edges are involved
    are the culprits; the one whose trigger alone is, only when no other is (the next round)."""
    from lmscli.plan.document import PlannedSwap, PlannedSwapIn

    edge = PlannedSwap("a:0", 8, (), (PlannedSwapIn(("c",), "t"),))
    bystander = PlannedSwap("b:0", 8, (), (PlannedSwapIn(("d",), "c"),))
    plan = replace(_bare(), swaps=(edge, bystander))
    assert optguard.culprits(plan, frozenset({"c"})) == (("a:0",), ())
    assert optguard.culprits(plan, frozenset({"c"}), set()) == (("a:0",), ())
    alone = replace(_bare(), swaps=(bystander,))
    assert optguard.culprits(alone, frozenset({"c"})) == (("b:0",), ())
