"""A stand-in GPU with a real, hard memory limit: TensorFlow's GPU allocator in a CPU process.

A process started with ``TF_CPU_ALLOCATOR_USE_BFC=true`` and ``TF_CPU_BFC_MEM_LIMIT_IN_MB=N`` gets
the BFC allocator (the class GPUs use) as its CPU allocator, limited to ``N << 20`` bytes
(TensorFlow multiplies by ``1 << 20``: N is in MiB, so limits work to 1 MiB). A step that needs
more fails with TensorFlow's own out-of-memory error, as on a GPU.

Every run gets two fresh server processes on 127.0.0.1, one task each: job ``gpu`` (the stand-in,
limited) and job ``host`` (unlimited). Every node runs on the stand-in except nodes the graph places
on a CPU (lms's swap nodes), which run on the host; Grappler's GPU-only swap kernels become Identity
on the side their output lives on. A swap-out is then a real gRPC transfer out of the limited
process and a swap-in a real allocation back into it. Nodes colocated with another (``_class``)
follow it, as TensorFlow's importer does, so no attribute is stripped. The sessions' master is the
host: Grappler's constant folding and the feeds' parsing use host memory as on a GPU machine,
feeds reach the stand-in as transfers, and a stand-in that dies makes the step fail at once (with
the master on it, the client would wait out its deadline).

Processes: one zygote per :class:`StandIn` imports TensorFlow once (2-4 s here) and forks each
server in about 0.1 s (:mod:`lmscli.prove._server`). So no state survives between runs (variables,
fragmentation), a new limit is just another fork, and executor orders differ between runs. The
stand-in's allocator holds one region of exactly the limit, as a GPU's does; it runs kernels one
at a time (one inter-op, one intra-op thread), with TensorFlow's own kernels (oneDNN off), and logs
to a private file: the executor each op it starts, the allocator each request. A thread watches
that file and the allocator's memory maps (written at each allocation that finds no free chunk)
and kills the stand-in at the first failed allocation (see :class:`_Watch`), so disguised
out-of-memory failures (a Const that cannot be allocated, a crash) are classified by the
allocator's own word, and a run that runs out of memory ends at once instead of after
TensorFlow's 10 s retry.

Measured here (2 cores): the zygote starts in 2-4 s, once; a pair of servers in 0.03-0.08 s; a run
that fits takes 0.2-0.6 s on the small samples (about 4.5 s on the ResNet-50 sample, whose log is
4 MB), one that runs out of memory as long as the step up to it.

Convolution gradients run TensorFlow's Eigen kernels on the stand-in (:func:`scratchless`). The
CPU's default ones take a col buffer of up to 30 MiB from the allocator while they run, which must
find one free chunk: on small conv nets it set the step's need (a two-loss net needed 54 MiB with
them, 29 without) and made every plan between the lower bound and the need run out of memory in
some runs for lack of one large enough hole, where a GPU's cuDNN picks an algorithm whose
workspace fits what is free.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, replace

import numpy as np

from lmscli import timing
from lmscli.timing import timed
from lmscli.errors import InputError, LmsError
from lmscli.prove._server import FIRST_REGION, is_child, kill_child
from lmscli.emit.rewriter import is_lms_node
from lmscli.tfimport import tensorflow
from lmscli.prove.steps import (GPU_COPY_OPS, StepRun, _check_cpu_kernels, check_feeds, compare, default_loss,
                                failed_run, feeds, import_graph, map_gpu_ops)
from lmscli.prove.steps import error_line as _error_line
from lmscli.prove.steps import oom_node as _oom_node
from lmscli.units import format_size

MIB = 1 << 20
STANDIN_JOB, HOST_JOB = "gpu", "host"
STANDIN_DEVICE = f"/job:{STANDIN_JOB}/replica:0/task:0/device:CPU:0"
HOST_DEVICE = f"/job:{HOST_JOB}/replica:0/task:0/device:CPU:0"
RETRY_S = 10.0  # TensorFlow's allocator retries a failing allocation this long
_OOM_LINE = ") ran out of memory trying"
_NOT_A_FAILURE = "caller indicates that this is not a failure"  # a tolerated failure (a kernel with a fallback)
_PROCESS_NODE = "] Process node: "  # the executor's log line (TF_CPP_VMODULE=executor=1) as it starts an op
_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
_REQUEST = re.compile(r"\] AllocateRaw \S+ +(\d+)( \S+)?$")  # the allocator's log of a request (and its address)
WAIT_S = 1.0  # an allocation waiting longer than this for memory to be returned is out of memory
_LOG_HEAD = re.compile(r"^[IWEF]\d{4} \d+:\d+:(\d+\.\d+) +(\d+) ")  # glog: time since the epoch, thread
_MAP = "memory-map"  # the prefix of the allocator's memory maps (TF_BFC_MEMORY_DUMP) in a server's files
_POLL_S = 0.05
_MAX_LIMIT = 1 << 40
READ_GROUP_BYTES = 1 << 20  # the variables read after the steps in one run, at most (one larger alone)
OBSERVE_REGION = 8 << 30  # the allocator's region in an observed step: as good as no limit


class StandInError(LmsError):
    """The stand-in's processes could not start, died, or a step did not finish in time."""


@dataclass(frozen=True)
class StepVerdict:
    """Whether a training step fits under a limit on the stand-in GPU."""

    fits: bool  # every run completed under the limit
    limit_bytes: int | None  # the limit applied (whole MiB); None: no limit
    runs: int  # runs attempted (they stop at the first out-of-memory)
    failures: int  # runs that ran out of memory
    varies: bool  # some runs fit and some did not
    oom_node: str | None  # the op whose allocation failed, if known
    message: str | None  # one line describing the first out-of-memory
    result: StepRun | None  # losses/variables/outputs of the first run that completed
    seconds: float
    peak_bytes: int | None = None  # with peak=True: the allocator's peak bytes in use (initialisation and steps)
    results_differ: str | None = None  # what differs first between completed runs (they should be bit-identical)
    need_bytes: int | None = None  # out of memory: the bytes in use plus the request that failed, when known
    headroom_limit_bytes: int | None = None  # the stand-in judge's second limit (its runs are counted in runs)


@dataclass(frozen=True)
class MinLimit:
    """The smallest limit under which a step fits on the stand-in."""

    limit_bytes: int  # smallest limit (multiple of the resolution) under which every confirming run fit
    probes: tuple[tuple[int, bool], ...]  # (limit_bytes, fits) in the order tried; a confirmation counts once
    varies: bool  # the confirmation found run-to-run variation near the threshold
    seconds: float
    runs: int = 0  # runs made, each with fresh processes (the reference run included)
    reference_peak_bytes: int | None = None  # the unlimited reference run's allocator peak, when one was made


