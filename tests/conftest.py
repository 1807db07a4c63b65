"""Shared fixtures: the committed sample graphs, small hand-made graphs, and the CLI runner."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Bit-identity checks compare computations, not oneDNN's alignment-dependent kernel choices
# (see lmscli/cli.py): TensorFlow's own CPU kernels, as `lms verify` uses.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_graphs"
TRAINING_SAMPLES = ["mlp", "cnn", "resnet50", "unet3d", "unknown_batch", "while_rnn", "cond_cnn"]


@pytest.fixture(scope="session")
def samples() -> Path:
    return SAMPLES


@pytest.fixture()
def runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # Click >= 8.2 always keeps stderr apart
        return CliRunner()


def invoke(runner, *args):
    from lmscli.cli import cli

    return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)


def graph_def_from_nodes(nodes):
    """A GraphDef from ``(name, op, inputs, attrs)`` tuples (attrs: dict of AttrValue kwargs)."""
    from lmscli.tfimport import tensorflow

    tensorflow()
    from tensorflow.core.framework import attr_value_pb2, graph_pb2

    graph = graph_pb2.GraphDef()
    for name, op, inputs, attrs in nodes:
        node = graph.node.add(name=name, op=op)
        node.input.extend(inputs)
        for key, value in (attrs or {}).items():
            node.attr[key].CopyFrom(attr_value_pb2.AttrValue(**value))
    return graph


def load_generator():
    """The sample generator (``sample_graphs/generate.py``) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lms_generate", SAMPLES / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate


def generated(tmp_path_factory, model: str, **shape) -> Path:
    """The sample generator's ``model`` at ``shape``, written to a fresh temporary folder."""
    path = tmp_path_factory.mktemp(model) / f"{model}.meta"
    path.write_bytes(load_generator().build(model, **shape).SerializeToString(deterministic=True))
    return path


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    """The generator's residual MLP (``synthetic``) at a batch where activations dominate: 131 MiB
    without swapping on the stand-in, 26 MiB lower bound, no convolutions."""
    return generated(tmp_path_factory, "synthetic", nodes=600, batch=2048, width=512)


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    """The generator's transformer (two layers of attention and GELU MLP, layer norm): 23 MiB on
    the stand-in, 9.6 MiB lower bound, no convolution scratch."""
    return generated(tmp_path_factory, "transformer", batch=4, seq=128, d_model=128, heads=4, ffn=512, layers=2)


@pytest.fixture(scope="module")
def stand_in():
    """A stand-in GPU of the test module's own (its zygote started once, stopped after)."""
    from lmscli.prove.standin import StandIn

    with StandIn() as s:
        yield s


def densenet_meta(path) -> Path:
    """The DenseNet-style net of ``make bench`` (b8 64², 3 blocks of 4 layers, growth 24), built
    by the sample generator and written to ``path``."""
    path = Path(path)
    path.write_bytes(load_generator().build("densenet", batch=8, image_size=64, growth=24, blocks=3,
                                    layers_per_block=4).SerializeToString(deterministic=True))
    return path


@pytest.fixture(scope="session")
def tiny_graph_def():
    """A small valid float graph: x -> relu -> identity (a frozen-style GraphDef)."""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        w = tf.constant([[1.0] * 8] * 8, name="w")
        y = tf.nn.relu(tf.matmul(x, w), name="y")
        tf.identity(y, name="out")
    return graph.as_graph_def()


@contextlib.contextmanager
def v1_training_graph(path, learning_rate: float = 0.1, control_flow_v2: bool = False):
    """Build a training graph with control flow v1 (Switch/Merge, Enter/Exit, gradient stacks; with
    ``control_flow_v2``, functional While and If ops, TensorList accumulators) and export it to
    ``path``: yields ``(tf, v1, graph)``; the body sets ``graph.loss`` (a tensor), and plain
    gradient descent on it becomes the ``train_op``. The v2 setting is restored."""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    v1 = tf.compat.v1
    was = v1.control_flow_v2_enabled()
    if control_flow_v2:
        v1.enable_control_flow_v2()
    else:
        v1.disable_control_flow_v2()
    try:
        graph = tf.Graph()
        with graph.as_default():
            yield tf, v1, graph
            loss = tf.identity(graph.loss, name="loss")
            v1.add_to_collection("train_op", v1.train.GradientDescentOptimizer(learning_rate).minimize(loss))
            v1.train.export_meta_graph(str(path), graph=graph)
    finally:
        if was:
            v1.enable_control_flow_v2()
        else:
            v1.disable_control_flow_v2()


