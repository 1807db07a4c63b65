"""The stand-in's server processes: ``python -m lmscli.prove._server`` runs a zygote.

The zygote imports TensorFlow once (seconds) but creates no allocator, session or server, then
forks one child per request, a JSON line on stdin::

    {"job": "gpu", "cluster": {...}, "env": {...}, "log": PATH, "ready": PATH,
     "inter": 1, "intra": 1, "preallocate": BYTES, "stats": PATH or null}

and answers with the child's pid on a line of stdout. A request with ``"optimize": PATH`` (a
serialized MetaGraphDef), ``"fetches"`` and ``"out"`` forks a child that writes to ``out`` what
Grappler's default optimizations make of that graph in this process's configuration (see
:func:`_optimize`) and exits. The child applies ``env`` (TensorFlow reads
its allocator's variables when the allocator is created, which is after the fork), sends its
stderr to ``log``, optionally gives its allocator one free region of ``preallocate`` bytes (as a
GPU's allocator has; see :func:`_preallocate`), starts a ``tf.distribute.Server`` for task 0 of
``job`` and then creates the file ``ready``. With ``stats`` it answers each ``stats`` line on that
Unix socket with its allocator's bytes in use and peak (since the pre-allocation, less what it keeps).

Children die with the zygote (``PR_SET_PDEATHSIG``); the zygote kills its children and exits when
its stdin closes (the client is gone). Children are reaped automatically (``SIGCHLD`` ignored), so
a dead child's pid disappears at once; a pid is only ever killed while it is still a child.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

FIRST_REGION = 2 << 20  # the BFC allocator's first region when it may grow


def _import_tensorflow():
    import tensorflow as tf

    return tf


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _redirect(log: str) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def _preallocate(tf, limit: int) -> list:
    """Give the allocator one free region of exactly ``limit`` bytes, as a GPU's allocator holds one
    region of its whole memory (the process must be started with a limit of ``limit`` plus
    :data:`FIRST_REGION`). Without this, regions grow by doubling and a tensor that does not fit
    the free end of one region cannot use it: fragmentation no GPU has.

    The allocator's first region is 2 MiB whatever is allocated first; the returned tensors fill
    it (keep them alive), then an allocation of ``limit`` bytes makes the second region, freed at once.
    """
    held = [tf.raw_ops.Empty(shape=[1], dtype=tf.uint8)]  # creates the first region
    used = tf.config.experimental.get_memory_info("CPU:0")["current"]
    held.append(tf.raw_ops.Empty(shape=[FIRST_REGION - used - 256], dtype=tf.uint8))  # 256: its shape tensor
    tf.raw_ops.Empty(shape=[limit], dtype=tf.uint8)
    return held


def _listen(path: str) -> socket.socket:
    if os.path.exists(path):
        os.remove(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    return listener


def _serve_stats(tf, listener: socket.socket, base: int) -> None:
    """Answer each line on a Unix socket (one client at a time) with the allocator's bytes in use
    and peak, less ``base`` (what the server holds for itself)."""
    while True:
        conn, _ = listener.accept()
        with conn, conn.makefile("rw") as stream:
            for _line in stream:
                info = tf.config.experimental.get_memory_info("CPU:0")
                stream.write(json.dumps({key: value - base for key, value in info.items()}) + "\n")
                stream.flush()


def _serve(tf, request: dict) -> None:
    started = time.monotonic()
    os.environ.update(request.get("env", {}))
    faulthandler.enable()
    held, base = [], 0
    if request.get("preallocate"):
        held = _preallocate(tf, int(request["preallocate"]))
        tf.config.experimental.reset_memory_stats("CPU:0")  # the peak counts what the server does
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=request.get("inter", 1),
                                      intra_op_parallelism_threads=request.get("intra", 1))
    server = tf.distribute.Server(tf.train.ClusterSpec(request["cluster"]), job_name=request["job"], task_index=0,
                                  config=config, start=True)
    if request.get("stats"):
        threading.Thread(target=_serve_stats, args=(tf, _listen(request["stats"]), base), daemon=True).start()
    ready = request["ready"]
    with open(ready + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "seconds": time.monotonic() - started}, f)
    os.rename(ready + ".tmp", ready)
    server.join()
    del held


def _optimize(tf, request: dict) -> None:
    """Write to ``request["out"]`` (atomically) ``G`` and the GraphDef that Grappler's default
    optimizations make of the MetaGraphDef in ``request["optimize"]``, or ``N`` if Grappler refuses
    it. The servers' sessions run Grappler in this configuration (oneDNN off), which decides what
    its remapper fuses on a CPU."""
    del tf  # (imported by the zygote)
    from tensorflow.core.protobuf import meta_graph_pb2

    from lmscli import grappler

    meta = meta_graph_pb2.MetaGraphDef()
    with open(request["optimize"], "rb") as f:
        meta.ParseFromString(f.read())
    optimized = grappler.optimize(meta, request["fetches"])
    out = request["out"]
    with open(out + ".tmp", "wb") as f:
        f.write(b"N" if optimized is None else b"G" + optimized.SerializeToString())
    os.rename(out + ".tmp", out)


def _child(tf, request: dict, parent: int) -> None:
    """Run one server (or one Grappler optimization); never returns."""
    try:
        _die_with_parent(parent)
        _redirect(request["log"])
        if "optimize" in request:
            _optimize(tf, request)
            os._exit(0)
        _serve(tf, request)
    except BaseException:  # noqa: B036 - the child must never return into the zygote's loop
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)


def is_child(pid: int, parent: int) -> bool:
    """Whether ``pid`` is a running (not zombie) child of ``parent``: a pid freed by a dead child
    may already belong to another process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return len(fields) > 1 and fields[0] != "Z" and fields[1] == str(parent)


def kill_child(pid: int, parent: int) -> None:
    """SIGKILL ``pid`` if it is still a child of ``parent``."""
    if is_child(pid, parent):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    tf = _import_tensorflow()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    me = os.getpid()
    children = []
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(tf, request, me)
            children = [c for c in children if is_child(c, me)] + [pid]
            print(pid, flush=True)
    finally:
        for pid in children:
            kill_child(pid, me)


if __name__ == "__main__":
    main()
