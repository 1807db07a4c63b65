"""Shape and dtype inference by TensorFlow itself, and the ``--batch-size`` override.

TensorFlow's C++ shape functions run when a GraphDef is imported into a ``tf.Graph``; we read
each output's static shape and dtype from there. Inside while loops the importer knows little
(it meets a loop's ``Merge`` before its back edge), so lms imports again with the shapes the loops'
own rules give pinned (:func:`infer`). Unknown dims stay ``None``: they are reported, never guessed.
"""

from __future__ import annotations

import copy

from lmscli.errors import InputError
from lmscli.graph.graphview import PLACEHOLDER_OPS, TensorInfo
from lmscli.tfimport import tensorflow
from lmscli.timing import timed


def set_batch_size(graph_def, batch_size: int):
    """Return a copy of ``graph_def`` whose placeholders have dim 0 = ``batch_size`` where unknown.

    When one changes, stale ``_output_shapes`` attributes are dropped everywhere so TensorFlow
    re-infers them; when none does (every batch dimension is known), ``graph_def`` is returned as
    it is: those attributes carry shapes TensorFlow cannot infer again, e.g. inside the bodies of
    lowered functional loops (QA: ``--batch-size 16`` on a GRU of batch 16 made 144 more tensors
    of unknown size). Returns ``(new_graph_def, names_of_changed_placeholders)``.
    """
    if batch_size <= 0:
        raise InputError(f"--batch-size must be positive, got {batch_size}")
    out = copy.deepcopy(graph_def)
    changed = []
    for node in out.node:
        if node.op not in PLACEHOLDER_OPS or "shape" not in node.attr:
            continue
        shape = node.attr["shape"].shape
        if shape.unknown_rank or not shape.dim:
            continue
        if shape.dim[0].size == -1:
            shape.dim[0].size = batch_size
            changed.append(node.name)
    if not changed:
        return graph_def, changed
    for node in out.node:
        if "_output_shapes" in node.attr:
            del node.attr["_output_shapes"]
    return out, changed


def batch_sizes_set(graph_def, rewritten) -> frozenset:
    """The sizes :func:`set_batch_size` gave the placeholders of ``graph_def`` in ``rewritten`` (a
    GraphDef made from it): the dim 0 that is unknown in the one and known in the other."""
    theirs = {node.name: node for node in rewritten.node if node.op in PLACEHOLDER_OPS and "shape" in node.attr}
    sizes = set()
    for node in graph_def.node:
        other = theirs.get(node.name)
        if other is None or node.op not in PLACEHOLDER_OPS or "shape" not in node.attr:
            continue
        mine, set_to = node.attr["shape"].shape, other.attr["shape"].shape
        if mine.dim and set_to.dim and not (mine.unknown_rank or set_to.unknown_rank):
            if mine.dim[0].size == -1 and set_to.dim[0].size >= 0:
                sizes.add(int(set_to.dim[0].size))
    return frozenset(sizes)


def _info(tensor) -> TensorInfo:
    dtype = tensor.dtype.base_dtype
    try:
        itemsize = dtype.size
    except Exception:
        itemsize = 0
    if dtype.name in ("resource", "variant", "string"):
        itemsize = 0
    shape = tensor.shape
    if shape.rank is None:
        return TensorInfo(None, dtype.name, itemsize, None if itemsize else 0)
    dims = tuple(shape.as_list())
    if any(d is None for d in dims):
        return TensorInfo(dims, dtype.name, itemsize, None if itemsize else 0)
    total = itemsize
    for d in dims:
        total *= d
    return TensorInfo(dims, dtype.name, itemsize, total)


@timed("shape inference")
def infer(graph_def) -> dict[str, tuple[TensorInfo, ...]]:
    """Import ``graph_def`` into a fresh ``tf.Graph`` and read every output's shape and dtype; then
    what TensorFlow leaves unknown inside while loops, by their own rules (:func:`_loop_pins`)."""
    first = tensors = imported(graph_def)
    pins: dict[str, tuple] = {}
    refused: set[str] = set()
    for _round in range(LOOP_ROUNDS):
        more = {name: pin for name, pin in _loop_pins(graph_def, tensors).items() if name not in refused}
        if not more.keys() - pins.keys():
            break
        pins.update(more)  # (a pin stays: without it, what it made known is unknown again)
        pinned = imported(_with_output_shapes(graph_def, pins))
        wrong = _refuted(graph_def, pinned, pins)
        if wrong:  # a loop variable that changes shape: start again without pinning it
            refused |= wrong
            pins, tensors = {}, first
            continue
        if _unknown(pinned) >= _unknown(tensors):
            break
        tensors = pinned
    return tensors


