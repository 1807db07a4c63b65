"""What TensorFlow's executor and allocator do with memory, as plain facts for the simulator.

Two models of one step's memory:

``executor`` (the default; what a real run allocates)
    * Forwarding ops (:data:`FORWARDING_OPS`) hand their input's buffer on: no allocation, and the
      buffer lives until the last use of any tensor sharing it. A ``ReadVariableOp`` output is
      the variable's own (resident) buffer.
    * Element-wise kernels (:data:`IN_PLACE_OPS`) write their output into an input buffer of the
      same size when they are that buffer's last user (``forward_input_or_allocate_output``):
      ``conv -> BiasAdd -> Relu`` is one buffer. A buffer being swapped out is still referenced by
      the transfer, so a swapped input is never reused.
    * Ops run one after another, each allocating its outputs (and kernel scratch) then freeing
      what it was the last to read: a chain of zero-time ops holds two tensors at a time, not all.
    * Every allocation is rounded up to the allocator's 256 bytes.

``grappler`` (TensorFlow's static estimate, ``--judge grappler``)
    Every output is a new tensor, live from its producer's start to its last consumer's end, and
    at one instant allocations come before frees: a chain of zero-time ops holds all its tensors.

Measured on this machine with TensorFlow's own allocation records (graphs run in the schedule's
order): the executor model is within 1% of the measurement on ResNet-50, U-Nets, tf_keras
ResNet-50 and DenseNet-121 and a concat-heavy net, where Grappler's is 10-40% above it.

For the stand-in GPU, :func:`allocator_high_water` also places each allocation as the BFC
allocator does (fragmentation).
"""

from __future__ import annotations

import bisect

MODELS = ("executor", "grappler")

FORWARDING_OPS = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "Reshape", "Squeeze", "ExpandDims",
    "EnsureShape", "CheckNumerics", "IdentityN", "Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch",
    "Merge", "RefMerge", "NextIteration", "RefNextIteration",
})
# Ops whose output k is their input k's buffer, for every k (the others forward input 0 to output 0).
PORT_FORWARDING_OPS = frozenset({"IdentityN"})
# A Switch forwards its input to the output of the branch taken (either port; the other is dead).
SWITCH_OPS = frozenset({"Switch", "RefSwitch"})
RESIDENT_READS = frozenset({"ReadVariableOp"})  # the output is the variable's buffer
STACK_POPS = frozenset({"StackPopV2", "StackPop"})  # what they pop is the buffer a push kept

# Kernels that call forward_input_or_allocate_output: element-wise unary and binary ops, the
# activation functions and their gradients, BiasAdd and AddN (checked on this machine: each of these
# allocated nothing when it was the last reader of a same-sized input).
IN_PLACE_OPS = frozenset({
    "Add", "AddV2", "AddN", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "SquaredDifference",
    "Pow", "FloorDiv", "FloorMod", "Mod", "Neg", "Exp", "Expm1", "Log", "Log1p", "Reciprocal", "Inv", "Sqrt",
    "Rsqrt", "Square", "Abs", "Sign", "Floor", "Ceil", "Round", "Rint", "Erf", "Erfc", "Tanh", "Sigmoid",
    "TanhGrad", "SigmoidGrad", "SqrtGrad", "RsqrtGrad", "ReciprocalGrad", "Relu", "Relu6", "Elu", "Selu",
    "LeakyRelu", "Softplus", "Softsign", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad",
    "SoftplusGrad", "SoftsignGrad", "BiasAdd", "BiasAddV1", "Select", "SelectV2", "ClipByValue", "Cos", "Sin",
    "Gelu", "GeluGrad",
})
# CPU kernels (the stand-in's) that write their output over their first input, the forward
# pass's input, when they are its last reader (``forward_input_or_allocate_output({0}, ...)`` in
# TensorFlow's maxpooling_op.cc; a GPU runs cuDNN's pooling gradient instead). Seen on an Inception
# block: the pooling gradient of a 2.75 MiB concatenation allocated nothing for its output.
CPU_FORWARDING_OPS = frozenset({"MaxPoolGrad"})
ALIGNMENT = 256  # the BFC allocator's rounding

