"""Function calls inlined into the graph, so that analysis, planning and the rewrite see (and can
swap) the tensors a function makes.

A TensorFlow 2 SavedModel's training signature, or any graph a ``tf.function`` is called from,
runs its step inside ``StatefulPartitionedCall``/``PartitionedCall`` nodes whose bodies live in the
function library. TensorFlow's runtime inlines such calls itself when it builds the graph it
executes; lms does the same, earlier, in the graph it analyses and writes::

    before                                   after
    x, w ──> StatefulPartitionedCall "c" ──> loss = c:0
              (f: body in the library)

             x ──> Identity "c/x" ─┐
             w ──> Identity "c/w" ─┴─> c/MatMul ─> ... ─> c/loss ──> Identity "c/output_0" ──> loss
                                                                      │
                          NoOp "c" <── ^c/output_0, ^c/AssignSubVariableOp (control outputs)

The body's nodes get the call's name as a prefix (and its device when they have none); each
argument becomes an Identity (marked ``_lms_inlined``) of the call's input, waiting for the call's control inputs; each
output an Identity of the returned tensor, which the call's consumers (and the signatures, see
:attr:`Inlined.renamed`) now read; a ``NoOp`` named as the call waits for the outputs and the
function's control outputs, so ``^c`` and fetching ``c`` still mean "the function has run", as
TensorFlow's own inlining does. Calls inside bodies are inlined in turn.
Functional control flow (``If``, ``While``, ``Case``) is left as it is: TensorFlow lowers it to
``Switch``/``Merge`` itself. The function library is kept (control flow and signatures refer to it).
"""

from __future__ import annotations

from dataclasses import dataclass

CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
BOUNDARY_ATTR = "_lms_inlined"  # marks the Identities standing for a call's arguments and results
MAX_DEPTH = 16  # nested calls deeper than this (a recursive function) are left as calls


@dataclass(frozen=True)
class Inlined:
    """What :func:`inline_calls` did: the new graph, the calls it inlined and those it left."""

    graph_def: object  # GraphDef
    calls: tuple[str, ...]  # names of the inlined call nodes (nested calls by their new names)
    nodes: int  # body nodes added
    left: tuple[tuple[str, str], ...]  # (call node, why it was left as a call)
    renamed: dict  # "call:k" -> the tensor now standing for it ("c/output_k:0")


def has_calls(graph_def, keep: frozenset = frozenset()) -> bool:
    functions = {f.signature.name for f in graph_def.library.function}
    return any(n.op in CALL_OPS and n.attr["f"].func.name in functions and n.name not in keep for n in graph_def.node)


def inline_calls(graph_def, keep: frozenset = frozenset()) -> Inlined:
    """A copy of ``graph_def`` with every call into its function library replaced by the body,
    except the calls named in ``keep`` (a SavedModel's save and restore functions, say)."""
    from tensorflow.core.framework import graph_pb2

    functions = {f.signature.name: f for f in graph_def.library.function}
    source = graph_pb2.GraphDef()
    source.CopyFrom(graph_def)  # (rewiring edits nodes in place; the caller's graph stays as it is)
    nodes = list(source.node)
    names = {n.name for n in nodes}
    depth = {n.name: 0 for n in nodes}
    inlined, left, added, renamed = [], {}, 0, {}
    library = _Library(graph_def.library)
    while True:
        out, expanded = [], False
        for node in nodes:
            fname = node.attr["f"].func.name if node.op in CALL_OPS else ""
            if fname not in functions or node.name in left or node.name in keep:
                out.append(node)
                continue
            try:
                if depth[node.name] >= MAX_DEPTH:
                    raise CannotInline(f"calls nested deeper than {MAX_DEPTH} (a recursive function?)")
                body, outputs = _expand(node, functions[fname], names, library)
            except CannotInline as exc:
                left[node.name] = str(exc)
                out.append(node)
                continue
            for new in body:
                depth[new.name] = depth[node.name] + 1
            depth[node.name] = 0  # the node named as the call is no call
            for k, tensor in enumerate(outputs):
                renamed[f"{node.name}:{k}"] = tensor
            names.update(n.name for n in body)
            out.extend(body)
            inlined.append(node.name)
            added += len(body) - 1
            expanded = True
        nodes = out
        if not expanded:
            break
        _rewire(nodes, renamed)
    result = graph_pb2.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    result.library.CopyFrom(graph_def.library)
    result.node.extend(nodes)
    return Inlined(result, tuple(inlined), added, tuple(sorted(left.items())), renamed)