@dataclass
class _Outcome:
    fits: bool
    result: StepRun | None = None
    oom_node: str | None = None
    message: str | None = None
    peak_bytes: int | None = None
    need_bytes: int | None = None  # out of memory: the bytes in use plus the request that failed
    trace: tuple = ()  # each step's StepStats, when traced


class _RunFailed(Exception):
    def __init__(self, error: Exception, phase: str):
        super().__init__(str(error))
        self.error, self.phase = error, phase


class _PortTaken(Exception):
    pass


# ---------------------------------------------------------------- processes
def _wait_gone(pids, parent: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while is_child(pid, parent) and time.monotonic() < deadline:
            time.sleep(0.01)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def read_groups(names, variables, cap: int = READ_GROUP_BYTES):
    """``(names, variables)`` runs to read the variables after the steps in: in order, each of at
    most ``cap`` bytes (a larger variable, or one of unknown size, alone). A read can allocate a
    copy of its variable under the limit (a variable an ``embedding_lookup`` gathers from is read
    by copy); read in one run, all the copies were held at once, and the check's own read needed
    more than the step (QA: an embedding model whose steps fit under 20 MiB ran out of memory
    reading its 4.9 MiB table with its slots)."""
    groups: list[tuple[list, list]] = []
    held = cap
    for name, variable in zip(names, variables):
        shape = variable.shape
        size = (shape.num_elements() * variable.dtype.base_dtype.size
                if shape.is_fully_defined() and variable.dtype.base_dtype.is_numpy_compatible else cap)
        if held + size > cap:
            groups.append(([], []))
            held = 0
        groups[-1][0].append(name)
        groups[-1][1].append(variable)
        held += size
    return [(tuple(n), v) for n, v in groups]


def read_cap(limit_bytes: int | None) -> int:
    """The bytes :func:`read_groups` reads in one run under ``limit_bytes``: a sixteenth of the
    limit, at least :data:`READ_GROUP_BYTES` (each group is a new graph for the master to prune and
    place: 1 MiB groups made a ResNet-50's reads 5.6 s of a 10 s run); all at once without a limit."""
    return max(READ_GROUP_BYTES, limit_bytes // 16) if limit_bytes is not None else 1 << 62


def _last_line(path: str) -> str:
    """The log's last line that says something (errors first)."""
    try:
        with open(path, errors="replace") as f:
            raw = [line.rstrip() for line in f if line.strip() and not line.startswith("WARNING: All log messages")]
    except OSError:
        return "(no log)"
    lines = [line.strip() for line in raw]
    for k in range(len(lines) - 1, -1, -1):
        line = lines[k]
        if line.startswith("Traceback"):  # the exception it ends with, not its first line
            return next((r for r in reversed(raw[k + 1:]) if not r[:1].isspace()), line)
        if (line[:1] in "EF" and line[1:5].isdigit()) or line.startswith("Fatal Python error"):
            return line
    return lines[-1] if lines else "nothing in its log (killed by a signal?)"


@dataclass
class _Server:
    """One server process (a child of the zygote)."""

    pid: int
    parent: int  # the zygote
    job: str
    address: str
    log: str
    ready: str
    stats: str | None = None

    def alive(self) -> bool:
        return is_child(self.pid, self.parent)

    def memory_maps(self) -> list[str]:
        """The allocator's memory maps so far (one per allocation that found no free chunk), oldest first."""
        folder, prefix = os.path.split(self.log[: -len(".log")] + "." + _MAP)
        try:
            names = [n for n in os.listdir(folder) if n.startswith(prefix + "_")]
        except OSError:
            return []
        # <prefix>_<allocator>.<microseconds>
        return [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n.rsplit(".", 1)[1]))]

    def kill(self) -> None:
        kill_child(self.pid, self.parent)

    def peak_bytes(self) -> int:
        """The allocator's peak bytes in use, asked over the server's stats socket."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(self.stats)
                with conn.makefile("rw") as stream:
                    stream.write("stats\n")
                    stream.flush()
                    return int(json.loads(stream.readline())["peak"])
        except (OSError, ValueError, KeyError) as exc:
            raise StandInError(f"could not read the stand-in allocator's peak: {exc}; see {self.log}") from None


@dataclass
class _Pair:
    standin: _Server
    host: _Server

    @property
    def target(self) -> str:
        return "grpc://" + self.host.address

    def dead(self) -> str | None:
        """The job of a server that is no longer running, if any."""
        return next((s.job for s in (self.standin, self.host) if not s.alive()), None)

    def kill(self) -> None:
        self.standin.kill()
        self.host.kill()
        _wait_gone([self.standin.pid, self.host.pid], self.standin.parent)


class _Zygote:
    """The process that has imported TensorFlow and forks server processes on request."""

    def __init__(self, log: str, timeout_s: float):
        self.log = log
        self.children: list[int] = []
        # oneDNN off (BFC with oneDNN crashes); warnings logged (the allocator's out-of-memory line); calls to
        # a dead server fail at once; no real GPU grabbed by a GPU build of TensorFlow.
        # The executor logs each op it starts and the allocator each request (the op and the request
        # that ran out of memory are named by that log).
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="executor=1,bfc_allocator=3",
                   GRPC_FAIL_FAST="true", CUDA_VISIBLE_DEVICES="-1")
        for key in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"):
            env.pop(key, None)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with open(log, "w") as err:
            # (-P: the working directory is not put first on the import path, where a user's
            # bisect.py or random.py would stand in for the standard library's)
            safe = ["-P"] if sys.version_info >= (3, 11) else []
            self.proc = subprocess.Popen([sys.executable, *safe, "-m", "lmscli.prove._server"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, text=True, close_fds=True)
        deadline = time.monotonic() + timeout_s
        while (line := self._readline(deadline - time.monotonic())) != "ready":
            if line is None:  # it died, or is too slow
                self.close()
                raise StandInError(f"the stand-in's zygote process did not start: {_last_line(log)}")

    def _readline(self, timeout_s: float) -> str | None:
        """The next line of the zygote's output, stripped; None at its end or after ``timeout_s``."""
        if timeout_s <= 0 or not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            return None
        line = self.proc.stdout.readline()
        return line.strip() if line else None

    def spawn(self, request: dict) -> int:
        """Fork a server for ``request`` (see :mod:`lmscli.prove._server`); its pid."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise StandInError(f"the stand-in's zygote process is gone: {_last_line(self.log)}") from None
        answer = self._readline(30.0)
        if not answer or not answer.isdigit():
            raise StandInError(f"the stand-in's zygote process did not fork a server: {_last_line(self.log)}")
        self.children.append(int(answer))
        return int(answer)

    def close(self) -> None:
        """Stop every server the zygote forked, then the zygote."""
        zygote = self.proc.pid
        for pid in self.children:
            kill_child(pid, zygote)
        _wait_gone(self.children, zygote)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the zygote exits at the end of its input
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _Watch(threading.Thread):
    """Watches the stand-in during a run and kills it once an allocation has waited too long.

    The stand-in's BFC allocator writes a memory map (``TF_BFC_MEMORY_DUMP``) each time an
    allocation finds no free chunk; TensorFlow then retries it whenever memory is returned, for up
    to 10 s, before logging "ran out of memory". The allocator logs each request and each grant,
    and the executor each op it starts, all with their thread: a thread waiting in that retry logs
    nothing more until its request is granted. So a memory map names a failed attempt, the requests
    in flight then are its candidates, and a candidate is settled by its thread's next line (the
    grant, or a kernel's fallback when the request was optional scratch). An allocation that
    waits more than :data:`WAIT_S` is out of memory: a short wait for a transfer to return its
    memory is what a GPU does too, a long one is not a step that fits. The run is then stopped at
    once (not 10 s later), and the op, the request and the bytes in use are named."""

    def __init__(self, pair: _Pair):
        super().__init__(daemon=True)
        self.pair = pair
        self.oom_line: str | None = None
        self.oom_node: str | None = None  # the op whose allocation waited too long, if an op's
        self.need_bytes: int | None = None  # the bytes in use then plus the request (a floor of the need)
        self.died: str | None = None  # the job of a server that died on its own
        self._offset = 0
        self._node: dict[str, str] = {}  # thread -> the op it last started
        self._pending: dict[str, tuple[int, float]] = {}  # thread -> (bytes, time) of a request not granted
        self._maps = 0  # memory maps seen
        self._failed: list[tuple[float, str, dict]] = []  # unsettled failures: (time, map, candidates)
        self._stopped = threading.Event()

    def scan(self, final: bool = False) -> None:
        """Read the whole lines the stand-in logged since the last scan, then its new memory maps,
        and settle the failures that can be (``final``: the run is over)."""
        try:
            with open(self.pair.standin.log, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        data = data[: data.rfind(b"\n") + 1]
        self._offset += len(data)
        for line in data.decode(errors="replace").splitlines():
            self._read(line)
        maps = self.pair.standin.memory_maps()
        for path in maps[self._maps:]:
            at = _map_time(path)
            self._failed.append((at, path, {t: r for t, r in self._pending.items() if r[1] <= at}))
        self._maps = len(maps)
        self._settle(time.time(), final)

    def _read(self, line: str) -> None:
        head = _LOG_HEAD.match(line)
        if head is None:
            return
        when, thread = float(head.group(1)), head.group(2)
        for _at, _path, candidates in self._failed:
            waiting = candidates.get(thread)
            if waiting is not None and len(waiting) == 2:  # its thread goes on: settled now
                candidates[thread] = (*waiting, when)
        request = _REQUEST.search(line.rstrip()) if "] AllocateRaw " in line else None
        if request is not None and not request.group(2):
            self._pending[thread] = (int(request.group(1)), when)
            return
        self._pending.pop(thread, None)
        if _PROCESS_NODE in line:
            found = _NODE.search(line)
            if found:
                self._node[thread] = found.group(1)
        elif _OOM_LINE in line and _NOT_A_FAILURE not in line and self.oom_line is None:
            self._out_of_memory(line.strip(), _oom_node(line) or self._node.get(thread), None)

    def _settle(self, now: float, final: bool) -> None:
        still = []
        for at, path, candidates in self._failed:
            waiting = {t: c for t, c in candidates.items() if len(c) == 2}
            waited = max([c[2] - at for c in candidates.values() if len(c) == 3] +
                         [now - at for _ in waiting.values()] + [0.0])
            if waited > WAIT_S and self.oom_line is None:
                late = max(waiting.items() or candidates.items(), key=lambda tc: (len(tc[1]) == 2, tc[1][0]))
                thread, (size, *_rest) = late
                in_use = _bytes_in_use(path)
                node = self._node.get(thread)
                what = f" for {node}" if node else " (a tensor arriving from the host)"
                held = f" with {format_size(in_use)} in use" if in_use is not None else ""
                self._out_of_memory(f"ran out of memory trying to allocate {format_size(size)}{what}{held}", node,
                                    in_use + size if in_use is not None else None)
            elif waiting and not final:
                still.append((at, path, candidates))
        self._failed = still

    def _out_of_memory(self, line: str, node: str | None, need: int | None) -> None:
        self.oom_line, self.oom_node, self.need_bytes = line, node, need

    def run(self) -> None:
        while not self._stopped.wait(_POLL_S):
            self.scan()
            if self.oom_line is not None:
                self.pair.standin.kill()
                return
            self.died = self.pair.dead()
            if self.died:
                return

    def stop(self) -> None:
        """Stop watching and read what is left: an allocation that waited too long counts even
        when the step then went on (a concurrent free rescued it)."""
        self._stopped.set()
        self.join()
        self.scan(final=True)


def _map_time(path: str) -> float:
    """When the allocator wrote a memory map (its name ends in microseconds since the epoch)."""
    return int(path.rsplit(".", 1)[1]) / 1e6


def _bytes_in_use(path: str) -> int | None:
    """The allocator's bytes in use in one of its memory maps (a ``MemoryDump``), if readable."""
    try:
        from tensorflow.core.protobuf import bfc_memory_map_pb2

        dump = bfc_memory_map_pb2.MemoryDump()
        with open(path, "rb") as f:
            dump.ParseFromString(f.read())
        return max(0, int(dump.stats.bytes_in_use) - FIRST_REGION)
    except Exception:  # noqa: BLE001 - a half-written or unreadable map only loses the figure
        return None