def _refuted(graph_def, tensors, pins: dict) -> set[str]:
    """The pinned ``Merge`` ops whose back edge, inferred with the pins, has another shape than
    the pin: their loop variable changes shape from iteration to iteration."""
    ops = {node.name: node.op for node in graph_def.node}
    out = set()
    for node in graph_def.node:
        if node.name not in pins or node.op not in ("Merge", "RefMerge"):
            continue
        for text in node.input:
            name, _, port = text.partition(":")
            if ops.get(name) in ("NextIteration", "RefNextIteration"):
                back = tensors.get(name, ())[int(port or 0)] if tensors.get(name) else None
                if back is not None and not _agrees(back, pins[node.name][0]):
                    out.add(node.name)
    return out


LOOP_ROUNDS = 8  # imports with loop values pinned, while each leaves fewer shapes unknown


def _unknown(tensors) -> int:
    return sum(t.shape is None or None in t.shape for infos in tensors.values() for t in infos)


def _loop_pins(graph_def, tensors) -> dict[str, tuple]:
    """Shapes of loop values TensorFlow's importer cannot see, by the rules its loops keep, per node
    name (one shape per output, ``None``: leave it). The importer meets a loop's ``Merge`` before
    the ``NextIteration`` of its back edge, and an ``Enter`` that is not constant says nothing of
    its shape, so the loop variable, and all the body computes from it, has an unknown shape; a
    TensorFlow 2 gradient loop pops values of unknown shape from the forward loop's TensorList
    accumulators::

        x: [32,128] -> Enter(?) -> Merge(?, back edge) -> body(?) -> NextIteration(?) -> Merge
        pinned:        Enter: [32,128], as x; then Merge: [32,128] (the loop variable keeps its shape)
        PushBack(list, h: [32,128]) ... PopBack(list) -> (list, ?)   pinned: (list, [32,128])

    An ``Enter`` takes the shape of the value it passes in; a ``Merge`` its ``Enter``'s shape, the
    shape invariant of a ``tf.while_loop``, when its ``NextIteration`` input is unknown or has that
    shape (a loop whose variable changes shape is left alone: a pin its back edge then contradicts
    is dropped, and the pins made from it); a ``TensorListPopBack``'s element the shape every push
    to its list has; a ``TensorListStack`` as many elements as the ``TensorListReserve`` that made
    its list holds. Each import with the pins may know more (what follows a pinned ``Merge``), and
    the next pins more."""
    from lmscli.graph.graphview import GraphView

    if not any(node.op in ("Enter", "RefEnter", "TensorListPopBack", "TensorListStack") for node in graph_def.node):
        return {}
    from lmscli.graph.loopvalues import pushes_and_pops

    view = GraphView(graph_def, tensors)
    pins: dict[str, tuple] = {}
    lists = None  # (made when a pop needs it)
    for i in range(view.size):
        op, outputs = view.ops[i], view.outputs(i)
        if op in ("Enter", "RefEnter") and outputs and _open(outputs[0]) and view.data_inputs[i]:
            entering = view.tensor(*view.data_inputs[i][0])
            if entering is not None and not _open(entering):
                pins[view.names[i]] = (entering.shape,)
        elif op in ("Merge", "RefMerge") and view.frames[i] and outputs and _open(outputs[0]):
            shapes = [view.tensor(src, out) for src, out in view.data_inputs[i]]
            entered = [t for (src, _), t in zip(view.data_inputs[i], shapes) if view.ops[src] in ("Enter", "RefEnter")]
            if len(entered) == 1 and entered[0] is not None and not _open(entered[0]):
                if all(t is None or _agrees(t, entered[0].shape) for t in shapes):
                    pins[view.names[i]] = (entered[0].shape, ())
        elif op == "TensorListPopBack" and len(outputs) > 1 and _open(outputs[1]):
            if lists is None:
                lists = pushes_and_pops(view)
            pushed = _pushed_shapes(view, i, lists)
            if len(pushed) == 1:
                pins[view.names[i]] = ((), next(iter(pushed)))
        elif (op == "TensorListStack" and outputs and outputs[0].shape and outputs[0].shape[0] is None
              and None not in outputs[0].shape[1:]):
            count = _reserved(view, i)
            if count is not None:
                pins[view.names[i]] = ((count,) + tuple(outputs[0].shape[1:]),)
    return pins


