"""Loading and saving models: GraphDef, MetaGraphDef (binary or text) and SavedModel directories.

``load()`` returns a :class:`Model`: the graph wrapped in a MetaGraphDef (a bare GraphDef gets an
empty one), where it came from and in which format, and what a training step fetches.
Formats are detected by content; the file extension only breaks ties. Every failure is an
:class:`~lmscli.errors.InputError` or :class:`~lmscli.errors.GraphError` with one clear line.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field

from lmscli.errors import GraphError, InputError, MissingFetchError
from lmscli.tfimport import tensorflow
from lmscli.timing import timed

FORMATS = ("graphdef", "graphdef-text", "metagraph", "metagraph-text", "savedmodel")
_OP_NAME = re.compile(r"^[A-Za-z_>][A-Za-z0-9_>]*$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\-/>]*$")


@dataclass
class Model:
    """A loaded graph. ``meta_graph`` is always a MetaGraphDef; ``format`` is how it was stored."""

    path: str
    format: str
    meta_graph: object  # tensorflow.core.protobuf.meta_graph_pb2.MetaGraphDef
    fetches: tuple[str, ...] = ()
    fetch_source: str = ""  # "option", "train_op", "signature <key>" or "sinks"
    notes: list[str] = field(default_factory=list)
    saved_model_tag: str | None = None
    structure: object = field(default=None, repr=False, compare=False)  # GraphView without tensor facts
    calls: dict = field(default_factory=dict, repr=False)  # inlined call output -> the call ("c/output_0:0" -> "c")

    @property
    def graph_def(self):
        return self.meta_graph.graph_def

    @property
    def name(self) -> str:
        base = os.path.basename(os.path.normpath(self.path))
        for suffix in (".meta.txt", ".meta.pbtxt", ".pbtxt", ".meta", ".pb"):
            if base.endswith(suffix):
                return base[: -len(suffix)]
        return base


def _protos():
    # Importing these imports TensorFlow; keep it out of module import time.
    tensorflow()
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

    return graph_pb2, meta_graph_pb2, saved_model_pb2


def _plausible_graph(graph_def) -> bool:
    """A parsed message is a graph only if it has nodes with sane names and op types."""
    if len(graph_def.node) == 0:
        return False
    for node in graph_def.node:
        if not node.name or not _OP_NAME.match(node.op) or not _NODE_NAME.match(node.name):
            return False
    return True


def _parse_binary(data: bytes, prefer_meta: bool):
    graph_pb2, meta_graph_pb2, _ = _protos()
    from google.protobuf.message import DecodeError

    attempts = ("metagraph", "graphdef") if prefer_meta else ("graphdef", "metagraph")
    errors = []
    for kind in attempts:
        try:
            if kind == "metagraph":
                meta = meta_graph_pb2.MetaGraphDef()
                meta.ParseFromString(data)
                if _plausible_graph(meta.graph_def):
                    return kind, meta
            else:
                graph = graph_pb2.GraphDef()
                graph.ParseFromString(data)
                if _plausible_graph(graph):
                    return kind, graph
        except (DecodeError, RuntimeError, ValueError, UnicodeDecodeError) as exc:
            errors.append(str(exc) or type(exc).__name__)
        except Exception as exc:  # protobuf's C++ backend raises its own types
            errors.append(f"{type(exc).__name__}: {exc}")
    if errors:
        return None, f"truncated or corrupted protobuf ({errors[0].splitlines()[0]})"
    return None, "it parses as a protobuf but holds no graph nodes"


def _parse_text(text: str, prefer_meta: bool):
    graph_pb2, meta_graph_pb2, _ = _protos()
    from google.protobuf import text_format

    looks_meta = bool(re.search(r"^\s*(meta_info_def|graph_def|collection_def|saver_def)\s*[{:]", text, re.M))
    kinds = ("metagraph", "graphdef") if (looks_meta or prefer_meta) else ("graphdef", "metagraph")
    first_error = None
    for kind in kinds:
        message = meta_graph_pb2.MetaGraphDef() if kind == "metagraph" else graph_pb2.GraphDef()
        try:
            text_format.Parse(text, message, allow_unknown_extension=False)
        except text_format.ParseError as exc:
            first_error = first_error or str(exc).splitlines()[0]
            continue
        graph = message.graph_def if kind == "metagraph" else message
        if _plausible_graph(graph):
            return kind + "-text", message
    return None, f"not a valid text GraphDef or MetaGraphDef ({first_error or 'no graph nodes'})"


def _looks_like_text(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    sample = text[:4096]
    if not sample.strip() or "\x00" in sample:
        return None
    printable = sum(ch.isprintable() or ch in "\n\r\t" for ch in sample)
    return text if printable / len(sample) > 0.95 else None


def _read_saved_model(path: str, tag: str | None):
    _, _, saved_model_pb2 = _protos()
    pb = os.path.join(path, "saved_model.pb")
    pbtxt = os.path.join(path, "saved_model.pbtxt")
    saved = saved_model_pb2.SavedModel()
    try:
        if os.path.isfile(pb):
            with open(pb, "rb") as fh:
                saved.ParseFromString(fh.read())
        elif os.path.isfile(pbtxt):
            from google.protobuf import text_format

            with open(pbtxt, encoding="utf-8") as fh:
                text_format.Parse(fh.read(), saved)
        else:
            raise InputError(f"{path}: a directory but not a SavedModel (no saved_model.pb or saved_model.pbtxt)")
    except InputError:
        raise
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: corrupted SavedModel ({first})") from None
    metas = list(saved.meta_graphs)
    if not metas:
        raise InputError(f"{path}: the SavedModel holds no MetaGraphDef")
    all_tags = [list(m.meta_info_def.tags) for m in metas]
    if tag is None:
        if len(metas) == 1:
            return metas[0], ",".join(all_tags[0])
        for wanted in ("train", "serve"):
            for meta, tags in zip(metas, all_tags):
                if wanted in tags:
                    return meta, wanted
        return metas[0], ",".join(all_tags[0])
    wanted = set(tag.split(","))
    for meta, tags in zip(metas, all_tags):
        if wanted <= set(tags):
            return meta, tag
    listed = "; ".join(",".join(t) for t in all_tags)
    raise InputError(f"{path}: no MetaGraphDef with tag {tag!r} (available: {listed})")


def _collection_names(meta, key: str) -> list[str]:
    if key not in meta.collection_def:
        return []
    col = meta.collection_def[key]
    if col.HasField("node_list"):
        return list(col.node_list.value)
    if col.HasField("bytes_list"):
        out = []
        for value in col.bytes_list.value:
            try:
                out.append(value.decode("utf-8"))
            except UnicodeDecodeError:
                continue
        return out
    return []


def _node_of(name: str) -> str:
    name = name.lstrip("^")
    base, sep, index = name.rpartition(":")
    return base if sep and index.isdigit() else name


@timed("load")
def load(path: str, fmt: str | None = None, fetch: list[str] | None = None, tag: str | None = None) -> Model:
    """Load a model from ``path``. ``fmt`` forces one of :data:`FORMATS`; ``fetch`` names what to run."""
    if fmt is not None and fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file or directory")
    saved_tag = None
    if os.path.isdir(path) or fmt == "savedmodel":
        if not os.path.isdir(path):
            raise InputError(f"{path}: --format savedmodel needs a SavedModel directory")
        meta, saved_tag = _read_saved_model(path, tag)
        kind = "savedmodel"
    else:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if not data:
            raise InputError(f"{path}: the file is empty")  # (before TensorFlow's import: QA r54, 4-7 s)
        _, meta_graph_pb2, _ = _protos()
        lower = path.lower()
        prefer_meta = ".meta" in lower or (fmt or "").startswith("metagraph")
        text = None
        if fmt in (None, "graphdef-text", "metagraph-text"):
            text = _looks_like_text(data) if fmt is None else data.decode("utf-8", "replace")
        if text is not None:
            kind, message = _parse_text(text, prefer_meta)
        else:
            kind, message = _parse_binary(data, prefer_meta)
        if kind is None:
            raise InputError(f"{path}: not a TensorFlow graph: {message}")
        if fmt is not None and kind.split("-")[0] != fmt.split("-")[0]:
            raise InputError(f"{path}: --format {fmt} given, but the file holds a {kind}")
        if kind.startswith("metagraph"):
            meta = message
        else:
            meta = meta_graph_pb2.MetaGraphDef()
            meta.graph_def.CopyFrom(message)
    if not _plausible_graph(meta.graph_def):
        raise InputError(f"{path}: the graph has no nodes")
    model = Model(path=path, format=kind, meta_graph=meta, saved_model_tag=saved_tag)
    _inline_calls(model)
    model.structure = _check_structure(model)
    _choose_fetches(model, fetch)
    lower_functional_control_flow(model)
    return model


def _inline_calls(model: Model) -> None:
    """Calls into the function library become their bodies (:mod:`lmscli.graph.inline`), with a note;
    the checkpoint's save and restore functions stay calls (no step runs them)."""
    from lmscli.graph import inline

    saver = model.meta_graph.saver_def if model.meta_graph.HasField("saver_def") else None
    keep = frozenset(_node_of(n) for n in (saver.save_tensor_name, saver.restore_op_name) if n) if saver else frozenset()
    if not inline.has_calls(model.graph_def, keep):
        return
    done = inline.inline_calls(model.graph_def, keep)
    model.meta_graph.graph_def.CopyFrom(done.graph_def)
    for signature in model.meta_graph.signature_def.values():  # outputs of calls: their new names
        for info in signature.outputs.values():
            name = info.name if ":" in info.name else info.name + ":0"
            info.name = done.renamed.get(name, info.name)
    model.calls = {new: old.rpartition(":")[0] for old, new in done.renamed.items()}
    if done.calls:
        model.notes.append(f"{len(done.calls)} function call(s) inlined ({done.nodes} ops from their bodies), "
                           "as TensorFlow's runtime inlines them: their tensors are counted and can be swapped; "
                           "the rewritten graph keeps them inlined")
    for call, why in done.left:
        model.notes.append(f"function call {call} left as a call ({why}): the tensors inside it are not counted")


