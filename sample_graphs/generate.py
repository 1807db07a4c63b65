#!/usr/bin/env python3
"""Deterministic TF1-style sample graphs for ``lms``.

Run as a script to (re)write the committed sample set, or to write one graph
of any shape for memory benchmarks::

    python sample_graphs/generate.py                      # whole sample set
    python sample_graphs/generate.py --out DIR --only mlp,cnn
    python sample_graphs/generate.py --list
    python sample_graphs/generate.py --model resnet50 --image-size 2000 --batch 1 --out /tmp/r.meta
    python sample_graphs/generate.py --model unet3d --volume 128 --batch 1 --out /tmp/u.meta
    python sample_graphs/generate.py --model synthetic --nodes 60000 --out /tmp/s.meta
    python sample_graphs/generate.py --model transformer --seq 512 --layers 4 --out /tmp/t.meta
    python sample_graphs/generate.py --model densenet --image-size 128 --growth 32 --out /tmp/d.meta
    python sample_graphs/generate.py --check sample_graphs/*.meta   # one training step each

Import it to build graphs in memory::

    sys.path.insert(0, "sample_graphs")        # or load it with importlib
    from generate import build, write, synthetic
    meta = build('resnet50', image_size=2000, batch=1)   # MetaGraphDef
    write('unet3d', '/tmp/u.meta', volume=128)
    meta = synthetic(60000)

Graphs are only built and exported, never run, so huge shapes build quickly.
Every graph is built in its own ``tf.Graph`` with graph seed 0 and an explicit
seed on every random op, and files are serialised deterministically, so two
runs give byte-identical files whatever the order of generation.

This module does not depend on the ``lmscli`` package.
"""

import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from google.protobuf import text_format  # noqa: E402
from tensorflow.core.protobuf import control_flow_pb2  # noqa: E402
from tensorflow.core.protobuf import meta_graph_pb2  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

v1 = tf.compat.v1

# Default shapes of every model (the committed sample set uses these).
DEFAULTS = {
    "mlp": dict(batch=32, input_dim=784, hidden=(512, 256), classes=10),
    "cnn": dict(batch=8, image_size=32, channels=3, classes=10),
    "resnet50": dict(batch=2, image_size=64, channels=3, classes=1000),
    "unet3d": dict(batch=1, volume=32, channels=1, base_filters=8, levels=4),
    "unknown_batch": dict(image_size=28, channels=1, classes=10),
    "while_rnn": dict(batch=4, steps=8, input_dim=16, hidden=32, classes=10),
    "stack_rnn": dict(batch=64, steps=128, input_dim=64, hidden=256, classes=10),
    "cond_cnn": dict(batch=4, image_size=16, channels=3, classes=10),
    "cond_branch": dict(batch=4, image_size=32, channels=3, classes=10, depth=6),
    "synthetic": dict(nodes=10000, batch=8, width=32),
    "frozen_cnn": dict(batch=1, image_size=32, channels=3, classes=10),
    "two_gpu_cnn": dict(batch=8, image_size=32, channels=3, classes=10),
    "transformer": dict(batch=2, seq=32, d_model=64, heads=4, ffn=256, layers=2),
    "densenet": dict(batch=2, image_size=32, channels=3, classes=10, growth=12, blocks=3, layers_per_block=4),
}

MODELS = tuple(DEFAULTS)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


class _Net:
    """Creates variables with fixed, increasing initializer seeds."""

    def __init__(self, seed=0):
        self._seed = seed * 100000

    def seed(self):
        self._seed += 1
        return self._seed

    def weight(self, name, shape, fan_in):
        init = v1.truncated_normal_initializer(
            stddev=math.sqrt(2.0 / max(1, fan_in)), seed=self.seed()
        )
        return v1.get_variable(name, shape, tf.float32, initializer=init, use_resource=True)

    def const_var(self, name, shape, value, trainable=True):
        init = v1.constant_initializer(value)
        return v1.get_variable(
            name, shape, tf.float32, initializer=init, trainable=trainable, use_resource=True
        )

    def dense(self, x, units, name, act=None):
        fan_in = int(x.shape[-1])
        with v1.variable_scope(name):
            w = self.weight("weights", [fan_in, units], fan_in)
            b = self.const_var("biases", [units], 0.0)
            y = tf.nn.bias_add(tf.matmul(x, w), b)
            return act(y) if act is not None else y

    def conv2d(self, x, filters, k, name, stride=1, bias=True, act=tf.nn.relu):
        cin = int(x.shape[-1])
        with v1.variable_scope(name):
            w = self.weight("weights", [k, k, cin, filters], k * k * cin)
            y = tf.nn.conv2d(x, w, strides=[1, stride, stride, 1], padding="SAME")
            if bias:
                b = self.const_var("biases", [filters], 0.0)
                y = tf.nn.bias_add(y, b)
            return act(y) if act is not None else y

    def conv3d(self, x, filters, k, name, act=tf.nn.relu):
        cin = int(x.shape[-1])
        with v1.variable_scope(name):
            w = self.weight("weights", [k, k, k, cin, filters], k * k * k * cin)
            b = self.const_var("biases", [filters], 0.0)
            y = tf.nn.bias_add(tf.nn.conv3d(x, w, strides=[1] * 5, padding="SAME"), b)
            return act(y) if act is not None else y

    def up3d(self, x, filters, name):
        """Transposed 3D convolution doubling every spatial size (needs a fixed shape)."""
        b_, d, h, w_, cin = [int(s) for s in x.shape]
        with v1.variable_scope(name):
            w = self.weight("weights", [2, 2, 2, filters, cin], 8 * cin)
            b = self.const_var("biases", [filters], 0.0)
            y = tf.nn.conv3d_transpose(
                x, w, output_shape=[b_, 2 * d, 2 * h, 2 * w_, filters],
                strides=[1, 2, 2, 2, 1], padding="SAME",
            )
            return tf.nn.relu(tf.nn.bias_add(y, b))

    def batch_norm(self, x, name, momentum=0.9):
        """FusedBatchNorm in training mode plus moving-average update ops."""
        c = int(x.shape[-1])
        with v1.variable_scope(name):
            gamma = self.const_var("gamma", [c], 1.0)
            beta = self.const_var("beta", [c], 0.0)
            mov_mean = self.const_var("moving_mean", [c], 0.0, trainable=False)
            mov_var = self.const_var("moving_variance", [c], 1.0, trainable=False)
            y, mean, var = v1.nn.fused_batch_norm(
                x, gamma, beta, epsilon=1.001e-5, is_training=True, name="FusedBatchNorm"
            )
            for mv, stat, nm in ((mov_mean, mean, "update_mean"), (mov_var, var, "update_var")):
                upd = mv.assign_sub((mv - stat) * (1.0 - momentum), read_value=False, name=nm)
                v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, upd)
        return y