# ---------------------------------------------------------------- graphs
def _explicit_cpu(device: str) -> bool:
    device = device.upper()
    return "CPU" in device and "GPU" not in device


def place(meta_graph):
    """A copy of ``meta_graph`` placed for the stand-in: nodes explicitly on a CPU on the host, all
    others (any GPU) on the stand-in; Grappler's GPU-only swap kernels become Identity on the side
    their output lives on (a copy to the host on the host, a copy to the GPU on the stand-in)."""
    kinds = {node.name: node.op for node in meta_graph.graph_def.node if node.op in GPU_COPY_OPS}
    meta, _ = map_gpu_ops(meta_graph)
    for node in meta.graph_def.node:
        if node.name in kinds:
            on_host = GPU_COPY_OPS[kinds[node.name]] == "out"
        else:
            on_host = _explicit_cpu(node.device)
        node.device = HOST_DEVICE if on_host else STANDIN_DEVICE
    _check_cpu_kernels(meta.graph_def)
    _check_dilations(meta.graph_def)
    return scratchless(meta)


# Ops whose CPU kernels (oneDNN off, as on the stand-in) refuse dilation rates above 1; a GPU's
# and oneDNN's run them (a dilated Conv2D itself runs, its gradients do not).
UNDILATED_ON_CPU = frozenset({"Conv2DBackpropFilter", "Conv2DBackpropFilterV2", "Conv2DBackpropInput",
                              "Conv2DBackpropInputV2", "Conv3D", "Conv3DBackpropFilter", "Conv3DBackpropFilterV2",
                              "Conv3DBackpropInput", "Conv3DBackpropInputV2"})