def lower_functional_control_flow(model: Model) -> None:
    """Functional If/While/Case the step runs become v1 control flow (:func:`lmscli.graph.inline.lower_control_flow`)."""
    from lmscli.graph import inline

    if not any(n.op in inline.FUNCTIONAL_OPS for n in model.graph_def.node):
        return
    try:
        done = inline.lower_control_flow(model.graph_def, model.fetches)
    except inline.CannotInline as exc:
        model.notes.append(f"functional control flow left as it is ({exc}): the tensors inside its branches "
                           "and loop bodies are not counted")
        return
    if done.lowered:
        from lmscli.graph import loopvars

        invariant = loopvars.invariants(done.graph_def, done.lowered)
        model.meta_graph.graph_def.CopyFrom(done.graph_def)
        model.structure = _check_structure(model)
        model.notes.append(f"{len(done.lowered)} functional If/While/Case op(s) lowered to Switch/Merge and "
                           "Enter/Exit, as TensorFlow's runtime lowers them: the tensors of their branches and "
                           "loop bodies are counted (and, in branches, swapped)"
                           + (f"; {invariant} value(s) their loops pass on unchanged read as loop invariants, "
                              "which can leave the GPU around the loops" if invariant else ""))


def _check_structure(model: Model):
    """Duplicate names, dangling inputs and cycles, reported as GraphError; returns the GraphView."""
    from lmscli.graph.graphview import GraphView

    try:
        return GraphView(model.graph_def)
    except GraphError as exc:
        raise GraphError(f"{model.path}: {exc}") from None