def _softmax_loss(logits, labels):
    xent = tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return tf.identity(tf.reduce_mean(xent), name="loss")


def _finish(loss, optimizer):
    """Adds the training op and the ``train_op`` collection.

    Any UPDATE_OPS (batch-norm moving averages) are grouped with the apply op
    into ``train_op`` rather than made control inputs of every gradient op.
    """
    train_op = optimizer.minimize(loss, name="apply_gradients")
    updates = v1.get_collection(v1.GraphKeys.UPDATE_OPS)
    train_op = tf.group(train_op, *updates, name="train_op")
    v1.add_to_collection("train_op", train_op)
    return train_op


@contextlib.contextmanager
def _control_flow_v1():
    """Builds with control flow v1 (Enter/Exit/Switch/Merge), then restores the old mode."""
    was_v2 = v1.control_flow_v2_enabled()
    v1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2:
            v1.enable_control_flow_v2()


# --------------------------------------------------------------------------
# model bodies (called inside a fresh graph)
# --------------------------------------------------------------------------


def _mlp(net, batch, input_dim, hidden, classes):
    x = v1.placeholder(tf.float32, [batch, input_dim], name="inputs")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")
    h = x
    for i, units in enumerate(hidden):
        h = net.dense(h, int(units), "dense%d" % (i + 1), act=tf.nn.relu)
    logits = net.dense(h, classes, "logits")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.GradientDescentOptimizer(0.01))
    return {"inputs": x, "labels": y, "loss": loss}


def _cnn(net, batch, image_size, channels, classes):
    x = v1.placeholder(tf.float32, [batch, image_size, image_size, channels], name="images")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")
    h = net.conv2d(x, 32, 3, "conv1")
    h = net.conv2d(h, 32, 3, "conv2")
    h = tf.nn.max_pool2d(h, 2, 2, "SAME", name="pool1")
    h = net.conv2d(h, 64, 3, "conv3")
    h = net.conv2d(h, 64, 3, "conv4")
    h = tf.nn.max_pool2d(h, 2, 2, "SAME", name="pool2")
    h = net.conv2d(h, 64, 3, "conv5")
    flat = int(np.prod([int(s) for s in h.shape[1:]]))
    h = tf.reshape(h, [batch, flat], name="flatten")
    h = net.dense(h, 128, "fc1", act=tf.nn.relu)
    logits = net.dense(h, classes, "logits")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.MomentumOptimizer(0.01, 0.9))
    return {"images": x, "labels": y, "loss": loss}


def _resnet50(net, batch, image_size, channels, classes, weight_decay=1e-4):
    x = v1.placeholder(tf.float32, [batch, image_size, image_size, channels], name="images")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")

    def conv_bn(h, filters, k, stride, name, relu=True):
        h = net.conv2d(h, filters, k, name, stride=stride, bias=False, act=None)
        h = net.batch_norm(h, name + "_bn")
        return tf.nn.relu(h, name=name + "_relu") if relu else h

    def bottleneck(h, filters, stride, project, name):
        with v1.variable_scope(name):
            if project:
                shortcut = conv_bn(h, 4 * filters, 1, stride, "shortcut", relu=False)
            else:
                shortcut = h
            r = conv_bn(h, filters, 1, 1, "conv1")
            r = conv_bn(r, filters, 3, stride, "conv2")  # v1.5: stride on the 3x3
            r = conv_bn(r, 4 * filters, 1, 1, "conv3", relu=False)
            return tf.nn.relu(r + shortcut)

    h = conv_bn(x, 64, 7, 2, "conv1")
    h = tf.nn.max_pool2d(h, 3, 2, "SAME", name="pool1")
    for s, (blocks, filters) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        for b in range(blocks):
            stride = 2 if (b == 0 and s > 0) else 1
            h = bottleneck(h, filters, stride, b == 0, "stage%d_block%d" % (s + 1, b + 1))
    h = tf.reduce_mean(h, axis=[1, 2], name="global_pool")
    logits = net.dense(h, classes, "fc")
    xent = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
    # L2 weight decay on conv and dense weights (not on batch-norm parameters).
    decay = [tf.nn.l2_loss(v) for v in v1.trainable_variables() if v.name.endswith("weights:0")]
    loss = tf.identity(xent + weight_decay * tf.add_n(decay), name="loss")
    _finish(loss, v1.train.MomentumOptimizer(0.01, 0.9))
    return {"images": x, "labels": y, "loss": loss}