def _reserved(view, stack: int) -> int | None:
    """The element count of the list a ``TensorListStack`` stacks, when a ``TensorListReserve``
    made it with a count known before the step: a constant, or computed outside any loop from
    placeholders whose shapes are all known (a loop's outputs: ``TensorArray(size=steps)``, with
    ``steps`` read from the input's shape)."""
    from lmscli.graph.loopvalues import source, value_before_the_step

    maker = source(view, view.data_inputs[stack][0][0], through_exit=True)
    inputs = view.data_inputs[maker]
    if view.ops[maker] != "TensorListReserve" or len(inputs) < 2:
        return None
    src, output = inputs[1]
    fed = [i for i in view.ancestors([src]) if view.ops[i] in PLACEHOLDER_OPS]
    if any(view.tensor(i, 0) is None or _open(view.tensor(i, 0)) for i in fed):
        return None  # (a count from an unknown dimension is not guessed)
    count = value_before_the_step(view, src, output)
    return count if isinstance(count, int) and count >= 0 else None


def _open(info: TensorInfo | None) -> bool:
    return info is not None and (info.shape is None or None in info.shape)


def _agrees(info: TensorInfo, shape: tuple) -> bool:
    """``info``'s shape could be ``shape`` (unknown dims agree with anything)."""
    if info.shape is None:
        return True
    return len(info.shape) == len(shape) and all(a is None or a == b for a, b in zip(info.shape, shape))


def _pushed_shapes(view, pop: int, lists: dict) -> set[tuple]:
    """The shapes of what is pushed to the list ``pop`` pops from (``lists``: the pushes and pops
    of each list, :func:`lmscli.graph.loopvalues.pushes_and_pops`), when all are known."""
    from lmscli.graph.loopvalues import list_of

    pushes = lists.get(list_of(view, view.data_inputs[pop][0][0]), ((), ()))[0]
    shapes = set()
    for push in pushes:
        inputs = view.data_inputs[push]
        value = view.tensor(*inputs[1]) if len(inputs) > 1 else None
        if value is None or _open(value):
            return set()
        shapes.add(value.shape)
    return shapes


def _with_output_shapes(graph_def, pins: dict[str, tuple]):
    """A copy of ``graph_def`` whose pinned outputs carry their shapes in ``_output_shapes``, which
    TensorFlow's importer takes as it meets each node (its own inference of every other output
    stays: the attribute is set on the pinned nodes alone, with their other outputs' shapes)."""
    from tensorflow.core.framework import tensor_shape_pb2

    out = copy.deepcopy(graph_def)
    for node in out.node:
        pin = pins.get(node.name)
        if pin is None:
            continue
        protos = node.attr["_output_shapes"].list.shape
        del protos[:]
        for shape in pin:
            proto = tensor_shape_pb2.TensorShapeProto()
            for dim in shape:
                proto.dim.add(size=-1 if dim is None else dim)
            protos.add().CopyFrom(proto)
    return out


def imported(graph_def) -> dict[str, tuple[TensorInfo, ...]]:
    """Every output's shape and dtype as TensorFlow's importer infers them (loops left as it
    leaves them)."""
    tf = tensorflow()
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
    except Exception as exc:  # TensorFlow raises ValueError, InvalidArgumentError, TypeError...
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"TensorFlow cannot import the graph: {message}") from None
    return {op.name: tuple(_info(t) for t in op.outputs) for op in graph.get_operations()}
