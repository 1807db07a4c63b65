"""A read-only, index-based view of a GraphDef: nodes, edges, frames, levels and tensor sizes.

Everything downstream (analysis, simulator, planner, rewriter) works on this view rather than on
protobufs. Nodes are addressed by their index in the GraphDef; tensors by ``(node, output)``.
The view is built once and never mutated.

Structure rules follow TensorFlow's executor:

* ``NextIteration -> Merge`` edges are the back edges of v1 while loops; they are ignored for
  ordering and cycle detection, exactly as TensorFlow ignores them.
* A node's *frame* is ``""`` outside any v1 while loop; ``Enter`` opens the child frame named by
  its ``frame_name`` attribute, ``Exit`` returns to the parent frame.
* A node's *cond depth* counts the ``Switch`` outputs it depends on minus the ``Merge`` nodes
  passed since; a node with depth > 0 may be dead (in the untaken branch of a ``tf.cond``).
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from lmscli.errors import GraphError

CONTROL_FLOW_OPS = frozenset(
    {"Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge", "Switch", "RefSwitch",
     "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger"}
)
VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable", "AutoReloadVariable"})
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})  # read a tensor's shape, not its values
PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderWithDefault"})  # fed by a run
CONSTANT_OPS = frozenset({"Const", "HostConst"})
# Ops a plan never makes wait (a control input): a variable, whose initialiser reads it, so the
# initialisation would run the step's ops (bench-real: a ResNet-50 plan on the stand-in made a momentum
# slot's VarHandleOp wait for a swap-out; initialising the slot then read variables not yet
# initialised), and a placeholder (fed, it does not run, and the edge is lost).
UNWAITING_OPS = VARIABLE_OPS | PLACEHOLDER_OPS
DEFAULT_GPU = "/device:GPU:0"
_DEVICE_PART = re.compile(r"/?(job|replica|task|device|cpu|gpu):?([^/]*)", re.IGNORECASE)


def gpu_key(device: str) -> str | None:
    """The accelerator a node's ``device`` string names, in one canonical spelling; None for a CPU.

    ``""`` (unplaced: TensorFlow's placer puts it on the first GPU) and ``/device:GPU:0``,
    ``/gpu:0`` or ``/job:localhost/replica:0/task:0/device:GPU:0`` are all ``/device:GPU:0``;
    another job or task is kept (``/job:worker/task:1/device:GPU:0``).
    """
    job = task = kind = index = None
    for key, value in _DEVICE_PART.findall(device or ""):
        key = key.lower()
        if key == "job":
            job = value
        elif key == "task":
            task = value
        elif key in ("cpu", "gpu"):
            kind, index = key.upper(), value
        elif key == "device":
            kind, _, index = value.upper().rpartition(":") if ":" in value else (value.upper(), "", "")
    if kind is not None and "CPU" in kind and "GPU" not in kind:
        return None
    prefix = ""
    if job and job != "localhost":
        prefix = f"/job:{job}" + (f"/task:{task}" if task else "")
    elif task and task != "0":
        prefix = f"/task:{task}"
    if kind is None or "GPU" not in kind:
        return prefix + DEFAULT_GPU
    return f"{prefix}/device:GPU:{int(index) if index.isdigit() else 0}"


@dataclass(frozen=True)
class TensorInfo:
    """Static facts about one output: shape (``None`` entries are unknown dims), dtype and size."""

    shape: tuple | None  # None: unknown rank
    dtype: str
    itemsize: int  # 0 for handles (resource, variant) and strings
    num_bytes: int | None  # None when the shape is not fully known

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def known_elements(self) -> int:
        """Product of the known dims (a lower bound on the element count)."""
        total = 1
        for dim in self.shape or ():
            if dim is not None:
                total *= dim
        return total


def parse_input(text: str) -> tuple[str, int, bool]:
    """``'a:1' -> ('a', 1, False)``, ``'a' -> ('a', 0, False)``, ``'^a' -> ('a', -1, True)``."""
    if text.startswith("^"):
        return text[1:], -1, True
    name, sep, index = text.rpartition(":")
    if sep and index.isdigit():
        return name, int(index), False
    return text, 0, False


class GraphView:
    """Index-based read-only view of a GraphDef (see the module docstring)."""

    def __init__(self, graph_def, tensors: dict[str, Sequence[TensorInfo]] | None = None):
        nodes = list(graph_def.node)
        self.node_defs = nodes
        self.library = tuple(graph_def.library.function)
        self.names: list[str] = [n.name for n in nodes]
        self.ops: list[str] = [n.op for n in nodes]
        self.devices: list[str] = [n.device for n in nodes]
        self.gpus: list[str | None] = [gpu_key(d) for d in self.devices]  # None: placed on a CPU
        self.index: dict[str, int] = {}
        duplicates = []
        for i, name in enumerate(self.names):
            if name in self.index:
                duplicates.append(name)
            self.index[name] = i
        if duplicates:
            raise GraphError(
                f"duplicate node name {duplicates[0]!r} ({len(duplicates)} duplicate(s)); "
                "node names must be unique"
            )
        self.frame_names: list[str] = []
        self.data_inputs: list[list[tuple[int, int]]] = []
        self.control_inputs: list[list[int]] = []
        for node in nodes:
            data, control = [], []
            for text in node.input:
                name, output, is_control = parse_input(text)
                src = self.index.get(name)
                if src is None:
                    raise GraphError(
                        f"node {node.name!r} reads {text!r}, but the graph has no node {name!r} "
                        "(dangling input)"
                    )
                if is_control:
                    control.append(src)
                else:
                    data.append((src, output))
            self.data_inputs.append(data)
            self.control_inputs.append(control)
            attr = node.attr.get("frame_name")
            self.frame_names.append(attr.s.decode("utf-8", "replace") if attr is not None else "")
        self._place_with_variables()
        n = len(nodes)
        self.size = n
        self.consumers: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # (dst, port, output)
        self.control_consumers: list[list[int]] = [[] for _ in range(n)]
        for dst in range(n):
            for port, (src, output) in enumerate(self.data_inputs[dst]):
                self.consumers[src].append((dst, port, output))
            for src in self.control_inputs[dst]:
                self.control_consumers[src].append(dst)
        self.num_data_edges = sum(len(d) for d in self.data_inputs)
        self.num_control_edges = sum(len(c) for c in self.control_inputs)
        self.order = self._topological_order()
        self.levels = self._levels()
        self.frames, self.frame_parent = self._frames()
        self.cond_depth = self._cond_depths()
        self._tensors = {k: tuple(v) for k, v in (tensors or {}).items()}
        # (node, output) of the tensors TensorFlow's runtime makes constants of (see
        # lmscli.graph.constfold); set by with_runtime_constants (lmscli.analysis.prepare).
        self.runtime_constants: frozenset[tuple[int, int]] = frozenset()
        # Placeholder values the steps are fed (``--feed NAME=VALUE``): a loop bound computed from
        # them is known (:class:`lmscli.graph.loopvalues.Evaluator`); set by with_fed.
        self.fed: dict[str, object] = {}

    def _place_with_variables(self) -> None:
        """Unplaced ops taking a placed resource variable's handle first (its reads, updates and
        gathers) run where the variable is, as TensorFlow's placer colocates an op with the
        resources it takes::

            conv2/weights (VarHandleOp, /device:CPU:0) -> tower1/Conv2D/ReadVariableOp (no device)
            before: a read on the first GPU of a resident variable, no memory at all
            after:  a read on the CPU, its value received by the GPU (a QA two-tower CNN's 1.2 MiB
                    of weight copies were missing from its stand-in prediction)
        """
        for i, device in enumerate(self.devices):
            if device or not self.data_inputs[i]:
                continue
            src = self.data_inputs[i][0][0]
            for _ in range(8):  # through the Identities a handle may pass
                if self.ops[src] != "Identity" or not self.data_inputs[src]:
                    break
                src = self.data_inputs[src][0][0]
            if self.ops[src] == "VarHandleOp" and self.devices[src]:
                self.devices[i] = self.devices[src]
                self.gpus[i] = gpu_key(self.devices[src])

    # ------------------------------------------------------------------ structure
    def is_back_edge(self, src: int, dst: int) -> bool:
        return self.ops[src] in ("NextIteration", "RefNextIteration") and self.ops[dst] in ("Merge", "RefMerge")

    def predecessors(self, i: int) -> Iterable[int]:
        """Data and control predecessors of ``i``, back edges excluded."""
        for src, _ in self.data_inputs[i]:
            if not self.is_back_edge(src, i):
                yield src
        for src in self.control_inputs[i]:
            if not self.is_back_edge(src, i):
                yield src

    def successors(self, i: int) -> Iterable[int]:
        for dst, _, _ in self.consumers[i]:
            if not self.is_back_edge(i, dst):
                yield dst
        for dst in self.control_consumers[i]:
            if not self.is_back_edge(i, dst):
                yield dst

    def _topological_order(self) -> list[int]:
        """Kahn's algorithm with ties broken by node name: independent of GraphDef node order."""
        indegree = [0] * self.size
        for i in range(self.size):
            for _ in self.predecessors(i):
                indegree[i] += 1
        ready = [(self.names[i], i) for i in range(self.size) if indegree[i] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, i = heapq.heappop(ready)
            order.append(i)
            for j in self.successors(i):
                indegree[j] -= 1
                if indegree[j] == 0:
                    heapq.heappush(ready, (self.names[j], j))
        if len(order) != self.size:
            placed = set(order)
            stuck = sorted(self.names[i] for i in range(self.size) if i not in placed)
            raise GraphError(
                f"the graph has a cycle through {len(stuck)} node(s), e.g. {stuck[0]!r} "
                "(only NextIteration->Merge back edges of while loops may close a cycle)"
            )
        return order

    def _levels(self) -> list[int]:
        """Categorized topological sort: level = longest path from a source (sources are level 0)."""
        levels = [0] * self.size
        for i in self.order:
            best = -1
            for src in self.predecessors(i):
                if levels[src] > best:
                    best = levels[src]
            levels[i] = best + 1
        return levels

    def _frames(self) -> tuple[list[str], dict[str, str]]:
        frames = [""] * self.size
        parent: dict[str, str] = {}
        for i in self.order:
            preds = [src for src, _ in self.data_inputs[i] if not self.is_back_edge(src, i)]
            preds += [src for src in self.control_inputs[i] if not self.is_back_edge(src, i)]
            # A node's frame is that of its inputs; Exit leaves its input's frame.
            inner = ""
            for src in preds:
                frame = frames[src]
                if self.ops[src] in ("Exit", "RefExit"):
                    frame = parent.get(frame, "")
                if len(frame) > len(inner):
                    inner = frame
            if self.ops[i] in ("Enter", "RefEnter"):
                child = (inner + "/" if inner else "") + (self.frame_names[i] or self.names[i])
                parent.setdefault(child, inner)
                inner = child
            frames[i] = inner
        return frames, parent

    def _cond_depths(self) -> list[int]:
        """Switches of tf.cond outside loops add one, Merges outside loops take one away; the
        Switch/Merge pairs that implement while loops do not count (an Exit restores the depth
        the loop was entered at)."""
        depth = [0] * self.size
        entered_at: dict[str, int] = {}
        for i in self.order:
            best = 0
            for src in self.predecessors(i):
                d = depth[src] + (1 if self.ops[src] in ("Switch", "RefSwitch") and not self.frames[src] else 0)
                best = max(best, d)
            op = self.ops[i]
            if op in ("Merge", "RefMerge") and not self.frames[i]:
                best = max(best - 1, 0)
            elif op in ("Enter", "RefEnter"):
                entered_at[self.frames[i]] = max(entered_at.get(self.frames[i], 0), best)
            elif op in ("Exit", "RefExit"):
                best = entered_at.get(self.frames[i], 0)
            depth[i] = best
        return depth

    def branch_tags(self, in_loops: bool = False) -> list[frozenset]:
        """Per node, the v1 cond branches it runs in: ``(predicate, port)`` pairs, where the
        predicate is the ``(node, output)`` tensor the cond's Switches test and port 1 is the true
        branch. A Switch output opens a branch, a Merge closes it (its inputs' tags, intersected);
        control edges carry tags too (a branch's constants hang on its pivot). Loop frames are
        left untagged (their Switch/Merge pairs are the loop's); ``in_loops=True`` tags the nodes
        of loop frames instead, by the conds inside loops (whose Switches test a predicate other
        than the loop's ``LoopCond``; a loop's own Merge, whose back edge comes later in the
        order, closes every branch)."""
        tags: list[frozenset] = [frozenset()] * self.size
        switches = ("Switch", "RefSwitch")
        if not any(op in switches for op in self.ops):
            return tags

        def opens(src: int) -> bool:
            if self.ops[src] not in switches or len(self.data_inputs[src]) < 2 or bool(self.frames[src]) != in_loops:
                return False
            return not in_loops or self.ops[self.data_inputs[src][1][0]] != "LoopCond"

        for i in self.order:
            if bool(self.frames[i]) != in_loops:
                continue
            merge = self.ops[i] in ("Merge", "RefMerge")
            acc = None
            for src, output in self.data_inputs[i]:
                t = tags[src]
                if opens(src):
                    t = t | {(self.data_inputs[src][1], output)}
                acc = t if acc is None else (acc & t if merge else acc | t)
            for src in self.control_inputs[i]:
                acc = tags[src] if acc is None else acc | tags[src]
            tags[i] = acc or frozenset()
        return tags

    def untaken_branches(self, nodes: Iterable[int]) -> frozenset:
        """Of each v1 cond among ``nodes`` with ops in both branches, the nodes of the branch with
        fewer output bytes (the true branch is kept on a tie): a step runs one branch, and
        counting the larger one is an upper bound for either. When the predicate is known from the
        values the steps are fed (``fed``: ``--feed is_training=false``), the branch not taken."""
        tags = self.branch_tags()
        members: dict[tuple, set[int]] = {}
        for i in nodes:
            for tag in tags[i]:
                members.setdefault(tag, set()).add(i)

        def size(group: set[int]) -> int:
            return sum(info.num_bytes or 0 for i in group for info in self.outputs(i))

        drop: set[int] = set()
        for pred in sorted({pred for pred, _port in members}):
            false, true = members.get((pred, 0), set()), members.get((pred, 1), set())
            taken = self._fed_predicate(pred) if self.fed else None
            if taken is not None:
                drop |= false if taken else true
            elif false and true:
                drop |= false if size(false) <= size(true) else true
        return frozenset(drop)

    def _fed_predicate(self, pred: tuple[int, int]) -> bool | None:
        """A cond's predicate tensor as the values fed make it (None: not known from them)."""
        from lmscli.graph.loopvalues import value_before_the_step

        value = value_before_the_step(self, *pred)
        return None if value is None else bool(value)

    def ancestors(self, roots: Iterable[int]) -> set[int]:
        """All nodes that ``roots`` depend on (data or control), roots included."""
        seen = set()
        stack = list(roots)
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            stack.extend(src for src, _ in self.data_inputs[i])
            stack.extend(self.control_inputs[i])
        return seen

    def sinks(self) -> list[int]:
        return [i for i in range(self.size) if not self.consumers[i] and not self.control_consumers[i]]

    # ------------------------------------------------------------------ tensors
    def _copy(self, recount_loops: bool = False) -> "GraphView":
        """The same structure (no structural work is redone); ``recount_loops``: without the loops'
        counts and storage (:mod:`lmscli.model.schedule` sizes and counts them by shapes and fed
        values)."""
        other = object.__new__(GraphView)
        other.__dict__.update(self.__dict__)
        for key in ("_loop_storage", "_loop_counts", "_loop_trips") if recount_loops else ():
            other.__dict__.pop(key, None)
        return other

    def with_tensors(self, tensors: dict[str, Sequence[TensorInfo]]) -> "GraphView":
        """The same structure with tensor facts attached (no structural work is redone)."""
        other = self._copy(recount_loops=True)
        other._tensors = {k: tuple(v) for k, v in tensors.items()}
        return other

    def with_fed(self, values: dict) -> "GraphView":
        """The same graph whose placeholders named in ``values`` are fed those values (filling their
        shapes): loops bounded by them are counted by them (QA r47: a sequence length)."""
        other = self._copy(recount_loops=True)
        other.fed = dict(values)
        return other

    def with_runtime_constants(self, pairs) -> "GraphView":
        """The same graph whose outputs ``pairs`` (``(node, output)``) the runtime holds as
        constants: resident, and read by no op (the ops that made them still run)."""
        other = self._copy()
        other.runtime_constants = frozenset(pairs)
        return other

    def tensor_facts(self) -> dict[str, tuple[TensorInfo, ...]]:
        """Node name -> its outputs' facts (what :meth:`with_tensors` attached)."""
        return self._tensors

    def outputs(self, i: int) -> tuple[TensorInfo, ...]:
        return self._tensors.get(self.names[i], ())

    def tensor(self, i: int, output: int) -> TensorInfo | None:
        outs = self.outputs(i)
        return outs[output] if 0 <= output < len(outs) else None

    def tensor_bytes(self, i: int, output: int) -> int:
        """Bytes of a tensor; 0 when unknown (unknown tensors are listed by the analysis)."""
        info = self.tensor(i, output)
        return info.num_bytes or 0 if info is not None else 0

    def constant(self, i: int):
        """The value of ``Const`` node ``i`` as a NumPy array; None for another op, or a value
        TensorFlow cannot read back."""
        if self.ops[i] != "Const":
            return None
        from lmscli.tfimport import tensorflow

        try:
            return tensorflow().make_ndarray(self.node_defs[i].attr["value"].tensor)
        except Exception:
            return None

    def attr_bool(self, i: int, key: str) -> bool:
        attr = self.node_defs[i].attr.get(key)
        return bool(attr.b) if attr is not None else False

    def on_host(self, i: int) -> bool:
        """True when the node is explicitly placed on a CPU: its outputs do not use GPU memory."""
        return self.gpus[i] is None

    def in_loop(self, i: int) -> bool:
        return bool(self.frames[i])

    def outermost(self, frame: str) -> str:
        """The loop frame ``frame`` is nested in that no other loop contains (itself if none)."""
        while self.frame_parent.get(frame):
            frame = self.frame_parent[frame]
        return frame

    def conditional(self, i: int) -> bool:
        return self.cond_depth[i] > 0