def _unet3d(net, batch, volume, channels, base_filters, levels):
    if volume % (2 ** (levels - 1)):
        raise ValueError("volume %d must be divisible by %d" % (volume, 2 ** (levels - 1)))
    shape = [batch, volume, volume, volume, channels]
    x = v1.placeholder(tf.float32, shape, name="images")
    y = v1.placeholder(tf.float32, [batch, volume, volume, volume, 1], name="labels")
    skips = []
    h = x
    for lvl in range(levels):
        f = base_filters * 2 ** lvl
        with v1.variable_scope("down%d" % (lvl + 1)):
            h = net.conv3d(h, f, 3, "conv_a")
            h = net.conv3d(h, f, 3, "conv_b")
        if lvl < levels - 1:
            skips.append(h)
            h = tf.nn.max_pool3d(h, 2, 2, "SAME", name="pool%d" % (lvl + 1))
    for lvl in reversed(range(levels - 1)):
        f = base_filters * 2 ** lvl
        with v1.variable_scope("up%d" % (lvl + 1)):
            h = net.up3d(h, f, "upconv")
            h = tf.concat([skips[lvl], h], axis=-1, name="concat")
            h = net.conv3d(h, f, 3, "conv_a")
            h = net.conv3d(h, f, 3, "conv_b")
    logits = net.conv3d(h, 1, 1, "logits", act=None)
    xent = tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits)
    loss = tf.identity(tf.reduce_mean(xent), name="loss")
    _finish(loss, v1.train.AdamOptimizer(1e-3))
    return {"images": x, "labels": y, "loss": loss}


def _unknown_batch(net, image_size, channels, classes):
    if image_size % 4:
        raise ValueError("image_size must be divisible by 4")
    x = v1.placeholder(tf.float32, [None, image_size, image_size, channels], name="images")
    y = v1.placeholder(tf.float32, [None, classes], name="labels")
    h = net.conv2d(x, 16, 3, "conv1")
    h = tf.nn.max_pool2d(h, 2, 2, "SAME", name="pool1")
    h = net.conv2d(h, 32, 3, "conv2")
    h = tf.nn.max_pool2d(h, 2, 2, "SAME", name="pool2")
    flat = (image_size // 4) ** 2 * 32
    h = tf.reshape(h, [-1, flat], name="flatten")  # batch-agnostic
    h = net.dense(h, 64, "fc1", act=tf.nn.relu)
    logits = net.dense(h, classes, "logits")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.GradientDescentOptimizer(0.01))
    return {"images": x, "labels": y, "loss": loss}


def _while_rnn(net, batch, steps, input_dim, hidden, classes):
    x = v1.placeholder(tf.float32, [batch, steps, input_dim], name="inputs")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")
    with v1.variable_scope("rnn"):
        wx = net.weight("w_input", [input_dim, hidden], input_dim + hidden)
        wh = net.weight("w_hidden", [hidden, hidden], input_dim + hidden)
        b = net.const_var("biases", [hidden], 0.0)
        xs = v1.TensorArray(tf.float32, size=steps, name="inputs_ta")
        xs = xs.unstack(tf.transpose(x, [1, 0, 2]))

        def cond(t, h):
            return t < steps

        def body(t, h):
            x_t = xs.read(t)
            h_new = tf.tanh(tf.matmul(x_t, wx) + tf.matmul(h, wh) + b)
            return t + 1, h_new

        t0 = tf.constant(0, name="t0")
        h0 = tf.zeros([batch, hidden], name="h0")
        _, h = v1.while_loop(cond, body, [t0, h0], name="loop")
    logits = net.dense(h, classes, "logits")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.GradientDescentOptimizer(0.05))
    return {"inputs": x, "labels": y, "loss": loss}


def _cond_cnn(net, batch, image_size, channels, classes):
    x = v1.placeholder(tf.float32, [batch, image_size, image_size, channels], name="images")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")
    pred = v1.placeholder_with_default(True, [], name="use_branch_a")
    h = net.conv2d(x, 16, 3, "conv1")
    with v1.variable_scope("branch_a"):
        wa = net.weight("weights", [3, 3, 16, 16], 9 * 16)
    with v1.variable_scope("branch_b"):
        wb = net.weight("weights", [5, 5, 16, 16], 25 * 16)

    def branch_a():
        return tf.nn.relu(tf.nn.conv2d(h, wa, strides=1, padding="SAME"))

    def branch_b():
        return tf.nn.elu(tf.nn.conv2d(h, wb, strides=1, padding="SAME"))

    h = v1.cond(pred, branch_a, branch_b, name="branch")
    h = tf.nn.max_pool2d(h, 2, 2, "SAME", name="pool1")
    h = net.conv2d(h, 32, 3, "conv2")
    flat = int(np.prod([int(s) for s in h.shape[1:]]))
    h = tf.reshape(h, [batch, flat], name="flatten")
    logits = net.dense(h, classes, "logits")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.MomentumOptimizer(0.01, 0.9))
    return {"images": x, "labels": y, "loss": loss}