def _choose_fetches(model: Model, fetch: list[str] | None) -> None:
    names = {n.name for n in model.graph_def.node}
    if fetch:
        wanted = [_node_of(f) for f in fetch]
        missing = [f for f in wanted if f not in names]
        if missing:
            raise MissingFetchError(f"{model.path}: --fetch names no node {missing[0]!r}", missing[0])
        model.fetches, model.fetch_source = tuple(wanted), "option"
        return
    train = [_node_of(n) for n in _collection_names(model.meta_graph, "train_op")]
    train = [n for n in train if n in names]
    if train:
        model.fetches, model.fetch_source = tuple(dict.fromkeys(train)), "train_op"
        return
    signature = _signature_fetches(model.meta_graph, names, model.calls)
    if signature:
        key, wanted = signature
        model.fetches, model.fetch_source = wanted, f"signature {key}"
        return
    view = model.structure
    sinks = sorted(view.names[i] for i in _step_sinks(view))
    model.fetches, model.fetch_source = tuple(sinks), "sinks"
    model.notes.append(
        f"no train_op collection and no --fetch: fetching the graph's {len(sinks)} sink(s)"
        + (f" ({', '.join(sinks[:3])}{', ...' if len(sinks) > 3 else ''})" if sinks else "")
    )


# Ops whose values come from outside the step: a training step depends on one of them.
STEP_INPUT_OPS = frozenset({"Placeholder", "IteratorGetNext", "IteratorGetNextSync", "QueueDequeueV2",
                            "QueueDequeueManyV2", "QueueDequeueUpToV2"})


