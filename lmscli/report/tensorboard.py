"""``lms rewrite --tensorboard-logdir DIR``: the rewritten graph as a TensorBoard event file.

The file holds the graph's GraphDef (TensorBoard's Graphs tab) and the whole MetaGraphDef, written
by TensorFlow's own ``FileWriter``. It is written in a hidden directory inside ``DIR`` and moved into
place when complete, so TensorBoard never reads half a file. Its name carries a time stamp and the
host name, as every event file's does; its graph is the same for the same input and options.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from lmscli.errors import InputError


def write_graph(meta_graph, logdir: str) -> str:
    """Write ``meta_graph`` (a MetaGraphDef) as an event file in ``logdir`` (created if missing);
    returns the file's path."""
    from lmscli.tfimport import tensorflow

    tf = tensorflow()
    try:
        os.makedirs(logdir, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{logdir}: cannot create the TensorBoard log directory ({exc.strerror})") from None
    if not os.path.isdir(logdir):
        raise InputError(f"{logdir}: not a directory")
    staging = tempfile.mkdtemp(prefix=".lms-events-", dir=logdir)
    try:
        with tf.Graph().as_default():  # FileWriter is a graph-mode (v1) writer
            writer = tf.compat.v1.summary.FileWriter(staging, filename_suffix=".lms")
            writer.add_event(tf.compat.v1.Event(graph_def=meta_graph.graph_def.SerializeToString(deterministic=True)))
            writer.add_meta_graph(meta_graph)
            writer.close()
        names = sorted(os.listdir(staging))
        if len(names) != 1:
            raise InputError(f"{logdir}: TensorFlow wrote {len(names)} event files, expected one")
        path = os.path.join(logdir, names[0])
        os.replace(os.path.join(staging, names[0]), path)
        return path
    finally:
        shutil.rmtree(staging, ignore_errors=True)