def _cond_branch(net, batch, image_size, channels, classes, depth):
    """A v1 cond between the stem and the classifier: its true branch is a deep residual stack,
    its false branch one 1x1 conv, so the backward pass starts inside the true branch's gradient,
    where the step peaks. Variables are made outside the cond (as TF1 code sharing them does);
    the predicate defaults to True."""
    x = v1.placeholder(tf.float32, [batch, image_size, image_size, channels], name="images")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")
    pred = v1.placeholder_with_default(True, [], name="use_deep_branch")
    h = net.conv2d(x, 32, 3, "stem")
    with v1.variable_scope("deep"):
        ws = [net.weight("conv%d/weights" % i, [3, 3, 32, 32], 9 * 32) for i in range(depth)]
    with v1.variable_scope("shallow"):
        w1 = net.weight("conv/weights", [1, 1, 32, 32], 32)

    def deep():
        t = h
        for i, w in enumerate(ws):
            u = tf.nn.conv2d(t, w, 1, "SAME", name="conv%d" % i)
            u = tf.nn.relu(u) if i % 2 == 0 else tf.nn.elu(u)
            t = t + u if i % 2 == 1 else u
        return tf.reduce_mean(t, axis=[1, 2], name="pool")

    def shallow():
        return tf.reduce_mean(tf.nn.relu(tf.nn.conv2d(h, w1, 1, "SAME", name="conv")), axis=[1, 2], name="pool")

    h = v1.cond(pred, deep, shallow, name="branch")
    logits = net.dense(h, classes, "logits")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.MomentumOptimizer(0.01, 0.9))
    return {"images": x, "labels": y, "loss": loss}


def _two_gpu_cnn(net, batch, image_size, channels, classes):
    """Data parallel over two GPUs: variables on the host, one tower per GPU on half the batch,
    gradients averaged on the host (the classic TF1 multi-tower pattern)."""
    x = v1.placeholder(tf.float32, [batch, image_size, image_size, channels], name="images")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")
    widths = (channels, 32, 32, 64, 64, 64)
    with tf.device("/device:CPU:0"):
        convs = []
        for i in range(5):
            with v1.variable_scope("conv%d" % (i + 1)):
                convs.append((net.weight("weights", [3, 3, widths[i], widths[i + 1]], 9 * widths[i]),
                              net.const_var("biases", [widths[i + 1]], 0.0)))
        flat = (image_size // 4) ** 2 * widths[-1]
        with v1.variable_scope("logits"):
            dense = (net.weight("weights", [flat, classes], flat), net.const_var("biases", [classes], 0.0))
    opt = v1.train.MomentumOptimizer(0.01, 0.9)
    tower_losses, tower_grads = [], []
    for k, (xk, yk) in enumerate(zip(tf.split(x, 2, name="split_images"), tf.split(y, 2, name="split_labels"))):
        with tf.device("/device:GPU:%d" % k), v1.name_scope("tower%d" % k):
            h = xk
            for i, (w, b) in enumerate(convs):
                h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w, 1, "SAME"), b))
                if i in (1, 3):
                    h = tf.nn.max_pool2d(h, 2, 2, "SAME")
            h = tf.reshape(h, [batch // 2, flat])
            logits = tf.nn.bias_add(tf.matmul(h, dense[0]), dense[1])
            loss_k = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=yk, logits=logits))
            tower_losses.append(loss_k)
            tower_grads.append(opt.compute_gradients(loss_k, colocate_gradients_with_ops=True))
    with tf.device("/device:CPU:0"):
        loss = tf.identity(tf.add_n(tower_losses) / 2.0, name="loss")
        averaged = [(tf.add_n([g for g, _ in pair]) / 2.0, pair[0][1]) for pair in zip(*tower_grads)]
        train_op = tf.group(opt.apply_gradients(averaged, name="apply_gradients"), name="train_op")
    v1.add_to_collection("train_op", train_op)
    return {"images": x, "labels": y, "loss": loss}


def _transformer(net, batch, seq, d_model, heads, ffn, layers):
    """A pre-LN transformer encoder without embeddings, regressing float targets (MSE), Adam."""
    if d_model % heads:
        raise ValueError("d_model %d must be divisible by heads %d" % (d_model, heads))
    dh = d_model // heads
    x = v1.placeholder(tf.float32, [batch, seq, d_model], name="inputs")
    y = v1.placeholder(tf.float32, [batch, seq, d_model], name="labels")

    def layer_norm(h, name):
        with v1.variable_scope(name):
            gamma = net.const_var("gamma", [d_model], 1.0)
            beta = net.const_var("beta", [d_model], 0.0)
            mean, var = tf.nn.moments(h, [-1], keepdims=True)
            return (h - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta

    def split_heads(t):  # [batch*seq, d_model] -> [batch, heads, seq, dh]
        return tf.transpose(tf.reshape(t, [batch, seq, heads, dh]), [0, 2, 1, 3])

    def self_attention(h, name):
        with v1.variable_scope(name):
            q = split_heads(net.dense(h, d_model, "query"))
            k = split_heads(net.dense(h, d_model, "key"))
            v = split_heads(net.dense(h, d_model, "value"))
            scores = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(dh))
            probs = tf.nn.softmax(scores, name="probs")  # [batch, heads, seq, seq]
            ctx = tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3])
            ctx = tf.reshape(ctx, [batch * seq, d_model])
            return net.dense(ctx, d_model, "output")

    h = tf.reshape(x, [batch * seq, d_model], name="flatten")  # tokens as rows
    for i in range(layers):
        with v1.variable_scope("layer%d" % (i + 1)):
            h = h + self_attention(layer_norm(h, "ln1"), "attention")
            f = net.dense(layer_norm(h, "ln2"), ffn, "ffn1", act=tf.nn.gelu)
            h = h + net.dense(f, d_model, "ffn2")
    h = net.dense(layer_norm(h, "final_ln"), d_model, "head")
    out = tf.reshape(h, [batch, seq, d_model], name="outputs")
    loss = tf.identity(tf.reduce_mean(tf.math.squared_difference(out, y)), name="loss")
    _finish(loss, v1.train.AdamOptimizer(1e-3))
    return {"inputs": x, "labels": y, "loss": loss}


