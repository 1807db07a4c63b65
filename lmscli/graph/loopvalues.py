"""Which stack or TensorList a loop's push or pop works on, and the values of loop invariants
before the step: facts of the graph that shape inference (:mod:`lmscli.graph.shapes`), the loop
memory model (:mod:`lmscli.model.loops`) and the host stacks (:mod:`lmscli.plan.hoststacks`) read.
"""

from __future__ import annotations

from lmscli.graph.graphview import PLACEHOLDER_OPS, SHAPE_OPS, GraphView

PUSH_OPS = frozenset({"StackPushV2", "StackPush", "TensorListPushBack"})
POP_OPS = frozenset({"StackPopV2", "StackPop", "TensorListPopBack"})
PASS_THROUGH = frozenset({"Enter", "RefEnter", "Identity", "Switch", "Merge"})


def source(view: GraphView, node: int, through_exit: bool = False, also: frozenset = frozenset()) -> int:
    """The node a handle or value comes from, through Enter/Identity/Switch/Merge (and Exit, and
    the ops of ``also``, following their first input)."""
    seen = set()
    passing = (PASS_THROUGH | {"Exit"} if through_exit else PASS_THROUGH) | also
    while view.ops[node] in passing and view.data_inputs[node] and node not in seen:
        seen.add(node)
        node = view.data_inputs[node][0][0]
    return node


