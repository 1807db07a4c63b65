#!/usr/bin/env python3
"""A TensorFlow 2 training step exported as a SavedModel: ``python tf2_step.py OUT_DIR``.

A Keras 3 CNN (a convolution and batch norm updating its moving averages, four residual blocks,
max pooling, dropout, SGD with momentum) trained by a ``tf.function`` with a ``GradientTape``; its residual blocks are a nested
``tf.function``, so the step's graph lives in the function library: the signature ``train``
(images, labels -> loss) is one ``StatefulPartitionedCall`` whose body calls the step, whose body
calls the blocks' forward and backward functions. No train_op collection, no variable
collections: the variables are ``VarHandleOp``s whose values are in the checkpoint.

Run by ``generate.py`` in a process of its own: TensorFlow numbers the functions it creates per
process, so a fresh process gives the same names (and bytes) every time. ``fingerprint.pb`` (a
random id) is not written.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH, SIZE, CHANNELS, CLASSES, WIDTH, BLOCKS = 8, 32, 3, 10, 32, 4


class Step(tf.Module):
    def __init__(self):
        super().__init__()
        layers = keras.layers
        self.stem = layers.Conv2D(WIDTH, 3, padding="same", use_bias=False)
        self.bn = layers.BatchNormalization()
        self.blocks = [(layers.Conv2D(WIDTH, 3, padding="same", activation="relu"),
                        layers.Conv2D(WIDTH, 3, padding="same")) for _ in range(BLOCKS)]
        self.drop = layers.Dropout(0.2, seed=3)
        self.head = layers.Dense(CLASSES)
        self.optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        self._forward(tf.zeros([BATCH, SIZE, SIZE, CHANNELS]), self._block)  # builds the layers, eagerly
        self.optimizer.build(self.trainable)
        self.dropout_seed = self.drop.seed_generator.state  # tracked, so the SavedModel keeps it

    @property
    def trainable(self):
        found = self.stem.trainable_variables + self.bn.trainable_variables + self.head.trainable_variables
        for a, b in self.blocks:
            found += a.trainable_variables + b.trainable_variables
        return found

    def _block(self, h, index):
        a, b = self.blocks[index]
        return tf.nn.relu(h + b(a(h)))

    @tf.function
    def block(self, h, index):
        return self._block(h, index)

    def _forward(self, x, block):
        h = tf.nn.relu(self.bn(self.stem(x), training=True))
        for i in range(len(self.blocks)):
            h = block(h, i)
        h = self.drop(tf.nn.max_pool2d(h, 2, 2, "SAME"), training=True)
        return self.head(tf.reduce_mean(h, axis=[1, 2]))

    @tf.function(input_signature=[tf.TensorSpec([BATCH, SIZE, SIZE, CHANNELS], tf.float32, name="images"),
                                  tf.TensorSpec([BATCH, CLASSES], tf.float32, name="labels")])
    def train(self, images, labels):
        with tf.GradientTape() as tape:
            logits = self._forward(images, self.block)
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels, logits))
        grads = tape.gradient(loss, self.trainable)
        self.optimizer.apply_gradients(zip(grads, self.trainable))
        return {"loss": loss}


def main(out: str) -> int:
    keras.utils.set_random_seed(0)
    step = Step()
    tf.saved_model.save(step, out, signatures={"train": step.train})
    fingerprint = os.path.join(out, "fingerprint.pb")
    if os.path.exists(fingerprint):
        os.remove(fingerprint)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
