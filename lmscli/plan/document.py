"""The plan: which tensors to swap or recompute, which consumers read the copy brought back or made
again, and what triggers it.

A plan names everything by graph names, so it can be reviewed, stored as JSON, and re-applied
with ``lms rewrite --plan``. :func:`to_sim` maps it onto a schedule for the simulator.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from lmscli.errors import PlanError
from lmscli.model.schedule import Schedule
from lmscli.model.simulator import SimSwap, SwapIn

PLAN_SCHEMA = "lms.plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class PlannedSwapIn:
    consumers: tuple[str, ...]  # op names rewired to read the swap-in
    trigger: str  # op whose completion starts the swap-in (a control edge in the graph)
    landing: str = ""  # an op that waits until the swap-in is on the GPU (stand-in plans; "" for none)


@dataclass(frozen=True)
class PlannedSwap:
    tensor: str  # "node:output"
    bytes: int
    near: tuple[str, ...]  # consumers that keep reading the GPU copy
    swap_ins: tuple[PlannedSwapIn, ...]
    sync_out: bool = False  # near consumers wait for the swap-out
    waiters: tuple[str, ...] = ()  # other ops that wait for the swap-out
    gpu: str = ""  # the GPU whose memory the swap relieves ("" in plans made before multi-GPU support)


@dataclass(frozen=True)
class PlannedRecompute:
    tensor: str  # "node:output"
    bytes: int
    near: tuple[str, ...]  # consumers that keep reading the original
    ops: tuple[str, ...]  # the ops cloned, inputs first; the last one makes ``tensor``
    groups: tuple[PlannedSwapIn, ...]  # consumers rewired to a clone, and the op the clones wait for
    waiters: tuple[str, ...] = ()  # ops updating a variable the clones read: they wait for the clones
    gpu: str = ""
    via: tuple[tuple[str, int], ...] = ()  # (swapped tensor, swap-in group) the clones read it from


@dataclass(frozen=True)
class PlannedHostStack:
    """A loop's gradient stack (or TensorList accumulator) placed on the host, or, when
    ``dropped``, an accumulator no op reads whose pushes are taken out (:mod:`lmscli.plan.hoststacks`)."""

    stack: str  # the StackV2 node
    ops: tuple[str, ...]  # the ops using its handle, which move with it (pushes, pops, closes)
    bytes: int  # what it keeps over one step (its trips times the values pushed per iteration)
    trips: int
    gpu: str = ""
    dropped: bool = False


@dataclass(frozen=True)
class Plan:
    model: str
    graph_sha256: str
    fetches: tuple[str, ...]
    batch_size: int | None
    device: dict
    strategy: str
    parameters: dict
    swaps: tuple[PlannedSwap, ...]
    serialize: tuple[tuple[str, ...], ...] = ()  # chains of op names to run one after another
    predicted: dict = field(default_factory=dict)
    grappler: dict = field(default_factory=dict)
    recomputes: tuple[PlannedRecompute, ...] = ()
    host_stacks: tuple[PlannedHostStack, ...] = ()
    # While loops (their Enters' frame_name) that run one iteration at a time (parallel_iterations
    # 1): what lms's memory model counts. Results are the same; a loop with parallel iterations
    # holds the temporaries of several at once (a dynamic_rnn LSTM: 73 MiB, serial 53).
    serial_loops: tuple[str, ...] = ()
    # Consumers read each swap-in through an Identity placed like the tensor's producer (see
    # lmscli.emit.rewriter); off for plans judged by Grappler's estimate, which counts that Identity's
    # output as a second copy of the tensor (it forwards the buffer on a real executor).
    read_on_gpu: bool = True
    # Made for the stand-in GPU (lms tune/rewrite --stand-in): its triggers follow the order the
    # stand-in's traced steps ran, and its fetches the stand-in's step (the loss too); it applies to
    # the step prepared as the stand-in runs it (lmscli.api.for_stand_in).
    stand_in: bool = False

    @property
    def edits(self) -> tuple:
        """Swaps and recomputations together."""
        return self.swaps + self.recomputes

    @property
    def changes(self) -> bool:
        """Does applying the plan change the graph (swaps, recomputations, stacks on the host,
        serial loops, ops made to run in another order)?"""
        return bool(self.swaps or self.recomputes or self.host_stacks or self.serial_loops or self.serialize)

    @property
    def on_host(self) -> tuple[PlannedHostStack, ...]:
        """The stacks (and lists) kept on the host."""
        return tuple(h for h in self.host_stacks if not h.dropped)

    @property
    def dropped(self) -> tuple[PlannedHostStack, ...]:
        """The accumulators no op reads, whose pushes the rewrite takes out."""
        return tuple(h for h in self.host_stacks if h.dropped)

    @property
    def recompute_bytes(self) -> int:
        return sum(r.bytes * len(r.groups) for r in self.recomputes)

    def to_dict(self) -> dict:
        data = asdict(self)
        if not self.host_stacks:
            del data["host_stacks"]  # (plans without them read as before)
        for h in data.get("host_stacks", ()):
            if not h["dropped"]:
                del h["dropped"]
        if not self.serial_loops:
            del data["serial_loops"]
        if self.read_on_gpu:
            del data["read_on_gpu"]  # (the default: only plans judged by Grappler's estimate say false)
        if not self.stand_in:
            del data["stand_in"]
        return {"schema": PLAN_SCHEMA, "version": PLAN_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @property
    def swap_out_bytes(self) -> int:
        return sum(s.bytes for s in self.swaps)

    @property
    def swap_in_bytes(self) -> int:
        return sum(s.bytes * len(s.swap_ins) for s in self.swaps)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if data.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"not an lms plan (schema {data.get('schema')!r}, expected {PLAN_SCHEMA!r})")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version {data.get('version')} is not supported (this lms reads {PLAN_VERSION})")
        try:
            swaps = tuple(
                PlannedSwap(
                    tensor=s["tensor"], bytes=int(s["bytes"]), near=tuple(s.get("near", ())),
                    swap_ins=tuple(PlannedSwapIn(tuple(g["consumers"]), g["trigger"], str(g.get("landing", "")))
                                   for g in s["swap_ins"]),
                    sync_out=bool(s.get("sync_out", False)), waiters=tuple(s.get("waiters", ())),
                    gpu=str(s.get("gpu", "")),
                )
                for s in data["swaps"]
            )
            recomputes = tuple(
                PlannedRecompute(
                    tensor=r["tensor"], bytes=int(r["bytes"]), near=tuple(r.get("near", ())), ops=tuple(r["ops"]),
                    groups=tuple(PlannedSwapIn(tuple(g["consumers"]), g["trigger"]) for g in r["groups"]),
                    waiters=tuple(r.get("waiters", ())), gpu=str(r.get("gpu", "")),
                    via=tuple((str(v[0]), int(v[1])) for v in r.get("via", ())),
                )
                for r in data.get("recomputes", ())
            )
            if any(not r.ops or not r.groups for r in recomputes):
                raise ValueError("recomputes: ops and groups")
            host_stacks = tuple(
                PlannedHostStack(stack=str(h["stack"]), ops=tuple(str(o) for o in h["ops"]), bytes=int(h["bytes"]),
                                 trips=int(h["trips"]), gpu=str(h.get("gpu", "")),
                                 dropped=bool(h.get("dropped", False)))
                for h in data.get("host_stacks", ())
            )
            serial_loops = data.get("serial_loops", [])
            if not isinstance(serial_loops, list) or not all(isinstance(f, str) and f for f in serial_loops):
                raise ValueError("serial_loops (a list of loop frame names)")
            return cls(
                recomputes=recomputes, host_stacks=host_stacks, serial_loops=tuple(serial_loops),
                read_on_gpu=bool(data.get("read_on_gpu", True)), stand_in=bool(data.get("stand_in", False)),
                model=data["model"], graph_sha256=data["graph_sha256"], fetches=tuple(data["fetches"]),
                batch_size=data.get("batch_size"), device=dict(data.get("device", {})),
                strategy=data.get("strategy", "manual"), parameters=dict(data.get("parameters", {})),
                swaps=swaps, serialize=tuple(tuple(c) for c in data.get("serialize", ())),
                predicted=dict(data.get("predicted", {})), grappler=dict(data.get("grappler", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed plan: missing or bad field {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"the plan is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise PlanError("the plan is not a JSON object")
        return cls.from_dict(data)


def graph_fingerprint(graph_def) -> str:
    return hashlib.sha256(graph_def.SerializeToString(deterministic=True)).hexdigest()


def tensor_ids(schedule: Schedule) -> dict[str, int]:
    return {f"{schedule.names[t.producer]}:{t.output}": t.id for t in schedule.tensors}


def simulated(plan: Plan, schedule: Schedule, view) -> tuple[Schedule, list[SimSwap]]:
    """What the simulator runs for ``plan`` on ``schedule``: its loops one iteration at a time when
    it says so (:func:`lmscli.model.loops.run_serially`), its ops in the order its ``serialize``
    chains set (:func:`lmscli.plan.ordering.applied`), the schedule its stacks on the host leave
    (:func:`lmscli.plan.hoststacks.hosting`), and its swaps and recomputations on that schedule."""
    if plan.serial_loops:
        from lmscli.model.loops import run_serially

        schedule = run_serially(schedule, view)
    if plan.serialize:
        from lmscli.plan.ordering import applied

        schedule = applied(schedule, plan.serialize, view)
    stacks = [h for h in plan.host_stacks if not h.gpu or h.gpu == schedule.device]
    if stacks:
        from lmscli.plan import hoststacks

        schedule = hoststacks.hosting(schedule, view, hoststacks.named(view, stacks))
    return schedule, to_sim(plan.edits, schedule)


def host_stacks_from(units, view, schedule: Schedule) -> tuple[PlannedHostStack, ...]:
    """Name the stacks of :class:`lmscli.plan.hoststacks.Hostable` units for a plan (a unit's bytes go
    to its first stack), sorted by name."""
    from lmscli.plan.hoststacks import handle_users

    out = []
    for h in units:
        for k, stack in enumerate(h.stacks):
            users = handle_users(view, stack) or ()
            out.append(PlannedHostStack(view.names[stack], tuple(sorted(view.names[i] for i in users)),
                                        h.num_bytes if k == 0 else 0, h.trips, schedule.device, h.dropped))
    return tuple(sorted(out, key=lambda p: p.stack))


def to_sim(plan_swaps, schedule: Schedule) -> list[SimSwap]:
    """Map named swaps and recomputations (a plan's :attr:`Plan.edits`) of ``schedule``'s GPU onto
    its positions; raises PlanError for names it does not know."""
    ids = tensor_ids(schedule)
    position = {name: k for k, name in enumerate(schedule.names)}

    def pos(name: str, what: str) -> int:
        if name not in position:
            raise PlanError(f"the plan names {what} {name!r}, which this graph's step does not run")
        return position[name]

    out = []
    for swap in plan_swaps:
        if swap.gpu and swap.gpu != schedule.device:
            continue
        if swap.tensor not in ids:
            raise PlanError(f"the plan swaps {swap.tensor!r}, which is not a tensor of this graph's step")
        groups = tuple(
            SwapIn(tuple(sorted(pos(c, "consumer") for c in g.consumers)), pos(g.trigger, "trigger"),
                   pos(g.landing, "landing op") if g.landing else -1)
            for g in (swap.groups if isinstance(swap, PlannedRecompute) else swap.swap_ins)
        )
        for group in groups:
            if group.trigger >= group.consumers[0]:
                raise PlanError(f"the plan starts bringing back {swap.tensor!r} at {schedule.names[group.trigger]!r}, "
                                f"which runs after {schedule.names[group.consumers[0]]!r}, a consumer it is for, in "
                                "the step's order; make the trigger an op that runs before its first consumer")
        if isinstance(swap, PlannedRecompute):
            chain = tuple(sorted(pos(op, "recomputed op") for op in swap.ops))
            cost, extra = recompute_cost(schedule, chain)
            unknown = [v for v, _g in swap.via if v not in ids]
            if unknown:
                raise PlanError(f"the plan recomputes from {unknown[0]!r}, which is not a tensor of this graph's step")
            out.append(SimSwap(ids[swap.tensor], tuple(sorted(pos(c, "consumer") for c in swap.near)), groups,
                               waiters=tuple(sorted(pos(w, "waiter") for w in swap.waiters)),
                               kind="recompute", cost=cost, extra=extra, chain=chain,
                               via=tuple((ids[v], g) for v, g in swap.via)))
            continue
        out.append(SimSwap(ids[swap.tensor], tuple(sorted(pos(c, "consumer") for c in swap.near)), groups,
                           swap.sync_out, tuple(sorted(pos(w, "waiter") for w in swap.waiters))))
    return out


def recompute_cost(schedule: Schedule, positions) -> tuple[int, int]:
    """``(microseconds, bytes)`` of running the ops at ``positions`` again: their times, and the
    outputs of all but the last, held while the clones run (outputs that forward a buffer or
    reuse one in place allocate nothing), with the largest kernel scratch among them (a
    convolution's temporaries, where the schedule knows them)."""
    positions = sorted(positions)
    cost = sum(schedule.compute[k] for k in positions)
    inner = set(positions[:-1])
    shares = schedule.shares
    extra = sum(schedule.tensors[tid].num_bytes for k in inner for tid in schedule.outputs[k]
                if not (shares and shares[tid] != -1))
    if schedule.scratch:
        extra += max(schedule.scratch[k] for k in positions)
    return cost, extra


def recompute_flops(recomputes, view) -> int:
    """Floating-point operations the clones of ``recomputes`` (:class:`PlannedRecompute`) compute
    in a step: each chain's ops (:func:`lmscli.model.costmodel.op_flops`; element-wise ops count 0)
    once per group of consumers it serves."""
    from lmscli.model.costmodel import op_flops

    return int(sum(op_flops(view, view.index[op]) * len(r.groups) for r in recomputes for op in r.ops
                   if op in view.index))


def from_sim(sim_swaps, schedule: Schedule) -> tuple[PlannedSwap, ...]:
    """Name positions in ``sim_swaps``; swaps come out sorted by producer position, then output.
    Recomputations are left out (see :func:`recomputes_from_sim`)."""
    out = []
    for s in sorted(sim_swaps, key=lambda s: (schedule.tensors[s.tensor].producer, schedule.tensors[s.tensor].output)):
        if s.recompute:
            continue
        t = schedule.tensors[s.tensor]
        out.append(PlannedSwap(
            tensor=f"{schedule.names[t.producer]}:{t.output}",
            bytes=t.num_bytes,
            near=tuple(schedule.names[c] for c in s.near),
            swap_ins=tuple(PlannedSwapIn(tuple(schedule.names[c] for c in g.consumers), schedule.names[g.trigger],
                                         schedule.names[g.landing] if g.landing >= 0 else "")
                           for g in s.groups),
            sync_out=s.sync_out,
            waiters=tuple(schedule.names[w] for w in s.waiters),
            gpu=schedule.device,
        ))
    return tuple(out)


def recomputes_from_sim(sim_swaps, schedule: Schedule) -> tuple[PlannedRecompute, ...]:
    """Name the recomputations of ``sim_swaps``, sorted as :func:`from_sim` sorts swaps."""
    out = []
    for s in sorted(sim_swaps, key=lambda s: (schedule.tensors[s.tensor].producer, schedule.tensors[s.tensor].output)):
        if not s.recompute:
            continue
        t = schedule.tensors[s.tensor]
        out.append(PlannedRecompute(
            tensor=f"{schedule.names[t.producer]}:{t.output}",
            bytes=t.num_bytes,
            near=tuple(schedule.names[c] for c in s.near),
            ops=tuple(schedule.names[k] for k in s.chain),
            groups=tuple(PlannedSwapIn(tuple(schedule.names[c] for c in g.consumers), schedule.names[g.trigger])
                         for g in s.groups),
            waiters=tuple(schedule.names[w] for w in s.waiters),
            gpu=schedule.device,
            via=tuple((f"{schedule.names[schedule.tensors[v].producer]}:{schedule.tensors[v].output}", g)
                      for v, g in s.via),
        ))
    return tuple(out)
