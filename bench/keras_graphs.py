"""tf_keras-built training graphs for the speed benchmark (issue: a rewrite in seconds).

ResNet-50 (batch 8, 128x128) and DenseNet-121 (batch 4, 128x128) from ``tf_keras.applications``,
built in TF1 graph mode (learning phase 1, Momentum), saved as MetaGraphDefs with a ``train_op``
collection, like the project's samples. tf_keras is not a dependency of lms: ``make bench``
installs it into the venv with ``--no-deps`` (its metadata asks for the full ``tensorflow`` wheel).

    python bench/keras_graphs.py            # writes bench/out/keras_resnet50_b8_128.meta, ...

Each graph is built in a fresh process (Keras numbers its layers process-wide), deterministically.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
GRAPHS = {  # file stem: (application, batch, image size)
    "keras_resnet50_b8_128": ("ResNet50", 8, 128),
    "keras_densenet121_b4_128": ("DenseNet121", 4, 128),
}


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tf_keras") is not None


def build(stem: str) -> Path:
    """Build one graph (cached: an existing file is kept) and return its path."""
    path = OUT / f"{stem}.meta"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, __file__, "--one", stem], check=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return path


def _build_here(stem: str) -> None:
    import tensorflow as tf
    import tf_keras

    app, batch, size = GRAPHS[stem]
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    tf_keras.utils.set_random_seed(0)
    v1.set_random_seed(0)
    tf_keras.backend.set_learning_phase(1)
    x = v1.placeholder(tf.float32, [batch, size, size, 3], name="images")
    y = v1.placeholder(tf.float32, [batch, 10], name="labels")
    model = getattr(tf_keras.applications, app)(weights=None, input_tensor=x, classes=10, classifier_activation=None)
    loss = tf.identity(tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=model.output)),
                       name="loss")
    apply = v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, var_list=model.trainable_weights,
                                                           name="apply_gradients")
    v1.add_to_collection("train_op", tf.group(apply, *model.updates, name="train_op"))
    meta = v1.train.export_meta_graph(graph=v1.get_default_graph())
    path = OUT / f"{stem}.meta"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(meta.SerializeToString(deterministic=True))
    os.replace(tmp, path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        _build_here(sys.argv[2])
    else:
        for name in GRAPHS:
            print(build(name))
