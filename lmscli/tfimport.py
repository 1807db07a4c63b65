"""Import TensorFlow lazily and quietly.

TensorFlow's C++ runtime writes start-up chatter (oneDNN and absl notices) on file descriptor 2
while it is imported, whatever ``TF_CPP_MIN_LOG_LEVEL`` says once Python has started. The CLI
promises one clear line on stderr, so the import runs with descriptor 2 pointed at /dev/null
(unless ``LMS_DEBUG=1``). Every module that needs TensorFlow calls :func:`tensorflow` first.
"""

from __future__ import annotations

import os
import sys


def tensorflow():
    """Return the ``tensorflow`` module, importing it silently the first time."""
    module = sys.modules.get("tensorflow")
    if module is not None:
        return module
    from lmscli.timing import phase

    with phase("import TensorFlow"):
        return _import()


def _import():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.environ.get("LMS_DEBUG") == "1":
        import tensorflow as tf

        return tf
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        import tensorflow as tf
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    tf.get_logger().setLevel("ERROR")
    return tf