def _check_dilations(graph_def) -> None:
    """Refuse, before any run, a graph the stand-in's CPU kernels cannot run for its dilated
    convolutions (QA r47: a WaveNet with ``conv1d(dilations=...)`` ran 18 s, then failed in the
    gradient's first kernel)."""
    for node in graph_def.node:
        if (node.op in UNDILATED_ON_CPU and node.device == STANDIN_DEVICE
                and any(rate > 1 for rate in node.attr["dilations"].list.i)):
            raise InputError(f"the stand-in cannot run {node.name} ({node.op} with dilation rates "
                             f"{list(node.attr['dilations'].list.i)}): TensorFlow's CPU kernels, which it runs "
                             "without oneDNN, have neither dilated 3D convolutions nor dilated convolution "
                             "gradients (a GPU's have both); `lms verify` without --gpu-mem proves the rewrite's "
                             "results in one process, and `tf.compat.v1.nn.convolution(dilation_rate=...)` and "
                             "`tf.nn.atrous_conv2d` build dilated convolutions the stand-in can run")


# The label of TensorFlow's CPU convolution gradient kernels that use Eigen's tensor contractions
# (no col buffer); the default kernels ("custom") take a col buffer of up to 30 MiB while they run.
EIGEN_LABEL = "eigen_tensor"


@functools.lru_cache(maxsize=1)
def _labelled_ops() -> frozenset:
    """The ops with a CPU kernel labelled :data:`EIGEN_LABEL` in this TensorFlow (none when its
    kernel registry cannot be read: the default kernels then run, scratch and all)."""
    ops = ("Conv2DBackpropFilter", "Conv2DBackpropInput", "Conv3DBackpropFilter", "Conv3DBackpropFilterV2",
           "Conv3DBackpropInput", "Conv3DBackpropInputV2")
    try:
        from tensorflow.python.framework import kernels

        return frozenset(op for op in ops if any(k.device_type == "CPU" and k.label == EIGEN_LABEL
                                                 for k in kernels.get_registered_kernels_for_op(op).kernel))
    except Exception:  # (an internal module: a later TensorFlow may move it)
        return frozenset()


def scratchless(meta_graph):
    """``meta_graph`` (changed in place, and returned) with its convolution gradients on the stand-in
    asking for TensorFlow's Eigen kernels (the ``_kernel`` attribute picks a labelled kernel):
    computed without a col buffer, as a GPU's cuDNN computes them within the workspace that fits.
    Both graphs a proof compares run the same kernels::

        Conv2DBackpropFilter (CPU default: a col buffer of up to 30 MiB while it runs)
        Conv2DBackpropFilter {_kernel: "eigen_tensor"} (no col buffer)
    """
    labelled = _labelled_ops()
    for node in meta_graph.graph_def.node:
        if node.op in labelled and node.device == STANDIN_DEVICE and "_kernel" not in node.attr:
            node.attr["_kernel"].s = EIGEN_LABEL.encode()
    return meta_graph


@dataclass
class _Prepared:
    """A placed graph, imported once and run in many sessions."""

    imported: object  # lmscli.prove.steps.Imported
    produced: list  # fetched output tensors, compared for graphs without variables
    feeds: dict  # (step, batch size) -> feed dict
    feed_values: dict | None = None  # the user's values for placeholders (--feed)

    def feed(self, step: int, batch_size: int) -> dict:
        key = (step, batch_size)
        if key not in self.feeds:
            self.feeds[key] = feeds(self.imported.placeholders, batch_size, step, self.feed_values)
        return self.feeds[key]


def _prepare(meta_graph, fetches, loss: str | None, feed_values: dict | None = None) -> _Prepared:
    meta = place(meta_graph)
    try:
        imported = import_graph(meta, list(fetches), loss or default_loss(meta))
    except LmsError:
        raise
    except Exception as exc:
        raise failed_run(exc) from None
    produced = [] if imported.variables else [t for op in imported.targets for t in op.outputs
                                              if t.dtype.is_numpy_compatible]
    check_feeds(imported.placeholders, feed_values)  # (a --feed naming no placeholder fails before any run)
    return _Prepared(imported, produced, {}, feed_values)


def _mib(num_bytes: int | None) -> str:
    return "no limit" if num_bytes is None else f"{num_bytes / MIB:,.0f} MiB"


def _same_units(size: str) -> str:
    """A size as TensorFlow's allocator writes it ("48.0KiB") as lms writes sizes ("48.00 KiB")."""
    from lmscli.units import parse_size

    try:
        return format_size(parse_size(size))
    except Exception:
        return size


INIT_PHASE = "initialising variables"  # a run's first phase, before any step


def in_initialisation(message: str | None) -> bool:
    """The failure ``message`` of a run came while its variables were initialised, before any step
    ran: no plan of the step changes that need."""
    return bool(message) and f"while {INIT_PHASE}:" in message


