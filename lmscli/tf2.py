"""TensorFlow 2: plan and rewrite a ``tf.function`` training step, and run the rewritten step in
TensorFlow 2 against the same variables.

    step = tf.function(train_step)                    # GradientTape, a Keras model and optimizer
    concrete = step.get_concrete_function(x_spec, y_spec)
    fitted = lmscli.tf2.rewrite(concrete, gpu_mem="12GiB")
    loss = fitted(x, y)                               # trains the same variables, bit-identically

A concrete function's graph is a GraphDef whose variables are *captured*: each is a resource
``Placeholder`` fed with the variable's handle when the function runs. For lms the step becomes a
model whose captured handles are variables (``VarHandleOp`` nodes of the variables' dtypes and
shapes, read from the handles' data) and whose fetches are the function's outputs and its control
outputs (the variable updates)::

    before (the function's graph)          for lms                     run back in TF2
    resource Placeholder "w"        ->     VarHandleOp "w"      ->     Placeholder "w", fed w.handle
    x = Placeholder, y = Placeholder       (unchanged)                 fed the call's arguments

The rewritten graph (the plan's swap and recompute nodes added) gets its placeholders back and is
imported into a new ``tf.function`` that feeds them the call's arguments and the original
variables' handles. Calls of other functions inside the step are inlined, and its functional
control flow (``If``/``While`` of ``tf.cond``/``tf.while_loop``) lowered to Switch/Merge and
Enter/Exit, as TensorFlow's runtime does (:mod:`lmscli.graph.inline`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmscli.errors import InputError

DT_RESOURCE = 20
V1_CONTROL_FLOW = frozenset({"Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond"})


@dataclass(frozen=True)
class Step:
    """A rewritten training step: call it as the original concrete function (flat tensors in the
    order of its inputs, without the captured ones); ``result`` and ``report`` say what lms did."""

    function: object  # a tf.function running the rewritten graph
    result: object  # lmscli.plan.planner.TuneResult
    report: object  # lmscli.emit.rewriter.RewriteReport
    model: object  # lmscli.loader.Model: the step as lms saw it

    @property
    def plan(self):
        return self.result.plan

    def __call__(self, *args):
        return self.function(*args)


@dataclass(frozen=True)
class _Signature:
    args: tuple[str, ...]  # placeholder names of the call's flat arguments, in order
    captures: tuple[str, ...]  # placeholder names of the captured inputs, in order
    handles: tuple  # the captured tensors (variable handles and other captured values)
    originals: tuple  # NodeDefs of the capture placeholders as the function has them
    outputs: tuple[str, ...]  # tensor names of the function's flat outputs
    control: tuple[str, ...]  # names of its control outputs (the ops that must run)
    structured: object  # the function's structured outputs, to pack the flat ones
    specs: tuple = ()  # TensorSpecs of the call's flat arguments


def model_of(concrete_function, name: str | None = None):
    """The step of ``concrete_function`` as an lms :class:`~lmscli.loader.Model` (variables as
    ``VarHandleOp`` nodes), and what is needed to run its rewrite back (see the module docstring)."""
    import tensorflow as tf
    from tensorflow.core.protobuf import meta_graph_pb2
    from tensorflow.python.ops import handle_data_util

    from lmscli.graph import inline
    from lmscli.loader import Model, lower_functional_control_flow

    graph = getattr(concrete_function, "graph", None)
    if graph is None or not hasattr(concrete_function, "captured_inputs"):
        raise InputError("lmscli.tf2 needs a concrete function: step.get_concrete_function(*input_specs)")
    graph_def = graph.as_graph_def()
    renamed = {}
    if inline.has_calls(graph_def):  # nested tf.functions: their bodies, inlined (lmscli.graph.inline)
        done = inline.inline_calls(graph_def)
        graph_def, renamed = done.graph_def, done.renamed
    handles = tuple(concrete_function.captured_inputs)
    inputs = list(graph.inputs)
    inner = inputs[len(inputs) - len(handles):] if handles else []
    args = inputs[:len(inputs) - len(handles)]
    nodes = {node.name: node for node in graph_def.node}
    originals = []
    for tensor in inner:
        node = nodes[tensor.op.name]
        copy = type(node)()
        copy.CopyFrom(node)
        originals.append(copy)
        if tensor.dtype.as_datatype_enum != DT_RESOURCE:
            continue  # a captured value (a constant tensor): fed as it is
        data = handle_data_util.get_resource_handle_data(tensor)
        if not data.is_set or not data.shape_and_type:
            continue  # a resource that is not a variable (a table, an iterator): left opaque
        kind = data.shape_and_type[0]
        node.op = "VarHandleOp"
        node.ClearField("attr")
        node.attr["dtype"].type = kind.dtype
        node.attr["shape"].shape.CopyFrom(kind.shape)
        node.attr["shared_name"].s = node.name.encode()
        node.attr["container"].s = b""
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    outputs = tuple(renamed.get(t.name, t.name) for t in concrete_function.outputs)
    control = tuple(sorted(op.name for op in graph.control_outputs))
    fetches = tuple(dict.fromkeys([t.split(":")[0] for t in outputs] + list(control)))
    if not fetches:
        raise InputError("the concrete function has neither outputs nor control outputs: nothing to train")
    label = concrete_function.name
    label = label.decode() if isinstance(label, bytes) else str(label)
    model = Model(name or f"<tf.function {label}>", "metagraph", meta, fetches, "option")
    lower_functional_control_flow(model)  # tf.cond / tf.while_loop: If and While, lowered as loader.load does
    specs = tuple(tf.TensorSpec(t.shape, t.dtype) for t in args)
    signature = _Signature(tuple(t.op.name for t in args), tuple(t.op.name for t in inner), handles, tuple(originals),
                           outputs, control, concrete_function.structured_outputs, specs)
    return model, signature


def rewrite(concrete_function, gpu_mem=None, device: str | None = None, reserve: float | None = None,
            link: str | None = None, strategy: str = "hybrid", batch_size: int | None = None, plan=None) -> Step:
    """Plan ``concrete_function``'s step for a GPU (``gpu_mem``: bytes, ``"16GiB"`` or ``"75%"`` of
    the step's peak; or a ``device`` preset) and return the rewritten step, a callable that trains
    the same variables. ``plan``: apply this :class:`~lmscli.plan.document.Plan` instead of tuning. Raises
    :class:`~lmscli.errors.NoFitError` when no plan fits."""
    from lmscli import api
    from lmscli.device import gpu_mem_from_text
    from lmscli.plan.planner import TuneOptions

    model, signature = model_of(concrete_function)
    prepared = api.prepare(model, batch_size=batch_size)
    if plan is None:
        if gpu_mem is None and device is None:
            raise InputError("say what to plan for: gpu_mem=... or device=...")
        peak = api.analyze(prepared).peak_bytes
        budget = gpu_mem_from_text(gpu_mem, peak) if gpu_mem is not None else None
        result = api.tune(prepared, api.make_device(gpu_mem=budget, preset=device, reserve=reserve, link=link),
                          TuneOptions(strategy=strategy))
    else:
        result = api.replay(prepared, plan)
    rewritten, report = api.rewrite(prepared, result.plan)
    return Step(_runner(rewritten.graph_def, signature), result, report, model)


def _runner(graph_def, signature: _Signature):
    """A tf.function importing ``graph_def`` (its capture placeholders restored) and feeding it the
    call's arguments and the captured handles (a wrapped function when it holds lowered control
    flow)."""
    import tensorflow as tf

    restored = type(graph_def)()
    restored.CopyFrom(graph_def)
    originals = {node.name: node for node in signature.originals}
    fed = set(signature.args) | set(signature.captures)
    for node in restored.node:
        if node.name in originals:
            node.CopyFrom(originals[node.name])
        if any(ref[1:] in fed for ref in node.input if ref.startswith("^")):
            # (lowered control flow waits for its inputs; a fed value is there from the start)
            kept = [ref for ref in node.input if not (ref.startswith("^") and ref[1:] in fed)]
            del node.input[:]
            node.input.extend(kept)
    returned = list(signature.outputs) + list(signature.control)

    def run(flat):
        if len(flat) != len(signature.args):
            raise InputError(f"the step takes {len(signature.args)} tensor(s), got {len(flat)}")
        graph = tf.compat.v1.get_default_graph()
        feeds = {f"{name}:0": value for name, value in zip(signature.args, flat)}
        feeds.update({f"{name}:0": graph.capture(handle) for name, handle in zip(signature.captures, signature.handles)})
        found = tf.compat.v1.import_graph_def(restored, input_map=feeds, return_elements=returned, name="lms_step")
        outputs, ops = found[:len(signature.outputs)], found[len(signature.outputs):]
        with tf.control_dependencies(ops):  # (the updates run even when nothing reads them)
            return [tf.identity(t) for t in outputs], tf.constant(0)

    def pack(outputs):
        if signature.structured is None:
            return None
        return tf.nest.pack_sequence_as(signature.structured, outputs, expand_composites=True)

    if not any(node.op in V1_CONTROL_FLOW for node in restored.node):
        @tf.function(autograph=False)
        def step(*args):
            return pack(run(tf.nest.flatten(args))[0])

        return step
    # Lowered tf.cond / tf.while_loop (Switch, Merge, Enter, Exit) cannot go into a tf.function:
    # its automatic control dependencies need the control-flow contexts only Python-built v1
    # control flow has. A wrapped (TensorFlow 1-style) function runs them, pruned to what it returns.
    wrapped = tf.compat.v1.wrap_function(lambda *flat: run(list(flat)), list(signature.specs))

    def step(*args):
        outputs, _done = wrapped(*tf.nest.flatten(args))
        return pack(outputs)

    return step
