"""The stand-in GPU: a hard memory limit in a separate TensorFlow process (lmscli.prove.standin).

The toy step keeps three 30 MiB tensors live at once: ``a = tile(x)``, ``b = reverse(a)``,
``c = reverse(b)``, then the far consumer ``m = a * c`` (and a small trained variable that needs
``sum(m)``). Measured here: it needs 91 MiB on the stand-in; with ``a`` swapped to the host 61 MiB.

The hand-made swap is the pair lms emits: ``a-lms-swapout-0`` (Identity on ``/device:CPU:0`` reading
``a``), ``a-lms-swapin-0-0`` (Identity on ``/device:CPU:0`` reading the swap-out, with a control edge
from ``c``, the op just before the far consumer) rewired into ``m``, and a waiter (a control edge
from the swap-out to ``c``) so that ``c`` allocates only after ``a`` has left. Without the waiter
the transfer was still under way when ``c`` allocated, and the pair saved nothing (3 runs of 3).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lmscli.prove import steps
from lmscli.errors import LmsError
from lmscli.prove.standin import HOST_DEVICE, MIB, StandIn
from lmscli.tfimport import tensorflow
from tests.conftest import ROOT

TENSOR_MIB = 30
SWAPPED = {"a-lms-swapout-0", "a-lms-swapin-0-0"}


def toy(swap: str | None = None):
    """The toy's MetaGraphDef; ``swap``: None, "ok" (the lms pair and its waiter), "colocated" (the
    same pair carrying ``_class: loc:@a``, which TensorFlow's importer obeys by moving the swap
    nodes next to ``a``: a classic rewriting bug) or "grappler" (the pair as Grappler's memory
    optimizer writes it: its GPU-only copy kernels, both on the GPU)."""
    tf = tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        cols = 1024
        x = v1.placeholder(tf.float32, [1, cols], name="x")
        a = tf.tile(x, [TENSOR_MIB * MIB // (4 * cols), 1], name="a")
        b = tf.reverse(a, [0], name="b")
        c = tf.reverse(b, [1], name="c")
        s = tf.reduce_sum(tf.multiply(a, c, name="m"), name="s")
        w = v1.get_variable("w", [cols], initializer=v1.ones_initializer(), use_resource=True)
        loss = tf.reduce_mean(tf.square(w - tf.stop_gradient(s) * 1e-7), name="loss")
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        v1.add_to_collection("train_op", train)
        meta = v1.train.export_meta_graph(graph=graph)
    if swap:
        _swap_a(meta, swap)
    return meta


def _swap_a(meta, variant: str) -> None:
    from tensorflow.core.framework import attr_value_pb2

    nodes = {node.name: node for node in meta.graph_def.node}
    dtype = nodes["a"].attr["T"].type
    grappler = variant == "grappler"
    device = "/device:GPU:0" if grappler else "/device:CPU:0"
    out = meta.graph_def.node.add(name="a-lms-swapout-0", op="_CopyFromGpuToHost" if grappler else "Identity",
                                  device=device, input=["a"])
    back = meta.graph_def.node.add(name="a-lms-swapin-0-0", op="_CopyFromHostToGpu" if grappler else "Identity",
                                   device=device, input=["a-lms-swapout-0", "^c"])
    for node in (out, back):
        node.attr["T"].type = dtype
        node.attr["_grappler_do_not_remove"].b = True
        if variant == "colocated":
            node.attr["_class"].CopyFrom(attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(s=[b"loc:@a"])))
    nodes["c"].input.append("^a-lms-swapout-0")
    m = nodes["m"]
    m.input[list(m.input).index("a")] = "a-lms-swapin-0-0"


@pytest.fixture(scope="module")
def standin():
    with StandIn() as s:
        yield s


@pytest.fixture(scope="module")
def reference(standin):
    """The original toy without a limit."""
    verdict = standin.run(toy(), ["train"], None, runs=1)
    assert verdict.fits and verdict.result.losses
    return verdict.result


@pytest.fixture(scope="module")
def original_at_75(standin):
    return standin.run(toy(), ["train"], 75 * MIB)


@pytest.mark.slow
def test_out_of_memory_below_need_fits_above(standin, reference, original_at_75):
    verdict = original_at_75
    assert not verdict.fits and verdict.failures == 1 and verdict.runs == 1 and verdict.result is None
    assert verdict.limit_bytes == 75 * MIB
    assert verdict.oom_node == "c"  # the third 30 MiB tensor
    assert "75 MiB" in verdict.message and "30.00 MiB" in verdict.message and "\n" not in verdict.message
    roomy = standin.run(toy(), ["train"], 120 * MIB)
    assert roomy.fits and roomy.runs == 3 and roomy.failures == 0 and not roomy.varies
    assert roomy.oom_node is None and roomy.message is None and roomy.results_differ is None
    assert steps.compare(roomy.result, reference) is None


@pytest.mark.slow
def test_swap_fits_where_original_runs_out_and_is_bit_identical(standin, reference, original_at_75):
    swapped = standin.run(toy("ok"), ["train"], 75 * MIB)
    assert not original_at_75.fits
    assert swapped.fits and swapped.runs == 3 and swapped.failures == 0 and swapped.results_differ is None
    assert steps.compare(swapped.result, reference) is None
    assert {name: HOST_DEVICE for name in SWAPPED} == swapped.result.placements


@pytest.mark.slow
def test_grappler_swap_kernels_move_the_tensor_out(standin, reference):
    """Grappler's swap-out kernel's output lives in host memory: it runs as Identity on the host."""
    swapped = standin.run(toy("grappler"), ["train"], 75 * MIB, runs=1)
    assert swapped.fits and steps.compare(swapped.result, reference) is None
    assert swapped.result.placements["a-lms-swapout-0"] == HOST_DEVICE
    assert swapped.result.placements["a-lms-swapin-0-0"] != HOST_DEVICE


@pytest.mark.slow
def test_broken_swap_saves_nothing(standin):
    """Swap nodes colocated with ``a`` are moved onto the stand-in: no transfer, no saving."""
    broken = standin.run(toy("colocated"), ["train"], 75 * MIB)
    assert not broken.fits and broken.oom_node == "c"


def test_an_out_of_memory_line_says_when_the_free_memory_was_in_pieces():
    """In use plus the request under the limit: the allocator had the bytes, not one chunk of them."""
    from lmscli.prove.standin import _oom_message

    line = "ran out of memory trying to allocate 4.50 MiB for c2/Conv2D with 7.06 MiB in use"
    apart = _oom_message(line, "running the step", 14 * MIB, "c2/Conv2D", int(11.56 * MIB))
    assert apart.startswith("out of memory under 14 MiB while running the step: allocating 4.50 MiB for c2/Conv2D "
                            "failed (7.06 MiB in use): in use and asked for come to 11.56 MiB, 2.44 MiB under the "
                            "limit, but no free chunk")
    full = _oom_message(line, "running the step", 10 * MIB, "c2/Conv2D", int(11.56 * MIB))
    assert _oom_message(line, "running the step", int(11.7 * MIB), None, int(11.56 * MIB)).endswith("in use)")
    assert full.endswith("failed (7.06 MiB in use)") and _oom_message(line, "running the step", 14 * MIB, None) \
        .endswith("in use)")
    assert "allocating 48.00 KiB for c2/Conv2D failed" in _oom_message(  # (in lms's units, not TensorFlow's "48.0KiB")
        "ran out of memory trying to allocate 48.0KiB", "running the step", 10 * MIB, "c2/Conv2D")
    # A node TensorFlow added where it split the graph between the processes is named by its source
    for added in ("update/truediv_1_S24", "_send_update/truediv_1_S24_0", "update/truediv_1/_332_S96"):
        assert ("allocating 4.50 MiB for a transfer between the processes (a node TensorFlow named after "
                "update/truediv_1) failed") in _oom_message(
            line, "running the step", 10 * MIB, added), added


def test_variables_are_read_after_the_steps_a_few_at_a_time():
    """A read can copy its variable under the limit, so the check reads them in runs of at most
    READ_GROUP_BYTES (a larger one, or one of unknown size, alone), in order, each once."""
    from lmscli.prove.standin import READ_GROUP_BYTES, read_groups

    tf = tensorflow()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        sizes = {"a": [1000], "b": [2000], "table": [1 << 20], "c": [10], "d": [None, 4], "e": [3]}
        names = tuple(f"{n}:0" for n in sizes)
        variables = [v1.placeholder(tf.float32, shape, name=n) for n, shape in sizes.items()]
    groups = read_groups(names, variables)
    assert [n for g in groups for n in g[0]] == list(names)
    assert [len(g[0]) == len(g[1]) for g in groups] == [True] * len(groups)
    assert [g[0] for g in groups] == [("a:0", "b:0"), ("table:0",), ("c:0",), ("d:0",), ("e:0",)]
    assert read_groups(names[:4], variables[:4], cap=1 << 30) == [(names[:4], variables[:4])]
    assert READ_GROUP_BYTES >= 1 << 20


@pytest.mark.slow
def test_find_min_is_the_threshold(standin):
    meta = toy()
    found = standin.find_min(meta, ["train"])
    limit = found.limit_bytes
    assert limit % MIB == 0 and 3 * TENSOR_MIB * MIB < limit <= (3 * TENSOR_MIB + 6) * MIB
    assert found.probes[-1] == (limit, True) and any(not fits for _, fits in found.probes)
    assert standin.run(meta, ["train"], limit, runs=1).fits
    below = standin.run(meta, ["train"], limit - MIB, runs=1)
    assert not below.fits and below.oom_node


@pytest.mark.slow
def test_no_server_survives_the_context():
    with pytest.raises(RuntimeError, match="left the context"):
        with StandIn() as s:
            assert s.run(toy(), ["train"], 120 * MIB, runs=2).fits
            pids = s.pids
            raise RuntimeError("left the context by an error")
    assert len(pids) == 5  # the zygote and two pairs of servers
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_no_server_survives_a_killed_client(tmp_path):
    """The client dies (SIGKILL) in the middle of a step: the zygote sees its stdin close and the
    servers die with the zygote."""
    script = textwrap.dedent("""
        import sys, threading, time
        from lmscli.prove.standin import StandIn
        from lmscli.tfimport import tensorflow
        tf = tensorflow()
        g = tf.Graph()
        with g.as_default():
            queue = tf.queue.FIFOQueue(1, tf.float32)
            tf.identity(queue.dequeue(), name="wait")  # blocks forever
            meta = tf.compat.v1.train.export_meta_graph(graph=g)
        s = StandIn(log_dir=sys.argv[1])  # a killed client cannot remove a temporary directory
        threading.Thread(target=s.run, args=(meta, ["wait"], 100 << 20), daemon=True).start()
        while len(s.pids) < 3:
            time.sleep(0.05)
        print(*s.pids, flush=True)
        time.sleep(600)
    """)
    client = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert select.select([client.stdout], [], [], 60)[0], "the client printed no pids within 60 s"
        pids = [int(p) for p in client.stdout.readline().split()]
        assert len(pids) == 3 and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


@pytest.mark.slow
def test_a_graph_failing_for_another_reason_raises_one_line(standin):
    tf = tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        tf.debugging.check_numerics(tf.math.log(-tf.abs(x) - 1.0), "negative log", name="checked")
        meta = tf.compat.v1.train.export_meta_graph(graph=graph)
    with pytest.raises(LmsError) as info:
        standin.run(meta, ["checked"], 100 * MIB, runs=1)
    message = str(info.value)
    assert "\n" not in message and "negative log" in message


def test_an_op_without_a_cpu_kernel_raises_one_line():
    meta = toy()
    meta.graph_def.node.add(name="gpu_only", op="_CopyFromHostToGpu_NotAnOp", input=["x"])
    with pytest.raises(LmsError) as info, StandIn() as s:
        s.run(meta, ["train"], 100 * MIB)
    assert "\n" not in str(info.value) and "_CopyFromHostToGpu_NotAnOp" in str(info.value)


def test_a_dilated_convolution_the_stand_in_cannot_run_is_refused_before_any_run(tmp_path):
    """QA r47: TensorFlow's CPU kernels without oneDNN (the stand-in's) have no dilated Conv2D
    gradients; a WaveNet with ``conv1d(dilations=...)`` ran 18 s before failing in one. It is
    refused at once, with the op and what to do."""
    from lmscli import api
    from lmscli.errors import InputError
    from tests.conftest import v1_training_graph

    path = tmp_path / "dilated.meta"
    with v1_training_graph(path) as (tf, v1, graph):
        x = v1.placeholder(tf.float32, [2, 64, 8], name="x")
        y = tf.nn.conv1d(x, v1.get_variable("w", [2, 8, 8]), 1, "VALID", dilations=2)
        graph.loss = tf.reduce_mean(tf.square(y))
    model = api.load(str(path))
    with StandIn() as fresh:
        with pytest.raises(InputError, match=r"cannot run .*Conv2DBackprop\w+ with dilation rates \[1, 1, 2, 1\]"):
            fresh.run(model.meta_graph, model.fetches, None, runs=1)
        assert not fresh.pids  # (refused before any process started)


def test_a_file_in_the_working_directory_named_like_a_standard_module_does_not_stop_the_stand_in(tmp_path,
                                                                                                  monkeypatch):
    """The stand-in's processes are started with ``python -P -m``: the working directory is not put
    first on their import path, where a user's ``bisect.py`` stood in for the standard library's
    and the zygote died (QA r49 P5), its error only "Traceback (most recent call last):"."""
    from lmscli.prove.standin import _last_line

    (tmp_path / "bisect.py").write_text("raise RuntimeError('not the standard bisect')\n")
    monkeypatch.chdir(tmp_path)
    with StandIn() as s:
        assert s is not None
    log = tmp_path / "zygote.log"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    import bisect\n"
                   "RuntimeError: not the standard bisect\n")
    assert _last_line(str(log)) == "RuntimeError: not the standard bisect"
