"""What one real step on the stand-in shows that a static model cannot: each op's kernel scratch,
the order TensorFlow's executor runs the ops in, and their times.

CPU kernels take temporaries from the device's allocator while they run (convolution gradients
run Eigen kernels on the stand-in, which take none: :func:`lmscli.prove.standin.scratchless`); a
GPU's kernels use cuDNN workspaces instead, which ``--reserve`` covers. A traced step records each op's own peak allocation and
what it left allocated, so ``peak - live`` is what the op held only while it ran (traced on
TensorFlow's plain CPU allocator, these are the bytes the kernel asked for; the stand-in's BFC
allocator records the chunks it handed out, so its traced steps give the order and times only).

The order: with one inter-op thread, TensorFlow's CPU executor runs cheap ops inline as they
become ready and queues expensive ones last-in first-out, so weight gradients and their updates
wait until the backward pass is nearly done; on a ResNet-50 that holds 17% more than the
first-ready order of Grappler's scheduler. The traced step's start times give that order.

The step is traced on the stand-in itself (:meth:`lmscli.prove.standin.StandIn.observe`): the
same processes, placement, transfers and executor as the runs that prove a plan, in a fresh
process as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lmscli.model.schedule import arrival_name


@dataclass(frozen=True)
class Observation:
    scratch: dict  # node name -> kernel scratch bytes (ops that hold any)
    order: tuple  # node names in the order the executor started them
    micros: dict = field(default_factory=dict)  # node name -> microseconds it ran on this CPU
    orders: tuple = ()  # the orders of other traced steps of the same graph (loops run differently each time)
    scratch_first: frozenset = frozenset()  # ops of ``scratch`` whose kernel takes it before its outputs

    def lending(self, other: "Observation | None") -> "Observation":
        """This observation, with the scratch of ``other`` for ops it did not see hold any (a
        rewrite runs the same kernels as its original)."""
        if other is None:
            return self
        first = self.scratch_first | {name for name in other.scratch_first if name not in self.scratch}
        return Observation({**other.scratch, **self.scratch}, self.order, self.micros, self.orders, frozenset(first))


_FED = re.compile(r" edge_\d+__recv_(\S+)_0 from \S+ to (\S+)")  # a RecvTensor's label for a fed value


def _arrival(node, device: str) -> str | None:
    """``_recv_NAME_0`` for the transfer that brought a fed value to ``device`` (a step stat named
    ``RecvTensor``), the name the session's master gave the feed; None for any other stat."""
    if node.node_name != "RecvTensor":
        return None
    match = _FED.search(node.timeline_label)
    return arrival_name(match.group(1)) if match and match.group(2) == device else None


def from_step_stats(step_stats, device_prefix: str = "") -> Observation:
    """The observation in a traced step's ``StepStats``, for the devices whose name starts with
    ``device_prefix`` (all by default)."""
    scratch: dict[str, int] = {}
    first: set[str] = set()
    started = []
    micros: dict[str, int] = {}
    for dev in step_stats.dev_stats:
        if not dev.device.startswith(device_prefix):
            continue
        for node in dev.node_stats:
            started.append((node.all_start_micros, _arrival(node, dev.device) or node.node_name))
            micros[node.node_name] = max(1, int(node.all_end_rel_micros))
            for mem in node.memory:
                held = mem.peak_bytes - mem.live_bytes
                if held > 0:
                    scratch[node.node_name] = max(scratch.get(node.node_name, 0), int(held))
                    if _scratch_first(node, mem):
                        first.add(node.node_name)
    return Observation(scratch, tuple(name for _, name in sorted(started)), micros, scratch_first=frozenset(first))


def _scratch_first(node, mem) -> bool:
    """Whether the op's first allocation (of a traced step's records, in the order it made them)
    is one it freed again before it ended: scratch taken before its outputs. Where a kernel takes
    its scratch decides where the allocator puts its outputs: a CPU max-pooling gradient takes its
    argmax buffer (twice its output) first, and on an Inception block that buffer took the hole
    the output was modelled in (predicted 23 MiB, the stand-in needed 26). Kernels differ (a batch
    norm's gradient allocates its outputs first), hence the record::

        MaxPoolGrad records: +3.5 MiB (argmax), +1.75 MiB (output), -3.5 MiB   -> scratch first
    """
    records = list(mem.allocation_records)
    if not records or records[0].alloc_bytes <= 0:
        return False
    end = node.all_start_micros + node.all_end_rel_micros
    size = records[0].alloc_bytes
    return any(r.alloc_bytes == -size and r.alloc_micros <= end for r in records[1:])