OWN = -1  # a tensor with a buffer of its own
RESIDENT = -2  # a tensor that is a resident buffer (a variable read): nothing allocated


def rounded(num_bytes: int) -> int:
    """Bytes the allocator really takes for ``num_bytes``."""
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT if num_bytes > 0 else 0


def sharing(ops, tensors, inputs, on_gpu, reads_constant=(), carried=(), stand_in=False, ports=()
            ) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per tensor, the tensor whose buffer it shares (:data:`OWN`, :data:`RESIDENT` or an id), and
    whether that link is an in-place reuse (broken when the input is swapped out).

    ``ops``, ``inputs``, ``on_gpu`` and ``reads_constant`` (the op's first input is a constant,
    which is resident and no tensor of the schedule; for a stack's pop, the stack keeps a resident
    buffer: :func:`lmscli.model.loops.resident_pops`) are per position, ``tensors`` the schedule's
    SimTensors in producer order. In-place reuse needs the op to be the last reader of every tensor
    sharing the input's buffer, as it is when the executor runs the schedule's order.

    A forwarding op of a constant is that constant's buffer: a v1 loop's gradient accumulator
    ``Const (zeros) -> Enter`` allocates nothing (counted twice, a tanh RNN's 256 KiB of
    accumulators sat below its input and pushed a 2 MiB transpose into a chunk of 3 MiB). Not so
    a loop's ``Merge`` of a constant and a ``NextIteration`` (``carried``, per position): from the
    second iteration on it is the value the last iteration made, a buffer of its own until the
    body has read it. A gradient loop's weight-gradient sum holds one while the next gradient is
    computed (a 2-layer GRU's plan: four sums missing at the peak, 0.6 MiB of the 1.2 the step
    held above its variables). Where the stand-in runs iterations at once, its executor leaves the
    sums' additions for last, and what they hold comes from traced steps instead
    (:func:`lmscli.model.loops.running_ahead`)::

        zeros (Const) -> Enter -> Merge -> Add(sum, dW) -> NextIteration --> (back to Merge)
        before: the Merge is the constant's buffer in every iteration; only dW is live at MatMul
        after:  the Merge's own buffer, live until the Add, which takes dW's or its buffer

    On the CPU stand-in (``stand_in``) an op whose output an op of the other process reads (a
    swap-out's transfer to the host) takes a buffer of its own: the executor asks for an output
    the network can send from, which an ordinary input's buffer is not, so the kernel's in-place
    reuse is refused (a 3D U-Net plan's swapped ReLUs each allocated a new 8 or 2 MiB buffer while
    their input was live; predicted 65 MiB, it needed 70). A GPU sending to its own process's
    host memory reuses the buffer::

        BiasAdd(x) -> Relu -> [swap-out to the host process]
        GPU:       Relu writes over x's buffer
        stand-in:  Relu's own buffer; x's is freed after the Relu

    The swap-outs of lms's stand-in plans send through an Identity on the producer's device
    (:mod:`lmscli.emit.rewriter`), which forwards the buffer: the kernel writes over its input on
    the stand-in too."""
    shares = [OWN] * len(tensors)
    in_place = [False] * len(tensors)
    root: list[int] = list(range(len(tensors)))
    last_use: dict[int, int] = {}  # root -> last position reading any tensor of its buffer
    for t in tensors:
        end = t.consumers[-1] if t.consumers else t.producer
        last_use[t.id] = end
    # Forwarding and in-place links are decided in producer order, so a root's last use is known
    # (up to the tensors produced later that join it, which only extend it).
    for t in tensors:
        k = t.producer
        op = ops[k]
        if not on_gpu[k]:
            continue
        if op in RESIDENT_READS or ((op in FORWARDING_OPS or op in STACK_POPS) and t.output == 0 and reads_constant
                                    and reads_constant[k]):
            shares[t.id] = RESIDENT
            root[t.id] = -1
            continue
        # (only tensors made before: a loop's Merge also reads its NextIteration, through a back edge)
        same = [i for i in inputs[k] if i < t.id and tensors[i].num_bytes == t.num_bytes]
        by_port = op in PORT_FORWARDING_OPS and bool(ports) and bool(ports[k])
        if by_port:
            # output k is input k (a custom gradient's IdentityN passes on the forward pass's tensors)
            src = ports[k][t.output] if t.output < len(ports[k]) else (-1, 0)
            same = [i for i in same if (tensors[i].producer, tensors[i].output) == src]
        if op in FORWARDING_OPS and same and (t.output == 0 or op in SWITCH_OPS or by_port):
            src = same[0]
            if root[src] < 0 and carried and carried[k]:
                continue  # a loop-carried value that enters as a constant: see the docstring
            r = root[t.id] = root[src]
            if r < 0:
                shares[t.id] = RESIDENT
                continue
            shares[t.id] = src
            last_use[r] = max(last_use[r], last_use[t.id])
            continue
        cpu_forward = stand_in and op in CPU_FORWARDING_OPS
        if (op in IN_PLACE_OPS or cpu_forward) and t.output == 0 and not (
                stand_in and any(not on_gpu[c] for c in t.consumers)):
            # The newest input first: kernels forward their first operand (the incoming gradient
            # of a *Grad op), which is made later than the forward pass's activations. A pooling
            # gradient's CPU kernel forwards the forward pass's input only, the oldest of its inputs.
            candidates = sorted((i for i in same if root[i] >= 0),
                                key=lambda i: tensors[i].producer if cpu_forward else -tensors[i].producer)
            for src in candidates[:1] if cpu_forward else candidates:
                r = root[src]
                if last_use[r] == k:
                    shares[t.id] = src
                    in_place[t.id] = True
                    root[t.id] = r
                    last_use[r] = max(last_use[r], last_use[t.id])
                    break
    return tuple(shares), tuple(in_place)


def roots(schedule) -> tuple[int, ...]:
    """Per tensor of an executor-model schedule, the tensor owning its buffer (-1: resident)."""
    out: list[int] = []
    for t in schedule.tensors:
        link = schedule.shares[t.id] if schedule.shares else OWN
        if link == OWN:
            out.append(t.id)
        elif link == RESIDENT:
            out.append(-1)
        else:
            out.append(out[link])
    return tuple(out)


SPLIT_ALWAYS = 128 << 20  # the BFC allocator splits a free chunk this much larger than the request


class _Region:
    """One region of a BFC allocator, as TensorFlow's (the one GPUs and the stand-in use) places
    allocations in it: requests rounded to 256 bytes; the smallest free chunk that fits, lowest
    address first; a chunk at least twice the request (or 128 MiB larger) is split, else handed out
    whole; freed chunks merge with free neighbours. ``high`` is where the highest allocation ended.

    A request of one 256-byte unit (a scalar, a shape, a TensorArray's flow) that finds no free
    chunk is taken as placed: a real region is not packed as tightly as this model packs it, the
    initialisation run and the step's first small tensors leave 256-byte chunks free below what
    the step allocates. Counted as failing, they set a tanh RNN's need 2 MiB above the stand-in's
    (a 2 MiB hole filled exactly by a TensorArray's elements, then no room for its 4-byte flow)."""

    def __init__(self, size: int):
        self.free: list[tuple[int, int]] = [(size, 0)]  # (size, address): best fit is the first that fits
        self.chunks: dict[int, list] = {0: [size, False]}  # address -> [size, in use]
        self.addresses = [0]
        self.placed: dict = {}
        self.high = 0

    def allocate(self, key, num_bytes: int) -> bool:
        need = max(ALIGNMENT, rounded(num_bytes))
        k = bisect.bisect_left(self.free, (need, -1))
        if k == len(self.free):
            if need == ALIGNMENT:  # a crumb: what the step's setup left free holds it (see the class)
                self.placed[key] = None
                return True
            return False
        size, address = self.free.pop(k)
        if size >= 2 * need or size - need >= SPLIT_ALWAYS:
            self.chunks[address] = [need, True]
            rest = address + need
            self.chunks[rest] = [size - need, False]
            bisect.insort(self.addresses, rest)
            bisect.insort(self.free, (size - need, rest))
        else:
            self.chunks[address][1] = True
        self.placed[key] = address
        self.high = max(self.high, address + self.chunks[address][0])
        return True

    def release(self, key) -> None:
        address = self.placed.pop(key)
        if address is None:
            return
        chunks, addresses = self.chunks, self.addresses
        size = chunks[address][0]
        i = bisect.bisect_left(addresses, address)
        if i + 1 < len(addresses):
            after = addresses[i + 1]
            if not chunks[after][1]:
                self.free.remove((chunks[after][0], after))
                size += chunks.pop(after)[0]
                addresses.pop(i + 1)
        if i > 0:
            before = addresses[i - 1]
            if not chunks[before][1]:
                self.free.remove((chunks[before][0], before))
                size += chunks[before][0]
                del chunks[address]
                addresses.pop(i)
                address = before
        chunks[address] = [size, False]
        bisect.insort(self.free, (size, address))

    def replay(self, events) -> bool:
        """Place ``events`` (sorted ``(time, order, kind, id, delta)``); False at the first that
        finds no room."""
        for event in events:
            key, delta = (event[2], event[3]), event[4]
            if delta > 0:
                if not self.allocate(key, delta):
                    return False
            elif key in self.placed:
                self.release(key)
        return True


def in_pieces(events, tensors) -> list:
    """``events`` as the allocator sees them: a tensor standing for several allocations (what a
    loop keeps across iterations, one element per iteration: ``SimTensor.pieces``) becomes that
    many, made and freed together. As one block it would need one free range its whole size: on a
    tanh RNN over 128 steps, a 20 MiB limit where the stand-in needed 14 MiB::

        (t, o, 1, 7, +8 MiB)  -->  (t, o, 3, (7, 0), +64 KiB) ... (t, o, 3, (7, 127), +64 KiB)

    What one loop keeps in several stores (``SimTensor.filled_in``: the pushes of one loop body)
    is made an iteration at a time, each iteration's elements side by side, as the executor
    allocates them; all are placed where the first store is made. A store freed before the others
    (the values a TensorFlow 2 loop accumulates that its gradient never reads, dropped at the
    loop's end) then leaves a hole per iteration, not one range: a 2.25 MiB request found no
    room among 48 holes of 192 KiB between the elements still held (QA: a three-layer
    SimpleRNN needed 32 MiB, predicted 28 with its stores one after the other)::

        stores A, B of one loop:   A0 A1 A2 .. | B0 B1 B2 ..    -->   A0 B0 A1 B1 A2 B2 ..
        B freed:                   A0 A1 A2 .. | free 3 x B           A0 __ A1 __ A2 __
    """
    if all(t.pieces <= 1 for t in tensors):
        return events
    stores: dict[str, list[int]] = {}  # loop frame -> its stores, in the order they are made
    for event in events:
        tensor = tensors[event[3]] if event[2] == 1 and event[4] > 0 else None
        if tensor is not None and tensor.pieces > 1 and tensor.filled_in:
            stores.setdefault(tensor.filled_in, []).append(tensor.id)
    out = []
    placed: set[str] = set()
    for event in events:
        time, order, kind, tid, delta = event
        count = tensors[tid].pieces if kind == 1 else 1
        if count <= 1:
            out.append(event)
            continue
        frame = tensors[tid].filled_in
        if delta > 0 and len(stores.get(frame, ())) > 1:
            if frame not in placed:
                placed.add(frame)
                out.extend(_side_by_side(time, order, stores[frame], tensors))
            continue
        size = _piece_bytes(tensors[tid]) * (1 if delta > 0 else -1)
        out.extend((time, order, 3, (tid, j), size) for j in range(count))
    return out


def _side_by_side(time, order, ids, tensors) -> list:
    """The pieces of the stores ``ids`` of one loop, iteration by iteration (stores of fewer
    pieces spread over the iterations in proportion)."""
    pieces = []
    for rank, tid in enumerate(ids):
        count, size = tensors[tid].pieces, _piece_bytes(tensors[tid])
        pieces.extend(((j / count, rank), (time, order, 3, (tid, j), size)) for j in range(count))
    pieces.sort(key=lambda p: p[0])
    return [event for _key, event in pieces]


def _piece_bytes(tensor) -> int:
    """The bytes of each of the allocations a pieced tensor stands for."""
    return -(-tensor.num_bytes // tensor.pieces)


def allocator_high_water(events, base: int = 0) -> int:
    """Where the highest allocation of a step ends in a BFC allocator's one region without end
    (:class:`_Region`): the smallest limit under which the step's allocations (``events``, sorted
    ``(time, order, kind, id, delta)``) all find room if the region's end did not matter, plus
    ``base`` (what is resident below them). A large temporary in the middle of the step (a CPU
    convolution gradient's 27 MiB buffer) can need a hole that the live tensors have cut into
    pieces."""
    region = _Region(1 << 62)
    region.replay(events)
    return region.high + base


LIMIT_RESOLUTION = 1 << 20  # limits are searched in whole MiB, as the stand-in takes them
# Bytes of a real region that no tensor of the model accounts for: the runtime's own small
# allocations (handles, the step's scalars; 13 KiB sat below a tanh RNN's variables in the
# stand-in allocator's log) and where they fall between the model's chunks. At a BFC cliff this
# decides: a transformer plan's last 1 MiB request found a 2.018 MiB tail in the model (split, the
# step fitted under 13 MiB) and a 1.984 MiB one on the stand-in (handed out whole: out of memory;
# it needed 14).
RUNTIME_SLACK = 64 << 10


def fits_in_region(events, limit: int, base: int = 0) -> bool:
    """Whether the step's allocations (``events``, as for :func:`allocator_high_water`, after
    ``base`` bytes allocated first) all find room in a BFC allocator holding one region of exactly
    ``limit`` bytes, as a GPU's does (and the stand-in's: see lmscli/prove/_server.py).

    What is resident (variables, slots) is many allocations, made before the step, each split off
    the region's start; as one request it would be handed the whole region whenever that is less
    than twice ``base`` and less than 128 MiB more (a ResNet-50 with 195 MiB of variables and
    79 MiB of tensors was predicted to need 324 MiB; the stand-in needed 283).

    :data:`RUNTIME_SLACK` of the region is taken by what the model does not see.

    The region's last free chunk is a chunk like the others: when it is less than twice a request
    it is handed out whole, and what it has beyond the request is lost until it is freed::

        | live | live | free 13.75 MiB |  an 8 MiB request takes all 13.75 MiB; the next 8 MiB
                                          request finds no room, though 5.75 MiB sit unused
    """
    room = limit // ALIGNMENT * ALIGNMENT - rounded(base) - RUNTIME_SLACK
    if room < 0:
        return False
    return _Region(room).replay(events)


def bounded_min_limit(events, base: int = 0, start: int = 0, reach: float = 3.0) -> int:
    """About the smallest limit, in whole MiB from ``start`` up, under which :func:`fits_in_region`
    holds: steps of 1, 2, 4, ... MiB up from ``start`` until one fits (the last step at ``reach``
    beyond ``start``), then halving back between the last that did not and the first that did
    (fitting is not quite monotone in the limit, so this is an estimate, as the stand-in's own
    bisection is). ``start`` times ``1 + reach`` when none fits up to there: an estimate that errs
    high (before, the search gave up at half beyond ``start`` and answered ``start`` itself: a
    step whose last chunk was handed out whole at every limit up to there was predicted to fit
    at ``start``)."""
    first = -(-max(start, LIMIT_RESOLUTION) // LIMIT_RESOLUTION) * LIMIT_RESOLUTION
    last = -(-int(first * (1 + reach)) // LIMIT_RESOLUTION) * LIMIT_RESOLUTION
    if fits_in_region(events, first, base):
        return first
    bad, step = first, LIMIT_RESOLUTION
    good = None
    while bad < last:
        probe = min(bad + step, last)
        if fits_in_region(events, probe, base):
            good = probe
            break
        bad = probe
        step *= 2
    if good is None:
        return last
    while good - bad > LIMIT_RESOLUTION:
        mid = (bad + good) // 2 // LIMIT_RESOLUTION * LIMIT_RESOLUTION
        if fits_in_region(events, mid, base):
            good = mid
        else:
            bad = mid
    return good