def _densenet(net, batch, image_size, channels, classes, growth, blocks, layers_per_block):
    """DenseNet: each layer's output concatenated to its block's input; Momentum."""
    x = v1.placeholder(tf.float32, [batch, image_size, image_size, channels], name="images")
    y = v1.placeholder(tf.float32, [batch, classes], name="labels")

    def bn_relu_conv(h, filters, k, name):
        with v1.variable_scope(name):
            h = tf.nn.relu(net.batch_norm(h, "bn"), name="relu")
            return net.conv2d(h, filters, k, "conv", bias=False, act=None)

    h = net.conv2d(x, 2 * growth, 3, "conv0", bias=False, act=None)
    for b in range(blocks):
        with v1.variable_scope("block%d" % (b + 1)):
            for i in range(layers_per_block):
                new = bn_relu_conv(h, growth, 3, "layer%d" % (i + 1))
                h = tf.concat([h, new], axis=-1, name="concat%d" % (i + 1))
        if b < blocks - 1:  # transition: halve the channels and the image
            with v1.variable_scope("transition%d" % (b + 1)):
                h = bn_relu_conv(h, int(h.shape[-1]) // 2, 1, "compress")
                h = tf.nn.avg_pool2d(h, 2, 2, "SAME", name="pool")
    h = tf.nn.relu(net.batch_norm(h, "final_bn"), name="final_relu")
    h = tf.reduce_mean(h, axis=[1, 2], name="global_pool")
    logits = net.dense(h, classes, "fc")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.MomentumOptimizer(0.01, 0.9))
    return {"images": x, "labels": y, "loss": loss}


def _synthetic_blocks(net, blocks, batch, width):
    """A deep residual stack of small dense blocks with a loss and GradientDescent."""
    x = v1.placeholder(tf.float32, [batch, width], name="inputs")
    y = v1.placeholder(tf.float32, [batch, 10], name="labels")
    h = x
    for i in range(blocks):
        h = h + net.dense(h, width, "block%d" % i, act=tf.tanh)
    logits = net.dense(h, 10, "logits")
    loss = _softmax_loss(logits, y)
    _finish(loss, v1.train.GradientDescentOptimizer(0.01))
    return {"inputs": x, "labels": y, "loss": loss}


_BODIES = {
    "mlp": _mlp,
    "cnn": _cnn,
    "resnet50": _resnet50,
    "unet3d": _unet3d,
    "unknown_batch": _unknown_batch,
    "while_rnn": _while_rnn,
    "stack_rnn": _while_rnn,  # the same net over 128 steps: its gradient stacks are most of the peak
    "cond_cnn": _cond_cnn,
    "cond_branch": _cond_branch,
    "two_gpu_cnn": _two_gpu_cnn,
    "transformer": _transformer,
    "densenet": _densenet,
}
DEVICE_MODELS = ("two_gpu_cnn",)  # models whose ops keep the devices they were built on


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------


def _shape_args(model, kwargs):
    if model not in DEFAULTS:
        raise ValueError("unknown model %r (known: %s)" % (model, ", ".join(MODELS)))
    args = dict(DEFAULTS[model])
    unknown = sorted(set(kwargs) - set(args))
    if unknown:
        raise TypeError(
            "model %r takes no %s (it takes: %s)"
            % (model, ", ".join(unknown), ", ".join(sorted(args)))
        )
    args.update({k: v for k, v in kwargs.items() if v is not None})
    return args


def _build_graph(model, args):
    """Builds a training model in a fresh graph; returns (graph, endpoints)."""
    g = tf.Graph()
    cf = _control_flow_v1() if model in ("while_rnn", "stack_rnn", "cond_cnn", "cond_branch") else contextlib.nullcontext()
    with cf, g.as_default():
        v1.set_random_seed(0)
        net = _Net()
        if model == "synthetic":
            ends = _synthetic_blocks(net, args["blocks"], args["batch"], args["width"])
        else:
            ends = _BODIES[model](net, **args)
    return g, ends


_CONTEXT_PROTOS = {
    "while_context": control_flow_pb2.WhileContextDef,
    "cond_context": control_flow_pb2.CondContextDef,
}