def _oom_message(text: str, phase: str, limit_bytes: int | None, node: str | None,
                 need_bytes: int | None = None) -> str:
    """One line from the allocator's log line, TensorFlow's OOM error, or the watch's own finding.
    ``need_bytes``: the bytes in use then plus the request; when the limit holds that much, the
    line says the free memory was in pieces (QA: "allocating 4.50 MiB ... failed (7.06 MiB in
    use)" under 14 MiB read as a contradiction)."""
    size = re.search(r"to allocate ([\d.]+ ?[KMGT]?i?B|\S+)", text)
    tensor = re.search(r"shape\[([^\]]*)\] and type (\w+)", text)
    held = re.search(r"with (.+ in use)", text)
    what = _same_units(size.group(1)) if size else (
        f"a {tensor.group(2)} tensor of shape [{tensor.group(1)}]" if tensor else None)
    detail = f"allocating {what}" if what else "an allocation"
    if node:
        # (a node TensorFlow adds where it splits the graph between the processes, "NAME_S24":
        # QA r39 read it as a node of the graph that did not exist)
        split = re.fullmatch(r"(?:_send_|_recv_)?(.+?)(?:/_\d+)?_S\d+(?:_\d+)?", node)
        # (QA r46: "a transfer of ...ResourceApplyMomentum", an op with no output to send, read as wrong)
        detail += f" for {node}" if split is None else (f" for a transfer between the processes (a node TensorFlow "
                                                        f"named after {split.group(1)})")
    detail += " failed"
    if held:
        detail += f" ({held.group(1)})"
    if need_bytes is not None and limit_bytes is not None and need_bytes <= limit_bytes * 0.98:
        # (2% or more to spare: the figures are rounded; QA r38 read a fixed "2% to spare" as the room left)
        # (QA r45 read "that much in all (6.39 MiB to spare)" as the room left before the request)
        detail += (f": in use and asked for come to {format_size(need_bytes)}, {format_size(limit_bytes - need_bytes)} "
                   "under the limit, but no free chunk was large enough (the free memory was in pieces)")
    return f"out of memory under {_mib(limit_bytes)} while {phase}: {detail}"


# ---------------------------------------------------------------- the stand-in
_OPEN: weakref.WeakSet = weakref.WeakSet()


_SHARED: "StandIn | None" = None


def shared() -> "StandIn":
    """A StandIn shared by the whole process (opened on first use, stopped at exit)."""
    global _SHARED
    if _SHARED is None or _SHARED._closed:
        _SHARED = StandIn()
    return _SHARED


@atexit.register
def _close_all() -> None:
    for standin in list(_OPEN):
        standin.close()