def _step_sinks(view) -> list[int]:
    """The sinks a training step runs, in a graph that does not say (no train_op collection, no
    signature): those that depend on the step's inputs (placeholders, an iterator's or a queue's
    next element), NoOps included (a ``train_op`` made by ``minimize`` is a NoOp grouping the
    updates); not the variables' initializers and reads, a saver's ops or ``init``, which depend
    on constants only (QA: a training GraphDef's default step ran the initializers and no
    update). Without such inputs, the sinks but NoOps, asserts, saves and constants."""
    inputs = [i for i in range(view.size) if view.ops[i] in STEP_INPUT_OPS]
    reached = set(inputs)
    stack = list(inputs)
    while stack:
        for j in view.successors(stack.pop()):
            if j not in reached:
                reached.add(j)
                stack.append(j)
    skip = {"Assert", "SaveV2", "RestoreV2", "Const", "Placeholder"}
    found = [i for i in view.sinks() if i in reached and view.ops[i] not in skip]
    if found:
        return found
    skip |= {"NoOp"}
    return [i for i in view.sinks() if view.ops[i] not in skip] or view.sinks()


def _signature_fetches(meta, names: set[str], calls: dict) -> tuple[str, tuple[str, ...]] | None:
    """The outputs of the graph's training signature (a TensorFlow 2 SavedModel has no train_op
    collection: its step is a signature): the one whose key says "train", else, in a graph whose
    signatures call functions (TensorFlow 2), the only one. An output of an inlined call is
    fetched as the call (which waits for the function's updates)."""
    signatures = {k: v for k, v in meta.signature_def.items() if not k.startswith("__saved_model")}
    from lmscli.graph.inline import BOUNDARY_ATTR

    functions = bool(calls) or any(BOUNDARY_ATTR in n.attr for n in meta.graph_def.node)  # (or read back)
    keys = [k for k in sorted(signatures) if "train" in k.lower()] or (sorted(signatures) if functions else [])
    if len(keys) != 1:
        return None
    tensors = [t.name if ":" in t.name else t.name + ":0" for _, t in sorted(signatures[keys[0]].outputs.items())]
    wanted = tuple(dict.fromkeys(calls.get(t) or _inlined_call(meta.graph_def, _node_of(t)) or _node_of(t)
                                 for t in tensors))
    return (keys[0], wanted) if wanted and all(w in names for w in wanted) else None


def _inlined_call(graph_def, node: str) -> str | None:
    """The call an output of lms's inlining stands for, in a graph read back after a rewrite:
    ``c/output_k`` read by a ``NoOp`` named ``c`` (see :mod:`lmscli.graph.inline`)."""
    call, sep, tail = node.rpartition("/output_")
    if not sep or not tail.isdigit():
        return None
    for n in graph_def.node:
        if n.name == call:
            return call if n.op == "NoOp" and f"^{node}" in n.input else None
    return None


def serialize(model_or_meta, fmt: str, tag: str | None = None) -> bytes:
    """Serialize a MetaGraphDef in the given format (deterministically)."""
    from google.protobuf import text_format

    meta = getattr(model_or_meta, "meta_graph", model_or_meta)
    if fmt == "metagraph":
        return meta.SerializeToString(deterministic=True)
    if fmt == "graphdef":
        return meta.graph_def.SerializeToString(deterministic=True)
    if fmt == "metagraph-text":
        return text_format.MessageToString(meta).encode("utf-8")
    if fmt == "graphdef-text":
        return text_format.MessageToString(meta.graph_def).encode("utf-8")
    raise InputError(f"cannot write format {fmt!r}; write a .meta or .pb file instead")


def output_directory(path: str) -> str:
    """The directory a file ``path`` is to be written into; InputError when it does not exist."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise InputError(f"{path}: the directory {directory} does not exist")
    return directory


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename."""
    directory = output_directory(path)
    fd, tmp = tempfile.mkstemp(prefix=".lms-", dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; an output file gets the usual mode
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