def _export(graph, keep_devices=False):
    # No node has a device, except in DEVICE_MODELS. (clear_devices=True would take a per-node
    # Python path in export_meta_graph that is quadratic on very large graphs.)
    with graph.as_default():  # export_meta_graph refuses to run eagerly
        meta = v1.train.export_meta_graph(graph=graph, clear_devices=False)
    for node in meta.graph_def.node:
        if node.device and not keep_devices:
            node.device = ""
    # v1 control-flow contexts are stored as serialised protos holding maps
    # (external_values), whose byte order varies from process to process.
    # Re-serialise them deterministically.
    for key, cls in _CONTEXT_PROTOS.items():
        if key in meta.collection_def:
            values = meta.collection_def[key].bytes_list.value
            for i, data in enumerate(values):
                ctx = cls()
                ctx.ParseFromString(data)
                values[i] = ctx.SerializeToString(deterministic=True)
    return meta


def build(model, **shape_kwargs):
    """Builds one training graph and returns its ``MetaGraphDef``.

    ``model`` is one of ``mlp cnn resnet50 unet3d unknown_batch while_rnn
    stack_rnn cond_cnn two_gpu_cnn transformer densenet synthetic``; shape keywords (see
    ``DEFAULTS``) override the defaults, e.g. ``build('resnet50',
    image_size=2000, batch=1)``, ``build('unet3d', volume=128)``,
    ``build('transformer', seq=256, layers=4)``, ``build('synthetic', nodes=60000)``.
    ``frozen_cnn`` is an inference GraphDef: use ``build_frozen_cnn``.
    """
    if model == "frozen_cnn":
        raise ValueError("frozen_cnn is a GraphDef, not a MetaGraphDef: use build_frozen_cnn()")
    if model == "synthetic":
        a = _shape_args(model, shape_kwargs)
        return synthetic(a["nodes"], batch=a["batch"], width=a["width"])
    args = _shape_args(model, shape_kwargs)
    if "hidden" in args and not isinstance(args["hidden"], int):
        args["hidden"] = tuple(int(u) for u in args["hidden"])
    graph, _ = _build_graph(model, args)
    return _export(graph, keep_devices=model in DEVICE_MODELS)


def synthetic(num_nodes, batch=8, width=32):
    """A deep synthetic training graph with about ``num_nodes`` nodes.

    A residual stack of dense(width)+tanh blocks, softmax loss and
    GradientDescent. The block count is calibrated from two tiny builds so
    the node count is within half a block (19 nodes) of ``num_nodes``.
    """
    def count(blocks):
        g, _ = _build_graph("synthetic", dict(blocks=blocks, batch=batch, width=width))
        return len(g.as_graph_def().node)

    n1, n3 = count(1), count(3)
    per_block = (n3 - n1) / 2.0
    base = n1 - per_block
    blocks = max(1, int(round((num_nodes - base) / per_block)))
    graph, _ = _build_graph("synthetic", dict(blocks=blocks, batch=batch, width=width))
    return _export(graph)


