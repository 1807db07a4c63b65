#!/usr/bin/env python3
"""Train a Keras 3 model with a TensorFlow 2 custom loop, rewritten by lms, and prove the rewrite
changes nothing: the same steps from the same state give bit-identical losses and variables.

    .venv/bin/python docs/examples/tf2_train.py                       # 3 steps at 80% of the peak
    .venv/bin/python docs/examples/tf2_train.py --gpu-mem 12GiB --steps 100 --image-size 224

The step is an ordinary ``tf.function`` (GradientTape, model, optimizer); ``lmscli.tf2.rewrite``
takes its concrete function and returns a callable that trains the same variables. Exit code 0
when both runs agree bit for bit, 4 when they differ (as ``lms verify``).
"""

from __future__ import annotations

import argparse
import os
import sys

# TensorFlow's own CPU kernels: oneDNN's choose by memory alignment, which a rewrite may change
# (on a GPU this does not matter).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build(image_size: int, batch: int, width: int):
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    layers = keras.layers
    inputs = keras.Input((image_size, image_size, 3))
    h = layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    for _ in range(3):
        u = layers.Conv2D(width, 3, padding="same", activation="relu")(h)
        u = layers.Conv2D(width, 3, padding="same")(u)
        h = layers.Activation("relu")(layers.Add()([h, u]))
    h = layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, layers.Dense(10)(h))
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    specs = (tf.TensorSpec([batch, image_size, image_size, 3]), tf.TensorSpec([batch, 10]))
    return model, optimizer, train_step, specs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-mem", default="80%", help="GPU memory to plan for: 12GiB, or N%% of the step's peak")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args(argv)

    import numpy as np

    from lmscli import tf2
    from lmscli.units import format_size

    model, optimizer, train_step, specs = build(args.image_size, args.batch, args.width)
    concrete = train_step.get_concrete_function(*specs)  # traces the step (the optimizer makes its slots)
    fitted = tf2.rewrite(concrete, gpu_mem=args.gpu_mem, reserve=0.0)
    predicted = fitted.plan.predicted
    print(f"lms: {fitted.report.summary()}")
    # (both figures of the step as written; TensorFlow's optimizations change what it runs, and the
    # plan is judged on that graph: its figure comes apart)
    print(f"lms: peak as written {format_size(predicted['peak_bytes_without_plan'])} -> "
          f"{format_size(predicted['peak_bytes'])}" + (
              f"; as TensorFlow runs it, with the plan, {format_size(predicted['run_peak_bytes'])}"
              if predicted.get("run_peak_bytes") else "") + f" (budget {format_size(predicted['budget_bytes'])})")

    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal(specs[0].shape).astype(np.float32),
                np.eye(10, dtype=np.float32)[rng.integers(0, 10, args.batch)]) for _ in range(args.steps)]
    variables = list(model.variables) + list(optimizer.variables)
    start = [v.numpy() for v in variables]

    runs = {}
    for label, step in (("original", train_step), ("rewritten", fitted)):
        for v, value in zip(variables, start):
            v.assign(value)
        losses = [float(step(x, y)) for x, y in batches]
        runs[label] = (losses, [v.numpy() for v in variables])
        print(f"{label:>9}: losses " + ", ".join(f"{loss:.6f}" for loss in losses))
    (a_losses, a_vars), (b_losses, b_vars) = runs["original"], runs["rewritten"]
    same = a_losses == b_losses and all(np.array_equal(a, b) for a, b in zip(a_vars, b_vars))
    print("bit-identical: losses and all variables" if same else "DIFFERENT results")
    return 0 if same else 4


if __name__ == "__main__":
    sys.exit(main())