def pushes_and_pops(view: GraphView) -> dict[int, tuple[list[int], list[int]]]:
    """Per stack (its StackV2 node, or a TensorList's EmptyTensorList), its pushes and pops."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(view.size):
        op = view.ops[i]
        if (op in PUSH_OPS or op in POP_OPS) and view.data_inputs[i]:
            # (a TensorList is a value: the gradient loop pops the list the forward loop's Exit gives)
            stack = (list_of(view, view.data_inputs[i][0][0]) if op.startswith("TensorList")
                     else source(view, view.data_inputs[i][0][0]))
            pushes, pops = out.setdefault(stack, ([], []))
            (pushes if op in PUSH_OPS else pops).append(i)
    return out


def list_of(view: GraphView, node: int) -> int:
    """The TensorList ``node`` passes on: the ``EmptyTensorList`` that made it or, when that one
    makes the first value of several lists, the ``Enter`` by which this one entered its first loop.
    Grappler's optimizations make one of a loop's identical ``EmptyTensorList`` ops (the graph a
    Session runs: a tf_keras LSTM's 14 accumulators came from one), and a list is a value: each
    loop variable is a list of its own::

        EmptyTensorList -> Enter a -> ... PushBack(h) ... Exit -> Enter -> ... PopBack   list "a"
                        -> Enter b -> ... PushBack(c) ... Exit -> Enter -> ... PopBack   list "b"
    """
    seen, enter = set(), None
    while view.ops[node] in PASS_THROUGH | {"Exit"} and view.data_inputs[node] and node not in seen:
        seen.add(node)
        if view.ops[node] in ("Enter", "RefEnter"):
            enter = node
        node = view.data_inputs[node][0][0]
    shared = sum(1 for dst, _port, _output in view.consumers[node] if view.ops[dst] in PASS_THROUGH) > 1
    return enter if enter is not None and shared else node


def invariant(view: GraphView, merge: int) -> tuple[int, int] | None:
    """The value a loop variable enters with, when the body passes it on unchanged (its next
    value is its own Switch's output through Identities only, as a TensorFlow 2 loop does with
    its bounds); None when it changes::

        Enter(n) --> Merge --> Switch --:1--> Identity ... --> NextIteration --> (Merge)
    """
    entered, back = None, None
    for src, _output in view.data_inputs[merge]:
        if view.ops[src] in ("Enter", "RefEnter"):
            entered = view.data_inputs[src][0] if view.data_inputs[src] else None
        elif view.ops[src] in ("NextIteration", "RefNextIteration"):
            back = src
    if entered is None or back is None:
        return None
    node, seen = back, set()
    while view.data_inputs[node] and node not in seen:
        seen.add(node)
        src, output = view.data_inputs[node][0]
        if view.ops[src] in ("Switch", "RefSwitch"):
            return entered if output == 1 and view.data_inputs[src][0][0] == merge else None
        if view.ops[src] != "Identity":
            return None
        node = src
    return None


def value_before_the_step(view: GraphView, node: int, output: int):
    """The value of a scalar tensor made outside every loop, as :class:`Evaluator` computes it
    (a constant, or run from the placeholders' static shapes); None when it cannot be known."""
    if view.frames[node]:
        return None
    evaluator = Evaluator(view)
    return evaluator._const(node) if view.ops[node] == "Const" else evaluator._run(node, output)


VALUE_LEAVES = frozenset({"Placeholder", "PlaceholderWithDefault", "PlaceholderV2", "VarHandleOp", "VariableV2",
                          "Variable", "ReadVariableOp"})


def _reads_values(view: GraphView, node: int, fed=()) -> bool:
    """Does ``node`` depend on what a placeholder or a variable holds (not just its shape)? Then the
    step's data decides it, and computing it from zeros would be wrong (QA: a loop running while
    ``i < sum(mask)``, at most 128 times, was counted as running 0 times); the placeholders named
    in ``fed`` hold known values (``--feed``)::

        mask (Placeholder) -> Sum -> Less(i, .)      the values: unknown
        x (Placeholder) -> Shape -> StridedSlice     the shape: known
        lengths (Placeholder, fed 64) -> Max         known: 64
    """
    stack, seen = [node], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        if view.ops[i] in VALUE_LEAVES and not (view.names[i] in fed and view.ops[i] in PLACEHOLDER_OPS):
            return True
        if view.ops[i] in SHAPE_OPS:
            continue
        stack.extend(src for src, _output in view.data_inputs[i])
    return False


class Evaluator:
    """Values of loop-invariant tensors: constants read from the graph, anything else computed by
    TensorFlow from the placeholders' static shapes (zeros; None when that fails), and from the
    values of the placeholders the steps are fed (``view.fed``: ``--feed``)."""

    def __init__(self, view: GraphView):
        self.view = view
        self._session = None

    def value(self, node: int, output: int, frame: str):
        view = self.view
        while view.frames[node] == frame and view.ops[node] in ("Enter", "RefEnter", "Identity", "Merge"):
            if view.ops[node] == "Merge":
                entered = invariant(view, node)
                if entered is None:
                    return None
                node, output = entered
                continue
            node, output = view.data_inputs[node][0]
        if view.ops[node] == "Const":  # (a constant made inside the loop is invariant too)
            return self._const(node)
        if view.frames[node] == frame:
            return None
        if view.frames[node]:
            return None  # computed in an outer loop: it may change per outer iteration
        return self._run(node, output)

    def _const(self, node: int):
        value = self.view.constant(node)
        return value.item() if value is not None and value.size == 1 else None

    def _run(self, node: int, output: int):
        import numpy as np

        from lmscli.tfimport import tensorflow

        tf = tensorflow()
        view = self.view
        if view.ops[node] in PLACEHOLDER_OPS and view.names[node] in view.fed:
            return view.fed[view.names[node]]  # (a fed value fills its shape; TensorFlow fetches no fed tensor)
        needed = view.ancestors([node])
        if any(view.frames[i] for i in needed) or _reads_values(view, node, view.fed):
            return None
        try:
            from tensorflow.core.framework import graph_pb2

            graph_def = graph_pb2.GraphDef()
            graph_def.node.extend(view.node_defs[i] for i in sorted(needed))
            graph_def.library.function.extend(view.library)
            graph = tf.Graph()
            with graph.as_default():
                tf.compat.v1.import_graph_def(graph_def, name="")
            feeds = {}
            for op in graph.get_operations():
                if op.type in ("Placeholder", "PlaceholderV2") or (op.type in PLACEHOLDER_OPS and op.name in view.fed):
                    t = op.outputs[0]
                    if t.shape.rank is None:
                        return None
                    feeds[t] = np.full([d if d is not None else 1 for d in t.shape.as_list()],
                                       view.fed.get(op.name, 0), dtype=t.dtype.as_numpy_dtype)
            with tf.compat.v1.Session(graph=graph) as session:
                value = session.run(f"{view.names[node]}:{output}", feed_dict=feeds)
        except Exception:
            return None
        value = np.asarray(value)
        return value.item() if value.size == 1 and (np.issubdtype(value.dtype, np.number) or value.dtype == bool) else None


# Scalar ops a loop's counter-driven values are made of (numpy's functions of the same names
# compute what TensorFlow's kernels do on integer and bool scalars).
_BINARY = {
    "Add": lambda a, b: a + b, "AddV2": lambda a, b: a + b, "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b, "FloorMod": lambda a, b: a % b, "FloorDiv": lambda a, b: a // b,
    "Maximum": max, "Minimum": min, "Equal": lambda a, b: a == b, "NotEqual": lambda a, b: a != b,
    "Less": lambda a, b: a < b, "LessEqual": lambda a, b: a <= b, "Greater": lambda a, b: a > b,
    "GreaterEqual": lambda a, b: a >= b, "LogicalAnd": lambda a, b: bool(a and b),
    "LogicalOr": lambda a, b: bool(a or b),
}
_UNARY = {"Identity": lambda a: a, "LogicalNot": lambda a: not a, "Neg": lambda a: -a}


def per_iteration(view: GraphView, node: int, output: int, frame: str, trips: int, evaluator: Evaluator):
    """The values a scalar tensor of loop ``frame`` takes in each of its first ``trips``
    iterations, when it is computed from the loop's counters (loop variables that start from a
    known value and whose next value is computed from themselves and constants) by integer and
    bool arithmetic; None otherwise (a value read from the data, a float, an unknown op)::

        Enter(0) --> Merge --> Switch --:1--> Identity(t) --> Add(t, 1) --> NextIteration
                                                 t --> FloorMod(t, 2) --> Equal(., 0)   [True, False, True, ...]
    """
    merges: dict[int, tuple[int, int]] = {}  # a counter's Merge -> its next value (node, output)
    starts: dict[int, object] = {}

    def walk(n: int, out: int, seen: frozenset):
        """A function of the counters' values giving the value of (n, out); None when unknown."""
        op = view.ops[n]
        if view.frames[n] != frame:
            return None
        if op == "Const":  # (not a float: Python's doubles are not TensorFlow's float32)
            value = evaluator._const(n)
            return None if value is None or isinstance(value, float) else (lambda env: value)
        if op in ("Enter", "RefEnter"):
            value = evaluator.value(n, out, frame)
            return None if value is None or isinstance(value, float) else (lambda env: value)
        if op in ("Merge", "RefMerge"):
            entered = invariant(view, n)
            if entered is not None:
                value = evaluator.value(*entered, frame)
                return None if value is None or isinstance(value, float) else (lambda env: value)
            if n not in merges:
                if n in seen or not _counter(view, n, frame, merges, starts, evaluator):
                    return None
                nxt = walk(*merges[n], seen | {n})  # (its next value, as _counter found it)
                if nxt is None:
                    return None
                merges[n] = nxt
            return lambda env: env[n]
        if op in ("Switch", "RefSwitch", "Identity", "Snapshot") or op in _UNARY:
            if not view.data_inputs[n]:
                return None
            inner = walk(*view.data_inputs[n][0], seen)
            fn = _UNARY.get(op, _UNARY["Identity"])
            return None if inner is None else (lambda env: fn(inner(env)))
        if op in _BINARY and len(view.data_inputs[n]) == 2:
            a, b = (walk(*src, seen) for src in view.data_inputs[n])
            if a is None or b is None:
                return None
            fn = _BINARY[op]
            return lambda env: fn(a(env), b(env))
        return None

    value = walk(node, output, frozenset())
    if value is None:
        return None
    env = dict(starts)
    out = []
    try:
        for _ in range(trips):
            out.append(value(env))
            env = {m: merges[m](env) for m in merges}
    except (ArithmeticError, TypeError):  # (a division by zero: TensorFlow's kernel would fail too)
        return None
    return out


def _counter(view: GraphView, merge: int, frame: str, merges: dict, starts: dict, evaluator: Evaluator) -> bool:
    """Note ``merge`` as a counter in ``merges`` (its NextIteration's input) and ``starts`` (the
    integer it enters with); False when it is not one."""
    entered, back = None, None
    for src, _output in view.data_inputs[merge]:
        if view.ops[src] in ("Enter", "RefEnter") and view.data_inputs[src]:
            entered = view.data_inputs[src][0]
        elif view.ops[src] in ("NextIteration", "RefNextIteration") and view.data_inputs[src]:
            back = view.data_inputs[src][0]
    if entered is None or back is None:
        return False
    start = evaluator.value(entered[0], entered[1], frame)
    if start is None or isinstance(start, float):
        return False
    merges[merge], starts[merge] = back, start
    return True