def six_conv_cnn(path):
    """A CNN of six 3x3 convolutions and ReLUs (16x48x48 images, two strided), its loss a mean
    square, plain gradient descent: written to ``path`` (returned). Each layer's input is read by
    its filter gradient and by the ReLU gradient below, around the input gradient."""
    with v1_training_graph(path) as (tf, v1, graph):
        h = v1.placeholder(tf.float32, [16, 48, 48, 3], name="images")
        for k, (width, stride) in enumerate(((24, 1), (32, 1), (32, 2), (48, 1), (48, 2), (64, 1))):
            w = v1.get_variable(f"w{k}", [3, 3, h.shape[-1], width], use_resource=True,
                                initializer=v1.glorot_uniform_initializer(seed=k))
            h = tf.nn.relu(tf.nn.conv2d(h, w, stride, "SAME"))
        graph.loss = tf.reduce_mean(tf.square(tf.reduce_mean(h, [1, 2])))
    return path


def trained_alike(steps, variables, feeds, output=lambda out: out) -> list:
    """Each of ``steps`` (callables) run on ``feeds`` (argument tuples), each from the variables'
    values as they are now: per step, (the bytes of ``output`` of each call, the bytes of the
    variables after). Two steps that train alike give equal entries."""
    import numpy as np

    start = [v.numpy() for v in variables]
    runs = []
    for step in steps:
        for v, value in zip(variables, start):
            v.assign(value)
        runs.append(([np.asarray(output(step(*args))).tobytes() for args in feeds],
                     [v.numpy().tobytes() for v in variables]))
    return runs


def assert_within_fidelity(stand_in, model, predicted: int, low: float = 0.97) -> None:
    """The fidelity target (the prediction P within -3% and +10% of the real need) checked with
    two real runs on ``stand_in``: one step of ``model`` fits at P / 0.97 (P / ``low``) and runs
    out of memory at P / 1.10."""
    from lmscli.prove.standin import MIB

    above = -(-int(predicted / low) // MIB) * MIB
    below = int(predicted / 1.10) // MIB * MIB
    assert stand_in.run(model.meta_graph, model.fetches, above, runs=1).fits, f"needs more than {above:,} (P {predicted:,})"
    assert not stand_in.run(model.meta_graph, model.fetches, below, runs=1).fits, f"fits in {below:,} (P {predicted:,})"


def stacked_tf2_rnn(path, batch=64, steps=48, features=32, units=192, layers=3):
    """Three tanh RNN layers in TensorFlow 2's control flow, each reading the sequence the one
    before wrote (``TensorArray`` unstack, write, stack), as a tf_keras ``SimpleRNN`` stack builds
    them: its loops accumulate every intermediate of the cell (TensorFlow does so while a Keras
    layer is built), of which the gradient pops only the state; the others are dropped when the
    loop ends, leaving a hole beside each state the gradient keeps."""
    from lmscli.tfimport import tensorflow

    tensorflow()
    from tensorflow.python.ops import control_flow_util_v2 as cfv2

    was = cfv2._EXPERIMENTAL_OUTPUT_ALL_INTERMEDIATES_OVERRIDE
    cfv2.set_output_all_intermediates(True)
    try:
        with v1_training_graph(path, control_flow_v2=True) as (tf, v1, graph):
            init = v1.glorot_uniform_initializer(seed=1)
            x = v1.placeholder(tf.float32, [batch, steps, features], name="inputs")
            y = v1.placeholder(tf.float32, [steps, batch, 10], name="labels")
            seq = tf.transpose(x, [1, 0, 2])
            for n in range(layers):
                w = v1.get_variable(f"w{n}", [seq.shape[-1], units], initializer=init, use_resource=True)
                u = v1.get_variable(f"u{n}", [units, units], initializer=init, use_resource=True)
                b = v1.get_variable(f"b{n}", [units], initializer=v1.zeros_initializer(), use_resource=True)
                xs = tf.TensorArray(tf.float32, size=steps).unstack(seq)

                def body(t, h, out, xs=xs, w=w, u=u, b=b):
                    h = tf.tanh(tf.nn.bias_add(tf.matmul(xs.read(t), w), b) + tf.matmul(h, u))
                    return t + 1, h, out.write(t, h)

                _, _, out = tf.while_loop(lambda t, *_: t < steps, body,
                                          [tf.constant(0), tf.zeros([batch, units]),
                                           tf.TensorArray(tf.float32, size=steps)])
                seq = out.stack()
            d = v1.get_variable("d", [units, 10], initializer=init, use_resource=True)
            logits = tf.reshape(tf.matmul(tf.reshape(seq, [-1, units]), d), [steps, batch, 10])
            graph.loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
    finally:
        cfv2.set_output_all_intermediates(was)
    return path