def build_frozen_cnn(batch=1, image_size=32, channels=3, classes=10):
    """A frozen inference ``GraphDef`` of a small CNN (weights are Const nodes).

    Input placeholder ``input`` [batch, image_size, image_size, channels],
    output node ``output`` (softmax probabilities).
    """
    if image_size % 4:
        raise ValueError("image_size must be divisible by 4")
    rng = np.random.RandomState(1234)

    def const(name, shape, fan_in):
        w = rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)
        return tf.constant(w.astype(np.float32), name=name)

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [batch, image_size, image_size, channels], name="input")
        h = x
        cin = channels
        for i, cout in enumerate((8, 16)):
            w = const("conv%d/weights" % (i + 1), [3, 3, cin, cout], 9 * cin)
            b = tf.constant(np.zeros(cout, np.float32) + 0.01, name="conv%d/biases" % (i + 1))
            h = tf.nn.conv2d(h, w, strides=1, padding="SAME", name="conv%d/Conv2D" % (i + 1))
            h = tf.nn.relu(tf.nn.bias_add(h, b, name="conv%d/BiasAdd" % (i + 1)),
                           name="conv%d/Relu" % (i + 1))
            h = tf.nn.max_pool2d(h, 2, 2, "SAME", name="pool%d" % (i + 1))
            cin = cout
        flat = (image_size // 4) ** 2 * cin
        h = tf.reshape(h, [batch, flat], name="flatten")
        w = const("fc/weights", [flat, classes], flat)
        b = tf.constant(np.zeros(classes, np.float32), name="fc/biases")
        logits = tf.nn.bias_add(tf.matmul(h, w, name="fc/MatMul"), b, name="fc/BiasAdd")
        tf.nn.softmax(logits, name="output")
    return g.as_graph_def()


def _serialize(msg, path):
    text = path.endswith((".txt", ".pbtxt"))
    data = text_format.MessageToString(msg).encode("utf-8") if text else \
        msg.SerializeToString(deterministic=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def write_savedmodel(path, model="mlp", **shape_kwargs):
    """Writes a TF1 SavedModel (tag ``train``) of a training graph, variables initialised.

    The MetaGraphDef keeps the ``train_op`` collection; the signature ``train``
    maps the placeholders to ``loss``.
    """
    args = _shape_args(model, shape_kwargs)
    graph, ends = _build_graph(model, args)
    if os.path.exists(path):
        shutil.rmtree(path)
    sm = v1.saved_model
    with graph.as_default():
        inputs = {k: sm.utils.build_tensor_info(t) for k, t in ends.items() if k != "loss"}
        sig = sm.signature_def_utils.build_signature_def(
            inputs=inputs,
            outputs={"loss": sm.utils.build_tensor_info(ends["loss"])},
            method_name="tensorflow/supervised/training",
        )
        config = v1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)
        with v1.Session(graph=graph, config=config) as sess:
            sess.run(v1.global_variables_initializer())
            builder = sm.Builder(path)
            builder.add_meta_graph_and_variables(
                sess, ["train"], signature_def_map={"train": sig}, clear_devices=True
            )
            builder.save(as_text=False)
    return path


def write(model, path, **kwargs):
    """Builds ``model`` and writes it to ``path``; returns ``path``.

    Binary protobuf unless ``path`` ends with ``.txt``/``.pbtxt`` (text format).
    ``frozen_cnn`` writes a GraphDef; every other model a MetaGraphDef.
    ``model='savedmodel'`` writes a SavedModel directory of the MLP.
    """
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    if model == "savedmodel":
        return write_savedmodel(path, **kwargs)
    if model == "frozen_cnn":
        msg = build_frozen_cnn(**_shape_args(model, kwargs))
    else:
        msg = build(model, **kwargs)
    return _serialize(msg, path)


# --------------------------------------------------------------------------
# the default sample set
# --------------------------------------------------------------------------

# name -> (files written, description)
SAMPLES = {
    "mlp": (["mlp.meta"], "MLP 784-512-256-10, batch 32, GradientDescent"),
    "mlp_text": (["mlp.meta.txt"], "mlp.meta as a text-format MetaGraphDef"),
    "mlp_savedmodel": (["mlp_savedmodel"], "SavedModel (tag 'train') of the MLP, variables initialised"),
    "cnn": (["cnn.meta"], "5-conv CNN, 2 max-pools, dense head, batch 8 32x32x3, Momentum"),
    "resnet50": (["resnet50.meta"], "ResNet-50 v1.5 with FusedBatchNorm, batch 2 64x64x3, Momentum"),
    "unet3d": (["unet3d.meta"], "4-level 3D U-Net, base 8 filters, batch 1 32^3x1, Adam"),
    "frozen_cnn": (["frozen_cnn.pb", "frozen_cnn.pbtxt"], "frozen inference GraphDef of a small CNN"),
    "unknown_batch": (["unknown_batch.meta"], "small CNN with batch dimension None, GradientDescent"),
    "while_rnn": (["while_rnn.meta"], "RNN in a v1 while_loop (8 steps), GradientDescent"),
    "stack_rnn": (["stack_rnn.meta"], "the same RNN over 128 steps, batch 64, hidden 256: gradient stacks are the peak"),
    "cond_cnn": (["cond_cnn.meta"], "small CNN with a v1 cond between two conv branches, Momentum"),
    "cond_branch": (["cond_branch.meta"], "CNN with a v1 cond, a 6-conv residual branch (the peak) or a 1x1 conv, Momentum"),
    "two_gpu_cnn": (["two_gpu_cnn.meta"], "5-conv CNN data parallel on /device:GPU:0 and GPU:1, variables on CPU:0, Momentum"),
    "tf2_step": (["tf2_step"], "TensorFlow 2 SavedModel: a Keras 3 CNN's tf.function step (nested functions), signature 'train'"),
}


def write_sample(name, out_dir):
    """Writes one entry of the default sample set into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, f) for f in SAMPLES[name][0]]
    if name == "mlp_text":
        _serialize(build("mlp"), files[0])
    elif name == "mlp_savedmodel":
        write_savedmodel(files[0], "mlp")
    elif name == "frozen_cnn":
        gd = build_frozen_cnn()
        for f in files:
            _serialize(gd, f)
    elif name == "tf2_step":
        # A process of its own: TensorFlow numbers functions per process (see tf2_step.py).
        if os.path.exists(files[0]):
            shutil.rmtree(files[0])
        subprocess.run([sys.executable, os.path.join(HERE, "tf2_step.py"), files[0]], check=True)
    else:
        _serialize(build(name), files[0])
    return files


def write_samples(out_dir=HERE, only=None, verbose=True):
    """Writes the default sample set (or the names in ``only``) into ``out_dir``."""
    names = list(SAMPLES) if not only else list(only)
    for n in names:
        if n not in SAMPLES:
            raise ValueError("unknown sample %r (known: %s)" % (n, ", ".join(SAMPLES)))
    written = []
    for n in names:
        t0 = time.time()
        files = write_sample(n, out_dir)
        written += files
        if verbose:
            print("%-15s %6.1fs  %s" % (n, time.time() - t0, ", ".join(files)))
    return written


# --------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------


def load_meta(path):
    """Reads a binary or text MetaGraphDef."""
    meta = meta_graph_pb2.MetaGraphDef()
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith((".txt", ".pbtxt")):
        text_format.Parse(data.decode("utf-8"), meta)
    else:
        meta.ParseFromString(data)
    return meta


def check_meta(path, unknown_dim=2, seed=0):
    """Imports a training MetaGraphDef, initialises it, runs ONE training step on CPU.

    Placeholders get random feeds (unknown dims set to ``unknown_dim``).
    Returns (loss, seconds for the step).
    """
    meta = load_meta(path)
    rng = np.random.RandomState(seed)
    g = tf.Graph()
    with g.as_default():
        v1.train.import_meta_graph(meta)
        train_op = v1.get_collection("train_op")[0]
        loss = g.get_tensor_by_name("loss:0")
        feeds = {}
        for op in g.get_operations():
            if op.type == "Placeholder":
                t = op.outputs[0]
                shape = [unknown_dim if d is None else d for d in t.shape.as_list()]
                feeds[t] = rng.random_sample(shape).astype(t.dtype.as_numpy_dtype)
        init = v1.global_variables_initializer()
        config = v1.ConfigProto(inter_op_parallelism_threads=1, allow_soft_placement=True)
        with v1.Session(graph=g, config=config) as sess:
            sess.run(init)
            t0 = time.time()
            _, value = sess.run([train_op, loss], feeds)
            dt = time.time() - t0
    return float(value), dt


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------

_CLI_SHAPES = (
    ("batch", int, "batch size"),
    ("image_size", int, "image height and width (cnn, resnet50, unknown_batch, cond_cnn, frozen_cnn, densenet)"),
    ("channels", int, "input channels"),
    ("classes", int, "number of classes"),
    ("volume", int, "3D volume edge (unet3d)"),
    ("base_filters", int, "filters of the first level (unet3d)"),
    ("levels", int, "levels (unet3d)"),
    ("input_dim", int, "input features (mlp, while_rnn, stack_rnn)"),
    ("hidden", str, "hidden sizes, comma separated (mlp) or one size (while_rnn, stack_rnn)"),
    ("steps", int, "time steps (while_rnn, stack_rnn)"),
    ("nodes", int, "approximate node count (synthetic)"),
    ("width", int, "block width (synthetic)"),
    ("seq", int, "sequence length (transformer)"),
    ("d_model", int, "model width (transformer)"),
    ("heads", int, "attention heads, dividing d_model (transformer)"),
    ("ffn", int, "feed-forward hidden size (transformer)"),
    ("layers", int, "encoder layers (transformer)"),
    ("growth", int, "growth rate: filters of each layer (densenet)"),
    ("blocks", int, "dense blocks (densenet)"),
    ("layers_per_block", int, "layers of each dense block (densenet)"),
)


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Write deterministic TF1-style sample graphs for lms.",
        epilog="Without --model, writes the default sample set into --out (a folder, "
        "default: this script's folder). With --model, writes one graph to --out "
        "(a file; .txt/.pbtxt for text format; default MODEL.meta).",
    )
    p.add_argument("--out", help="output folder (sample set) or file (--model)")
    p.add_argument("--only", help="comma-separated sample names to write")
    p.add_argument("--list", action="store_true", help="list the sample set and exit")
    p.add_argument("--model", choices=MODELS + ("savedmodel",), help="write one graph of this model")
    for name, typ, hlp in _CLI_SHAPES:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, help=hlp)
    p.add_argument("--check", nargs="+", metavar="META",
                   help="import each training MetaGraphDef and run one step on CPU")
    a = p.parse_args(argv)
    tf.get_logger().setLevel("ERROR")  # deprecation warnings of the v1 APIs

    if a.list:
        for n, (files, desc) in SAMPLES.items():
            print("%-15s %-34s %s" % (n, ", ".join(files), desc))
        for n in MODELS:  # benchmark models, not in the sample set
            if n not in SAMPLES:
                shape = ", ".join("%s=%s" % kv for kv in DEFAULTS[n].items())
                print("%-15s %-34s %s" % (n, "(--model only)", shape))
        return 0

    if a.check:
        v1.disable_eager_execution()
        bad = 0
        for path in a.check:
            try:
                loss, dt = check_meta(path)
                ok = math.isfinite(loss)
                bad += not ok
                print("%-40s loss %-12.6g step %.2fs%s" % (path, loss, dt, "" if ok else "  NOT FINITE"))
            except Exception as e:  # report and go on
                bad += 1
                print("%-40s FAILED: %s: %s" % (path, type(e).__name__, str(e).splitlines()[0]))
        return 1 if bad else 0

    shape_kwargs = {}
    for name, _, _ in _CLI_SHAPES:
        val = getattr(a, name)
        if val is None:
            continue
        if name == "hidden":
            parts = [int(s) for s in val.split(",") if s]
            val = parts[0] if a.model in ("while_rnn", "stack_rnn") else tuple(parts)
        shape_kwargs[name] = val

    v1.disable_eager_execution()
    if a.model:
        if a.only:
            p.error("--only applies to the sample set, not to --model")
        default = a.model + ("_savedmodel" if a.model == "savedmodel" else
                             ".pb" if a.model == "frozen_cnn" else ".meta")
        out = a.out or default
        t0 = time.time()
        try:
            if a.model == "savedmodel":
                write_savedmodel(out, "mlp", **shape_kwargs)
            else:
                write(a.model, out, **shape_kwargs)
        except (TypeError, ValueError) as e:
            p.error(str(e))
        size = os.path.getsize(out) if os.path.isfile(out) else sum(
            os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs)
        print("wrote %s (%d bytes) in %.1fs" % (out, size, time.time() - t0))
        return 0

    if shape_kwargs:
        p.error("shape options need --model")
    only = [s.strip() for s in a.only.split(",") if s.strip()] if a.only else None
    if only:
        by_file = {f: n for n, (fs, _) in SAMPLES.items() for f in fs}
        only = [by_file.get(n, n) for n in only]
    t0 = time.time()
    try:
        write_samples(a.out or HERE, only)
    except ValueError as e:
        p.error(str(e))
    print("done in %.1fs" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