def _rewire(nodes, renamed: dict) -> None:
    """Data inputs naming a call's output read the tensor standing for it."""
    for node in nodes:
        refs = list(node.input)
        new = [renamed.get(ref if ":" in ref or ref.startswith("^") else ref + ":0", ref) for ref in refs]
        if new != refs:
            del node.input[:]
            node.input.extend(new)


class CannotInline(Exception):
    """Why a call (or the graph's functional control flow) stays as it is."""


def _split(ref: str) -> tuple[str, str]:
    """(node, '^') for a control input, else (node, ':k' or '')."""
    if ref.startswith("^"):
        return ref[1:], "^"
    node, sep, index = ref.rpartition(":")
    if sep and index.isdigit():
        return node, ":" + index
    return ref, ""


def _rename(ref: str, prefix: str) -> str:
    node, tail = _split(ref)
    return f"^{prefix}{node}" if tail == "^" else f"{prefix}{node}{tail}"


class _Library:
    """The graph's function library, readable: a tf.Graph holding it (reading a body looks up the
    functions it calls there), and each body read once (a layer's function may be called often)."""

    def __init__(self, library):
        from tensorflow.core.framework import graph_pb2
        from tensorflow.python.framework import importer, ops

        self.graph = ops.Graph()
        with self.graph.as_default():
            importer.import_graph_def(graph_pb2.GraphDef(library=library), name="")
        self._bodies: dict = {}

    def body(self, fdef):
        """The function's body as GraphDef nodes (arguments as Placeholders), and its tensor names map."""
        from tensorflow.python.framework import function_def_to_graph

        name = fdef.signature.name
        if name not in self._bodies:
            with self.graph.as_default():
                copy = type(fdef)()
                copy.CopyFrom(fdef)  # (it adds entries to the function's arg_attr map)
                try:
                    self._bodies[name] = function_def_to_graph.function_def_to_graph_def(copy)
                except Exception as exc:  # an op or a nested function TensorFlow cannot resolve
                    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    raise CannotInline(f"its body cannot be read ({text})") from None
        return self._bodies[name]


def _expand(call, fdef, taken: set[str], library: _Library) -> tuple[list, list]:
    """The nodes replacing ``call`` (arguments, body, results, and a NoOp named as the call) and
    the names of the tensors standing for its outputs."""
    from tensorflow.core.framework import node_def_pb2

    data = [ref for ref in call.input if not ref.startswith("^")]
    control = [ref for ref in call.input if ref.startswith("^")]
    args = fdef.signature.input_arg
    if len(data) != len(args):
        raise CannotInline(f"{len(data)} inputs for {len(args)} arguments")
    if any(not a.type for a in (*args, *fdef.signature.output_arg)):
        raise CannotInline("an argument's type is an attribute (a generic function)")
    body_def, flat = library.body(fdef)
    prefix = call.name + "/"
    if any((prefix + n.name) in taken for n in body_def.node):
        prefix = call.name + "/_inlined/"
        if any((prefix + n.name) in taken for n in body_def.node):
            raise CannotInline("its body's names collide with nodes of the graph")
    arg_names = {a.name for a in args}
    inside = {n.name for n in body_def.node}
    out = []
    for i, arg in enumerate(args):
        node = node_def_pb2.NodeDef(name=prefix + arg.name, op="Identity", input=[data[i], *control],
                                    device=call.device)
        node.attr["T"].type = arg.type
        node.attr[BOUNDARY_ATTR].b = True
        out.append(node)
    for src in body_def.node:
        if src.name in arg_names:
            continue
        node = node_def_pb2.NodeDef()
        node.CopyFrom(src)
        node.name = prefix + src.name
        del node.input[:]
        node.input.extend(_rename(ref, prefix) for ref in src.input)
        if not src.input and control:
            node.input.extend(control)  # nothing in the body starts before the call could
        if not node.device:
            node.device = call.device
        if "_class" in node.attr:  # colocation with body nodes, by their new names
            groups = [g.decode() if isinstance(g, bytes) else g for g in node.attr["_class"].list.s]
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(
                (f"loc:@{prefix}{g[5:]}" if g.startswith("loc:@") and g[5:] in inside else g).encode()
                for g in groups)
        out.append(node)
    outputs = []
    for k, arg in enumerate(fdef.signature.output_arg):
        ret = fdef.ret[arg.name]
        name = f"{prefix}output_{k}"
        if name in taken or name[len(prefix):] in inside:
            raise CannotInline(f"its body has a node named {name[len(prefix):]!r}")
        node = node_def_pb2.NodeDef(name=name, op="Identity", input=[_rename(flat.get(ret, ret), prefix)],
                                    device=call.device)
        node.attr["T"].type = arg.type
        node.attr[BOUNDARY_ATTR].b = True
        out.append(node)
        outputs.append(name + ":0")
    waits = [f"^{name[:-2]}" for name in outputs] + sorted(f"^{prefix}{n}" for n in fdef.control_ret.values())
    last = node_def_pb2.NodeDef(name=call.name, op="NoOp", input=waits or control, device=call.device)
    out.append(last)
    return out, outputs


