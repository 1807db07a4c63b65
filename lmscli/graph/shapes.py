"""Shape and dtype inference by TensorFlow itself, and the ``--batch-size`` override.

TensorFlow's C++ shape functions run when a GraphDef is imported into a ``tf.Graph``; we read
each output's static shape and dtype from there. Unknown dims stay ``None``: they are reported,
never guessed.
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
    """Import ``graph_def`` into a fresh ``tf.Graph`` and read every output's shape and dtype."""
    tf = tensorflow()
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
    except Exception as exc:  # TensorFlow raises ValueError, InvalidArgumentError, TypeError...
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"TensorFlow cannot import the graph: {message}") from None
    return {op.name: tuple(_info(t) for t in op.outputs) for op in graph.get_operations()}