class StandIn:
    """Owns the stand-in's processes. Use it as a context manager: they are always stopped on exit
    (and at interpreter exit as a last resort). Not thread-safe.

    ``optimize=False`` turns Grappler off in the sessions (the graph runs as written);
    ``feed_values`` fills the placeholders it names with those values in every step (``--feed``;
    :func:`lmscli.prove.steps.feeds`), the others get lms's own; ``timeout_s`` bounds every
    session call and every server start (it must exceed the allocator's 10 s retry); ``log_dir``
    keeps the servers' logs (default: a private temporary directory, removed on close).
    """

    def __init__(self, *, optimize: bool = True, timeout_s: float = 120.0, log_dir: str | None = None,
                 feed_values: dict | None = None):
        if timeout_s <= RETRY_S + 5:
            raise InputError(f"timeout_s must exceed {RETRY_S + 5:.0f} s (TensorFlow retries an allocation for 10 s)")
        self.optimize = optimize
        self.feed_values = dict(feed_values or {})
        self.timeout_s = timeout_s
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="lms-standin-")
        self.log_dir = log_dir or self._tmp.name
        os.makedirs(self.log_dir, exist_ok=True)
        self._token = uuid.uuid4().hex[:8]  # names this StandIn's files in a shared log_dir
        self._count = 0
        self._zygote: _Zygote | None = None
        self._closed = False
        self.last_verdict: StepVerdict | None = None  # of the last call of run()
        self.judged: dict = {}  # the tune loop's judge: (graph, limits) -> (its figure, the verdict)
        _OPEN.add(self)

    def __enter__(self) -> "StandIn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process (idempotent)."""
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._closed = True
        _OPEN.discard(self)

    @property
    def pids(self) -> tuple[int, ...]:
        """The zygote's pid and those of every server it forked so far."""
        return () if self._zygote is None else (self._zygote.proc.pid, *self._zygote.children)

    # -------------------------------------------------------- processes
    def _path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{self._token}-{name}")

    def _zygote_process(self) -> _Zygote:
        if self._closed:
            raise StandInError("this StandIn is closed; open a new one")
        if self._zygote is None:
            self._zygote = _Zygote(self._path("zygote.log"), self.timeout_s)
        return self._zygote

    def _start(self, limit_bytes: int | None, stats: bool, bfc: bool = True) -> _Pair:
        """Fork a fresh stand-in (with the limit) and host, both starting at once. ``bfc=False``: the
        stand-in keeps TensorFlow's plain CPU allocator (no limit), whose traces record requested
        bytes (see :meth:`observe`)."""
        for _attempt in range(3):
            try:
                return self._start_once(limit_bytes, stats, bfc)
            except _PortTaken:
                continue
        raise StandInError("could not start the stand-in's servers: their ports were taken three times")

    def _start_once(self, limit_bytes: int | None, stats: bool, bfc: bool) -> _Pair:
        zygote = self._zygote_process()
        self._count += 1
        ports = _free_ports(2)
        cluster = {STANDIN_JOB: [f"127.0.0.1:{ports[0]}"], HOST_JOB: [f"127.0.0.1:{ports[1]}"]}
        name = self._path(f"{self._count}-{STANDIN_JOB}")
        env = {"TF_CPU_ALLOCATOR_USE_BFC": "true" if bfc else "false", "TF_BFC_MEMORY_DUMP": f"{name}.{_MAP}"}
        if limit_bytes is not None and bfc:  # plus the small first region that the pre-allocation fills
            env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str((limit_bytes + FIRST_REGION) // MIB)
        servers: list[_Server] = []
        try:
            for job, job_env, inter, prealloc, sock in ((STANDIN_JOB, env, 1, (limit_bytes or 0) if bfc else 0, stats),
                                                        (HOST_JOB, {}, 2, 0, False)):
                name = self._path(f"{self._count}-{job}")
                request = {"job": job, "cluster": cluster, "env": job_env, "log": name + ".log",
                           "ready": name + ".ready", "inter": inter, "intra": 1, "preallocate": prealloc,
                           "stats": name + ".sock" if sock else None}
                servers.append(_Server(zygote.spawn(request), zygote.proc.pid, job, cluster[job][0], request["log"],
                                       request["ready"], request["stats"]))
            self._wait_ready(servers)
        except BaseException:
            for server in servers:
                server.kill()
            _wait_gone([s.pid for s in servers], zygote.proc.pid)
            raise
        return _Pair(*servers)

    def _wait_ready(self, servers) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not all(os.path.exists(s.ready) for s in servers):
            for server in servers:
                if not os.path.exists(server.ready) and not server.alive():
                    line = _last_line(server.log)
                    if "already in use" in line.lower() or "could not start" in line.lower():
                        raise _PortTaken(line)
                    raise StandInError(f"the stand-in's {server.job} server failed to start: {line}")
            if time.monotonic() > deadline:
                raise StandInError(f"the stand-in's servers did not start within {self.timeout_s:.0f} s; raise timeout_s")
            time.sleep(0.005)

    def grappler(self, meta_graph, fetches):
        """The GraphDef that Grappler's default optimizations make of ``meta_graph`` for a step
        fetching ``fetches`` as the stand-in's sessions run them (in its processes: oneDNN off, so
        Grappler's remapper fuses no batch norm with its activation on a CPU, which it does in a
        process with oneDNN on); None if Grappler refuses the graph."""
        zygote = self._zygote_process()
        self._count += 1
        name = self._path(f"{self._count}-grappler")
        with open(name + ".in", "wb") as f:
            f.write(meta_graph.SerializeToString())
        out = name + ".out"
        try:
            pid = zygote.spawn({"optimize": name + ".in", "fetches": list(fetches), "out": out, "log": name + ".log"})
            deadline = time.monotonic() + self.timeout_s
            while not os.path.exists(out):
                if not is_child(pid, zygote.proc.pid) and not os.path.exists(out):
                    raise StandInError(f"the stand-in's Grappler process failed: {_last_line(name + '.log')}")
                if time.monotonic() > deadline:
                    kill_child(pid, zygote.proc.pid)
                    raise StandInError(f"the stand-in's Grappler process took more than {self.timeout_s:.0f} s; "
                                       "raise timeout_s")
                time.sleep(0.005)
            with open(out, "rb") as f:
                data = f.read()
            os.remove(name + ".log")  # (kept when it failed: the error names it)
        finally:
            for path in (name + ".in", out):
                if os.path.exists(path):
                    os.remove(path)
        if data[:1] != b"G":
            return None
        graph_def = tensorflow().compat.v1.GraphDef()
        graph_def.ParseFromString(data[1:])
        return graph_def

    @property
    def optimizer(self):
        """What a step to run here is prepared with (``prepare(optimizer=)``): :meth:`grappler`
        when this process's Grappler would fuse otherwise (oneDNN on here: it fuses batch norms
        with their ReLUs on a CPU, which the stand-in's processes, oneDNN off, do not), else None
        (this process's Grappler makes the same graph, without a round trip)."""
        from lmscli import grappler

        return self.grappler if grappler.onednn() else None

    # -------------------------------------------------------- one run
    def _session(self, pair: _Pair, graph):
        tf = tensorflow()
        config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
        if not self.optimize:
            config.graph_options.rewrite_options.disable_meta_optimizer = True
        return tf.compat.v1.Session(pair.target, graph=graph, config=config)

    def _train(self, pair: _Pair, prep: _Prepared, batch_size: int, steps: int, traced: list | None = None,
               values: bool = True, group_bytes: int = READ_GROUP_BYTES) -> StepRun:
        """Initialise the variables in one session, run the steps and read the results in another.
        ``traced``: a list that receives each step's StepStats (a full trace of it). ``values=False``
        leaves the variables unread (a run that only asks whether the steps fit: reading a
        ResNet-50's 320 variables and slots, group by group, took longer than its two steps); else
        they are read in groups of at most ``group_bytes`` bytes (:func:`read_groups`)."""
        tf = tensorflow()
        g = prep.imported
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(self.timeout_s * 1000))
        tracing = tf.compat.v1.RunOptions(timeout_in_ms=int(self.timeout_s * 1000),
                                          trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        phase = INIT_PHASE
        try:
            with self._session(pair, g.graph) as sess:
                sess.run(g.init, feed_dict=g.init_feed, options=options)
            phase = "running the step"
            losses, outputs = [], []
            with self._session(pair, g.graph) as sess:
                for step in range(steps):
                    fetch = {"train": g.targets, "outputs": prep.produced}
                    if g.loss is not None:
                        fetch["loss"] = g.loss
                    metadata = tf.compat.v1.RunMetadata() if traced is not None else None
                    out = sess.run(fetch, feed_dict=prep.feed(step, batch_size),
                                   options=tracing if metadata is not None else options, run_metadata=metadata)
                    if metadata is not None:
                        traced.append(metadata.step_stats)
                    if g.loss is not None:
                        losses.append(np.asarray(out["loss"]))
                    if prep.produced:
                        outputs.append({t.name: np.asarray(v) for t, v in zip(prep.produced, out["outputs"])})
                phase = "reading the variables"
                read = {}
                for names, variables in read_groups(g.variable_names, g.variables, group_bytes) if values else ():
                    read.update(zip(names, sess.run(variables, options=options)))
        except tf.errors.OpError as exc:
            raise _RunFailed(exc, phase) from None
        placements = {op.name: op.device for op in g.graph.get_operations() if is_lms_node(op.name)}
        return StepRun(tuple(losses), read, placements, tuple(outputs))

    def _run_once(self, prep: _Prepared, limit_bytes: int | None, batch_size: int, steps: int,
                  peak: bool, trace: bool = False, bfc: bool = True, values: bool = True) -> _Outcome:
        pair = self._start(limit_bytes, peak, bfc=bfc)
        watch = _Watch(pair)
        watch.start()
        traced: list | None = [] if trace else None
        try:
            result = self._train(pair, prep, batch_size, steps, traced, values, read_cap(limit_bytes))
            watch.stop()
            if watch.oom_line is not None:  # it fitted only by waiting for memory a transfer freed
                return _Outcome(False, oom_node=watch.oom_node, need_bytes=watch.need_bytes,
                                message=_oom_message(watch.oom_line, "running the step", limit_bytes, watch.oom_node,
                                                     watch.need_bytes)
                                + " (the step went on once a transfer freed memory: it stalled)")
            return _Outcome(True, result, peak_bytes=pair.standin.peak_bytes() if peak else None,
                            trace=tuple(traced or ()))
        except _RunFailed as failure:
            watch.stop()
            return self._classify(failure, watch, pair, limit_bytes)
        finally:
            watch.stop()
            pair.kill()

    def _classify(self, failure: _RunFailed, watch: _Watch, pair: _Pair, limit_bytes: int | None) -> _Outcome:
        """Out of memory (by the allocator's log, or TensorFlow's error), else raise an LmsError."""
        tf = tensorflow()
        exc, phase = failure.error, failure.phase
        line, node = watch.oom_line, watch.oom_node
        if line is None and isinstance(exc, tf.errors.ResourceExhaustedError):
            line = str(exc).strip()
        if line is not None:
            node = node or _oom_node(line) or _oom_node(str(exc))
            return _Outcome(False, oom_node=node, message=_oom_message(line, phase, limit_bytes, node, watch.need_bytes),
                            need_bytes=watch.need_bytes)
        dead = watch.died or pair.dead()
        if dead:
            log = pair.standin.log if dead == STANDIN_JOB else pair.host.log
            raise StandInError(f"the stand-in's {dead} server died while {phase}: {_last_line(log)}")
        if isinstance(exc, tf.errors.DeadlineExceededError):
            raise StandInError(f"the stand-in did not finish {phase} within {self.timeout_s:.0f} s; "
                               "raise timeout_s for a slow graph")
        text = str(exc)
        if "Cannot colocate nodes" in text or "Cannot assign a device" in text:  # placed at the first run
            raise LmsError("TensorFlow cannot place the graph on the stand-in's devices (an error of placement, "
                           f"not of memory or of the variables): {_error_line(exc)}")
        raise LmsError(f"the graph failed on the stand-in while {phase}, not for lack of memory: {_error_line(exc)}")

    def _verdict(self, prep: _Prepared, limit: int | None, batch_size: int, steps: int, runs: int,
                 peak: bool, values: bool = True) -> StepVerdict:
        started = time.monotonic()
        outcomes = []
        for _ in range(runs):
            outcomes.append(self._run_once(prep, limit, batch_size, steps, peak, values=values))
            if not outcomes[-1].fits:
                break
        return _summarise(outcomes, limit, time.monotonic() - started)

    # -------------------------------------------------------- public API
    @timed("runs on the stand-in")
    def run(self, meta_graph, fetches, limit_bytes: int | None, *, batch_size: int = 1, steps: int = 1,
            runs: int = 3, loss: str | None = None, peak: bool = False, values: bool = True) -> StepVerdict:
        """Run ``steps`` training steps of ``fetches`` (op names) under ``limit_bytes`` (rounded down to
        whole MiB; None: no limit, a reference run), ``runs`` times with fresh processes.

        Runs stop at the first out-of-memory (the claim "fits" is refuted). ``loss`` defaults to
        :func:`lmscli.prove.steps.default_loss`; ``batch_size`` sizes unknown placeholder dimensions.
        ``peak=True`` also reads the stand-in allocator's peak bytes in use (whole chunks: under a
        limit it nears the limit, as BFC hands out a whole free chunk when splitting it would leave
        less than the request and less than 128 MiB). Raises :class:`~lmscli.errors.LmsError` when
        the graph fails for another reason. ``values=False``: the runs only say whether the steps
        fit (the variables are not read after them, and ``result.values`` is empty).
        """
        limit = _check_limit(limit_bytes)
        if runs < 1 or steps < 1:
            raise InputError("runs and steps must be at least 1")
        prep = _prepare(meta_graph, fetches, loss, self.feed_values)
        self.last_verdict = self._verdict(prep, limit, batch_size, steps, runs, peak, values)
        return self.last_verdict

    @timed("traced steps on the stand-in")
    def observe(self, meta_graph, fetches, *, batch_size: int = 1, loss: str | None = None):
        """Two training steps of ``fetches`` traced on the stand-in, in fresh processes as every run
        is: each op's kernel scratch and the order the stand-in's executor started the ops in, as
        the first step (the one a limit must hold) shows them, and their times, as the second shows
        them (the first step's include one-time work: oneDNN builds each convolution's kernel on its
        first run, several times its later runs). An :class:`~lmscli.prove.scratch.Observation` of
        the stand-in's ops. Those steps run on the stand-in's BFC allocator, given one region of
        :data:`OBSERVE_REGION` bytes (untouched pages cost nothing). The scratch comes from one more
        traced step on TensorFlow's plain CPU allocator, whose trace records the bytes each kernel
        asked for: a BFC allocator's records the chunk each got, and a chunk less than twice a
        request is handed out whole (a 3D U-Net's 432 MiB convolution temporary was traced as
        512 MiB, and the step's need predicted 14% high). That step's times are not taken: fresh
        pages for each large buffer made a DenseNet's recomputed ops look three times slower."""
        from lmscli.prove.scratch import from_step_stats

        prep = _prepare(meta_graph, fetches, loss, self.feed_values)
        timed = self._run_once(prep, OBSERVE_REGION, batch_size, 2, False, trace=True, values=False)
        sized = (self._run_once(prep, None, batch_size, 1, False, trace=True, bfc=False, values=False)
                 if timed.fits else timed)
        if not (timed.fits and sized.fits) or len(timed.trace) < 2 or not sized.trace:
            failed = sized if timed.fits else timed
            raise LmsError(f"the step does not run on the stand-in even without a limit: {failed.message}")
        prefix = f"/job:{STANDIN_JOB}/"
        first, warm = from_step_stats(timed.trace[0], prefix), from_step_stats(timed.trace[1], prefix)
        sizes = from_step_stats(sized.trace[0], prefix)
        # The order takes the host's ops too, where they really started: a swap-out's host node
        # starts once the stand-in's send has handed its tensor over, and no op need wait for it,
        # so it can come long after its tensor was ready (QA: a GPU plan's swap-outs, placed at
        # once, were predicted to need 27 MiB; the stand-in needed 51).
        order = from_step_stats(timed.trace[0]).order
        # How far a loop's iterations run ahead of each other varies from step to step; the other
        # two traced steps show it twice more.
        orders = (from_step_stats(timed.trace[1]).order, from_step_stats(sized.trace[0]).order)
        return replace(first, order=order, scratch=sizes.scratch, scratch_first=sizes.scratch_first,
                       micros={**first.micros, **warm.micros}, orders=orders)

    @timed("bisection on the stand-in")
    def find_min(self, meta_graph, fetches, *, hint_bytes: int | None = None, lo_bytes: int | None = None,
                 hi_bytes: int | None = None, batch_size: int = 1, runs: int = 3, resolution: int = MIB,
                 steps: int = 1) -> MinLimit:
        """The smallest limit (a multiple of ``resolution``, whole MiB) under which the step fits.

        Without a hint, an unlimited reference run's allocator peak is the hint (on the samples the
        minimum was 0-18% below it). The search probes the hint, steps outwards until one probe
        fits and one fails (down by 1/16 per step; up by 1/8 of the hint, doubling), bisects with
        single runs, then confirms the result with ``runs`` runs; if a confirming run fails it moves
        up (1, 2, 4... resolutions) and reports ``varies``. ``lo_bytes`` and ``hi_bytes`` bound the
        search: no probe goes outside them.

        Measured on the samples here: 2-9 probes (5-14 runs with the reference run and the
        confirmation), 1-4 of them out of memory; a search takes 9-18 s on the small samples and
        about 60 s on the ResNet-50 one. Repeated searches agreed on six samples; on the two-GPU
        CNN four searches gave 31-33 MiB (the threshold moves between runs: the executor's order varies).
        """
        started = time.monotonic()
        res = max(MIB, (resolution // MIB) * MIB)
        lo = None if lo_bytes is None else _ceil_to(lo_bytes, res)
        hi = None if hi_bytes is None else _ceil_to(hi_bytes, res)
        prep = _prepare(meta_graph, fetches, None, self.feed_values)
        search = _Search(self, prep, batch_size, steps, res, lo, hi)
        reference = None
        if hint_bytes is None and lo is not None and hi is not None:
            hint_bytes = (lo + hi) // 2
        if hint_bytes is None:
            reference = self._verdict(prep, None, batch_size, steps, 1, True, values=False)
            search.runs += 1
            if not reference.fits:
                raise LmsError(f"the step does not run on the stand-in even without a limit: {reference.message}")
            hint_bytes = reference.peak_bytes
        fit = search.bisect(search.bracket(_ceil_to(hint_bytes, res)))
        fit, varies = search.confirm(fit, runs)
        return MinLimit(fit, tuple(search.probes), varies, time.monotonic() - started, search.runs,
                        reference.peak_bytes if reference else None)


def _ceil_to(num_bytes: int, res: int) -> int:
    return max(res, math.ceil(num_bytes / res) * res)


def _check_limit(limit_bytes: int | None) -> int | None:
    if limit_bytes is None:
        return None
    if limit_bytes < MIB:
        raise InputError(f"a stand-in limit must be at least 1 MiB, not {limit_bytes} bytes")
    return (int(limit_bytes) // MIB) * MIB


def _summarise(outcomes: list[_Outcome], limit: int | None, seconds: float) -> StepVerdict:
    done = [o for o in outcomes if o.fits]
    failed = [o for o in outcomes if not o.fits]
    first = failed[0] if failed else None
    differ = next((d.message for o in done[1:] if (d := compare(done[0].result, o.result)) is not None), None)
    peaks = [o.peak_bytes for o in done if o.peak_bytes is not None]
    return StepVerdict(not failed, limit, len(outcomes), len(failed), bool(done and failed),
                       first.oom_node if first else None, first.message if first else None,
                       done[0].result if done else None, seconds, max(peaks) if peaks else None, differ,
                       first.need_bytes if first else None)


class _Search:
    """The probes of one :meth:`StandIn.find_min`."""

    def __init__(self, standin: StandIn, prep: _Prepared, batch_size: int, steps: int, res: int,
                 lo: int | None, hi: int | None):
        self.standin, self.prep, self.batch_size, self.steps, self.res = standin, prep, batch_size, steps, res
        self.lo, self.hi = lo, hi
        self.probes: list[tuple[int, bool]] = []
        self.fail: int | None = None  # the largest limit seen failing
        self.runs = 0

    def probe(self, limit: int, runs: int = 1) -> bool:
        timing.step(f"trying {_mib(limit)}" + (f" ({runs} runs)" if runs > 1 else "")
                    + (f"; runs out at {_mib(self.fail)}" if self.fail is not None else ""))
        verdict = self.standin._verdict(self.prep, limit, self.batch_size, self.steps, runs, False, values=False)
        self.probes.append((limit, verdict.fits))
        self.runs += verdict.runs
        if not verdict.fits:
            self.fail = limit if self.fail is None else max(self.fail, limit)
        return verdict.fits

    def _clamp(self, limit: int) -> int:
        if self.lo is not None:
            limit = max(limit, self.lo)
        if self.hi is not None:
            limit = min(limit, self.hi)
        return max(self.res, limit)

    def bracket(self, hint: int) -> int:
        """Probe the hint, then step outwards until a fit and a failure are known, or a bound is
        reached; the smallest fitting limit seen. The hint is usually close, so steps down are
        small (1/16 each) and steps up grow (1/8 of the hint, doubling)."""
        x = self._clamp(hint)
        if self.probe(x):
            while True:
                below = self._clamp(min(x - self.res, _ceil_to(x * 15 // 16, self.res)))
                if below >= x or not self.probe(below):
                    return x
                x = below
        delta = _ceil_to(hint // 8, self.res)
        while True:
            above = self._clamp(x + delta)
            if above <= x:
                raise LmsError(f"the step does not fit on the stand-in even under {_mib(x)} (hi_bytes); raise it")
            if above > _MAX_LIMIT:
                raise LmsError("the step does not fit on the stand-in under any limit tried; check the graph")
            if self.probe(above):
                return above
            x, delta = above, delta * 2

    def bisect(self, fit: int) -> int:
        """Narrow (failure, fit] to one resolution step with single runs."""
        low = self.fail if self.fail is not None else (self.lo - self.res if self.lo is not None else 0)
        while fit - low > self.res:
            mid = max(low + ((fit - low) // 2 // self.res) * self.res, low + self.res)
            if self.probe(mid):
                fit = mid
            else:
                low = mid
        return fit

    def confirm(self, fit: int, runs: int) -> tuple[int, bool]:
        """Run ``runs`` runs at ``fit``; move up while one fails."""
        varies, step = False, self.res
        while not self.probe(fit, runs):
            varies = True
            if self.hi is not None and fit >= self.hi:
                raise LmsError(f"the step does not fit reliably on the stand-in under {_mib(fit)} (hi_bytes); raise it")
            fit = self._clamp(fit + step)
            step *= 2
        return fit, varies