FUNCTIONAL_OPS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"})


@dataclass(frozen=True)
class Lowered:
    """What :func:`lower_control_flow` did: the new graph and the functional ops it lowered."""

    graph_def: object  # GraphDef
    lowered: tuple[str, ...]  # names of the If/While/Case nodes now made of Switch/Merge/Enter/Exit


def lower_control_flow(graph_def, fetches) -> Lowered:
    """Functional control flow a step runs (``If``, ``While``, ``Case``: TensorFlow 2's
    ``tf.cond`` and ``tf.while_loop``, whose branches and bodies are functions) lowered to v1
    control flow, as TensorFlow's runtime lowers it before it runs a graph, so that lms sees the
    tensors inside (branch by branch, loop frame by loop frame)::

        before                                  after
        p, x ──> If "c" (then_branch: f,        x ──> Switch(x, p) ─:1─> c/f's body ─┐
                         else_branch: g)                          ─:0─> c/g's body ─┴─> Merge ──> y
                 ──> y = c:0                    NoOp "c" (waits for the branch taken)

    Grappler's function optimizer alone does the lowering (the code the runtime uses), on the
    fetches' ancestors only; every other node (a SavedModel's save and restore functions) and the
    function library are kept as they were."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    by_name = {n.name: n for n in graph_def.node}
    needed, todo = set(), [f for f in fetches if f in by_name]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        todo.extend(_split(ref)[0] for ref in by_name[name].input if _split(ref)[0] in by_name)
    functional = tuple(n.name for n in graph_def.node if n.name in needed and n.op in FUNCTIONAL_OPS)
    if not functional:
        return Lowered(graph_def, ())
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.versions.CopyFrom(graph_def.versions)
    meta.graph_def.library.CopyFrom(graph_def.library)
    meta.graph_def.node.extend(n for n in graph_def.node if n.name in needed)
    meta.collection_def["train_op"].node_list.value.extend(sorted(set(fetches) & needed))
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers.append("function")
    rewrite.min_graph_nodes = -1
    try:
        optimized = tf_optimizer.OptimizeGraph(config, meta)
    except Exception as exc:
        raise CannotInline(f"Grappler could not lower it ({str(exc).splitlines()[0] if str(exc) else exc})") from None
    made = {n.name for n in optimized.node}
    # Nodes the step does not need stay, except those reading a lowered op's outputs (a lowered
    # op is a NoOp now): dead ends of the step (say, a gradient loop's unused results).
    gone, grew = set(functional), True
    rest = [n for n in graph_def.node if n.name not in needed]
    while grew:
        before = len(gone)
        gone.update(n.name for n in rest if any(_split(ref)[0] in gone for ref in n.input))
        grew = len(gone) > before
    kept = [n for n in rest if n.name not in gone]
    if any(n.name in made for n in kept) or any(f not in made for f in fetches if f in needed):
        raise CannotInline("its lowered nodes' names collide with the graph's")
    result = graph_pb2.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    result.library.CopyFrom(graph_def.library)
    result.node.extend(optimized.node)
    result.node.extend(kept)
    return Lowered(result, functional)
