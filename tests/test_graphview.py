"""Property tests for the graph algorithms on random graphs."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmscli.errors import GraphError
from lmscli.graph.graphview import GraphView, gpu_key, parse_input
from tests.conftest import graph_def_from_nodes


def random_dag(seed: int, n: int, p: float):
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        inputs = []
        for j in range(i):
            if rng.random() < p:
                inputs.append(f"n{j}" if rng.random() < 0.8 else f"^n{j}")
        nodes.append((f"n{i}", "NoOp" if not inputs else "AddN", inputs, None))
    return nodes


def tflms_levels(view: GraphView):
    """Levels by repeatedly removing the ops with no remaining inputs (the TFLMS description)."""
    remaining = set(range(view.size))
    preds = {i: set(view.predecessors(i)) for i in remaining}
    level, out = 0, {}
    while remaining:
        layer = {i for i in remaining if not (preds[i] & remaining)}
        assert layer, "cycle"
        for i in layer:
            out[i] = level
        remaining -= layer
        level += 1
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40), st.floats(0.0, 0.5))
def test_levels_and_order(seed, n, p):
    view = GraphView(graph_def_from_nodes(random_dag(seed, n, p)))
    position = {node: k for k, node in enumerate(view.order)}
    assert sorted(view.order) == list(range(n))
    for i in range(n):
        for src in view.predecessors(i):
            assert position[src] < position[i]
            assert view.levels[src] < view.levels[i]
    expected = tflms_levels(view)
    assert [expected[i] for i in range(n)] == view.levels


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 30))
def test_order_independent_of_node_order(seed, n):
    nodes = random_dag(seed, n, 0.3)
    shuffled = list(nodes)
    random.Random(seed + 1).shuffle(shuffled)
    a, b = GraphView(graph_def_from_nodes(nodes)), GraphView(graph_def_from_nodes(shuffled))
    assert [a.names[i] for i in a.order] == [b.names[i] for i in b.order]
    assert {a.names[i]: a.levels[i] for i in range(n)} == {b.names[i]: b.levels[i] for i in range(n)}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 25))
def test_cycles_are_found(seed, n):
    nodes = random_dag(seed, n, 0.3)
    rng = random.Random(seed)
    a, b = sorted(rng.sample(range(n), 2))
    # Close a cycle: b reaches a, add a -> ... -> b path edge from b into a.
    nodes[a] = (nodes[a][0], "AddN", list(nodes[a][2]) + [f"n{b}"], None)
    nodes[b] = (nodes[b][0], "AddN", list(nodes[b][2]) + [f"n{a}"], None)
    with pytest.raises(GraphError, match="cycle"):
        GraphView(graph_def_from_nodes(nodes))


def test_dangling_and_duplicates():
    with pytest.raises(GraphError, match="dangling"):
        GraphView(graph_def_from_nodes([("a", "NoOp", ["missing:0"], None)]))
    with pytest.raises(GraphError, match="duplicate"):
        GraphView(graph_def_from_nodes([("a", "NoOp", [], None), ("a", "NoOp", [], None)]))


def test_an_unplaced_op_taking_a_placed_variable_runs_where_the_variable_is():
    """TensorFlow's placer colocates an op with the resource it takes: a tower's unplaced read of
    a variable kept on the CPU runs on the CPU (its value crosses to the GPU), through an Identity
    of the handle too; an op reading no variable, or a variable without a device, stays unplaced
    (the first GPU)."""
    graph = graph_def_from_nodes([
        ("w", "VarHandleOp", [], None), ("w_cpu", "VarHandleOp", [], None),
        ("read", "ReadVariableOp", ["w_cpu"], None), ("handle", "Identity", ["w_cpu"], None),
        ("read2", "ReadVariableOp", ["handle"], None), ("read_gpu", "ReadVariableOp", ["w"], None),
        ("conv", "Conv2D", ["read", "read2"], None)])
    graph.node[1].device = "/device:CPU:0"
    view = GraphView(graph)
    placed = {view.names[i]: view.gpus[i] for i in range(view.size)}
    assert placed["read"] is None and placed["read2"] is None and placed["handle"] is None
    assert placed["read_gpu"] == placed["conv"] == "/device:GPU:0"
    assert view.node_defs[view.index["read"]].device == ""  # the graph itself is not changed


def test_while_back_edge_is_not_a_cycle_and_frames():
    nodes = [
        ("x", "Const", [], None),
        ("enter", "Enter", ["x"], {"s": None} and {}),
        ("merge", "Merge", ["enter", "next"], None),
        ("switch", "Switch", ["merge", "cond"], None),
        ("cond", "LoopCond", ["merge"], None),
        ("body", "Neg", ["switch:1"], None),
        ("next", "NextIteration", ["body"], None),
        ("exit", "Exit", ["switch:0"], None),
        ("after", "Neg", ["exit"], None),
    ]
    graph = graph_def_from_nodes(nodes)
    graph.node[1].attr["frame_name"].s = b"loop"
    view = GraphView(graph)
    frame = {view.names[i]: view.frames[i] for i in range(view.size)}
    assert frame["x"] == "" and frame["after"] == ""
    assert frame["merge"] == frame["body"] == frame["exit"] == "loop"


def test_cond_depth():
    nodes = [
        ("p", "Const", [], None),
        ("x", "Const", [], None),
        ("sw", "Switch", ["x", "p"], None),
        ("t", "Neg", ["sw:1"], None),
        ("f", "Abs", ["sw:0"], None),
        ("m", "Merge", ["t", "f"], None),
        ("after", "Neg", ["m"], None),
    ]
    view = GraphView(graph_def_from_nodes(nodes))
    depth = {view.names[i]: view.cond_depth[i] for i in range(view.size)}
    assert depth["t"] == depth["f"] == 1
    assert depth["after"] == 0 and depth["x"] == 0


@pytest.mark.parametrize("text,expected", [("a", ("a", 0, False)), ("a:3", ("a", 3, False)),
                                           ("^a", ("a", -1, True)), ("a/b:c", ("a/b:c", 0, False))])
def test_parse_input(text, expected):
    assert parse_input(text) == expected


@pytest.mark.parametrize("device,key", [
    ("", "/device:GPU:0"),
    ("/device:GPU:0", "/device:GPU:0"),
    ("/gpu:1", "/device:GPU:1"),
    ("/job:localhost/replica:0/task:0/device:GPU:0", "/device:GPU:0"),
    ("/job:worker/task:1/device:GPU:2", "/job:worker/task:1/device:GPU:2"),
    ("/device:CPU:0", None),
    ("/cpu:0", None),
    ("/job:localhost/replica:0/task:0/device:CPU:0", None),
])
def test_gpu_keys(device, key):
    assert gpu_key(device) == key


def test_a_later_input_of_a_sum_may_be_swapped_when_the_sum_alone_reads_its_inputs():
    """AddN accumulates into the first input whose buffer it may reuse: a swap of a later input
    keeps the order of the sum when the sum is the only reader of every input's buffer (through
    forwarding ops too), whichever input comes first; input 0 itself, and the inputs of a sum one
    of whose inputs has another reader, stay."""
    from lmscli.plan.candidates import _order_sensitive_sum

    def view(extra_reader: str | None):
        nodes = [("x", "Placeholder", [], None), ("g0", "Relu", ["x"], None), ("i0", "Identity", ["g0"], None),
                 ("g1", "Relu", ["x"], None), ("g2", "Relu", ["x"], None), ("h1", "Relu", ["x"], None),
                 ("sum", "AddN", ["i0", "g1", "g2"], None), ("two", "AddN", ["h1", "x"], None)]
        if extra_reader:
            nodes.append(("other", "Neg", [extra_reader], None))
        return GraphView(graph_def_from_nodes(nodes))

    v = view(None)
    at = v.index
    assert not _order_sensitive_sum(v, at["sum"], at["g2"], 0) and not _order_sensitive_sum(v, at["sum"], at["g1"], 0)
    assert _order_sensitive_sum(v, at["sum"], at["i0"], 0)  # input 0 itself
    assert not _order_sensitive_sum(v, at["two"], at["h1"], 0)  # two inputs commute exactly
    for reader in ("i0", "g0", "g1"):  # a buffer read elsewhere: which input is reused may change
        w = view(reader)
        assert _order_sensitive_sum(w, w.index["sum"], w.index["g2"], 0)
