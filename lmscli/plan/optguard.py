"""The optimizer guard: a rewrite must not change what Grappler's optimizations do to the graph.

A Session runs Grappler's default optimizations (arithmetic simplification, constant folding,
remapping into fused kernels, function inlining, ...) on every graph before running it. A swap
node in the middle of a pattern can stop a rewrite the original graph got; the kernels that run
instead round differently in the last bit, and training is no longer bit-identical. The
fused-edge rules in :mod:`lmscli.plan.candidates` avoid the patterns known in advance; the guard
checks every plan:

    original  --Grappler-->  optimized original   \\
                                                     compare what each node computes, looking
    rewritten --Grappler-->  optimized rewritten  /  through Identity nodes (the swap nodes)

Nodes are compared by a digest of what they compute (op, attributes, the digests of their
inputs), not by name: Grappler names the nodes it makes after their inputs and with counters,
which a swap node changes without changing any result. The first nodes that come out differently
name the graph nodes involved; the swaps, waiters, triggers and serialized ops that touch them
are the culprits, which the planner then leaves alone.
"""

from __future__ import annotations

import hashlib
import re

from lmscli.graph.graphview import parse_input
from lmscli.emit.rewriter import is_lms_node
from lmscli.timing import timed

_TRANSPARENT = frozenset({"Identity", "NoOp"})
_CONSTANT = frozenset({"Const", "HostConst"})
_UNARY_CHAIN = "_UnaryOpsComposition"
# Two-operand ops whose result does not depend on operand order, bit for bit (IEEE addition and
# multiplication are commutative; only the order of more than two terms matters). Grappler sorts
# some operands by name, and a swap node's name sorts elsewhere than its producer's.
_COMMUTATIVE = frozenset({"Add", "AddV2", "AddN", "Mul", "Maximum", "Minimum", "SquaredDifference"})
# The function inliner numbers the nodes it makes with one counter for the whole graph.
_COUNTER = re.compile(r"/_\d+(?=/|:|$)")


def _stable(name: str) -> str:
    return _COUNTER.sub("/_", name)


def _data(node) -> list[str]:
    return [i for i in node.input if not i.startswith("^")]


def digests(graph_def, through=frozenset()) -> tuple[dict, object]:
    """``(node name -> digest, resolve)``. A node's digest hashes its op, its attributes and the
    digests of its data inputs (of two-operand commutative ops in sorted order), not its name.
    Identity nodes take their input's digest (swap nodes are Identity), constants are hashed by
    value, and sources (no data inputs) by their name. ``resolve`` maps an input to the node it
    reads, through Identity nodes. The nodes named in ``through`` count as Identities of their
    first input (pushes the rewrite takes out: they are Identities there)."""
    nodes = {node.name: node for node in graph_def.node}

    def resolve(text: str) -> str:
        for _ in range(len(nodes) + 1):
            name, output, _ = parse_input(text)
            node = nodes.get(name)
            if node is None or (node.op != "Identity" and name not in through) or output != 0 or not _data(node):
                return name
            text = _data(node)[0]
        return parse_input(text)[0]

    digest: dict[str, str] = {}
    state: dict[str, int] = {}  # 1: being computed (a while loop's back edge may read it), 2: done

    def tensor(text: str) -> str:
        name, output, _ = parse_input(text)
        if state.get(name) != 2:
            return f"loop:{_stable(name)}:{output}"
        return digest[name] if output == 0 else f"{digest[name]}:{output}"

    for root in nodes:
        stack = [root]
        while stack:  # depth-first, inputs before the node (no recursion: graphs are deep)
            name = stack[-1]
            if state.get(name) == 2:
                stack.pop()
                continue
            node = nodes[name]
            if name not in state:
                state[name] = 1
                stack.extend(n for n in (parse_input(i)[0] for i in _data(node)) if n in nodes and n not in state)
                continue
            stack.pop()
            data = [tensor(i) for i in _data(node)]
            if (node.op == "Identity" or name in through) and data:
                digest[name] = data[0]
                state[name] = 2
                continue
            if node.op == _UNARY_CHAIN and data:
                # The arithmetic optimizer's composition of a chain of unary ops (on CPUs) computes
                # what the chain computes, element by element: its digest is the chain's, and each
                # op on the way counts as present (a swap that cuts the chain short leaves it as it is).
                h = data[0]
                t = node.attr["T"].SerializeToString(deterministic=True)
                for k, op in enumerate(node.attr["op_names"].list.s):
                    h = _op_digest(op.decode(), [("T", t)], [h], None)
                    digest[f"{name}#{k}"] = h
                digest[name] = h
                state[name] = 2
                continue
            if node.op in _CONSTANT:
                value = repr(("const", node.attr["value"].SerializeToString(deterministic=True),
                              node.attr["dtype"].SerializeToString()))
                digest[name] = hashlib.sha256(value.encode()).hexdigest()
            else:
                if node.op in _COMMUTATIVE and len(data) == 2:
                    data.sort()
                # (a loop's parallel_iterations, which a plan sets to 1, changes no value)
                attrs = sorted((k, v.SerializeToString(deterministic=True)) for k, v in node.attr.items()
                               if not k.startswith("_") and k != "parallel_iterations")
                digest[name] = _op_digest(node.op, attrs, data, None if data else _stable(name))
            state[name] = 2
    return digest, resolve


def _op_digest(op: str, attrs: list, inputs: list, source: str | None) -> str:
    """The digest of an op: its type, its attributes (``(name, serialized value)``, sorted), the
    digests of its inputs, and for a source (no inputs) its name."""
    return hashlib.sha256(repr((op, attrs, inputs, source)).encode()).hexdigest()


@timed("guard")
def involved(optimized_original, optimized_rewritten, through=frozenset()) -> frozenset:
    """Names of the graph nodes around the first places where Grappler optimizes the rewritten
    graph differently from the original: each node computing something the other graph does not
    while its inputs are computed by both, and the nodes those inputs come from. Empty when both
    come out alike. Swap nodes (``P-lms-...``) are looked through, and so are the pushes named in
    ``through`` (those the rewrite took out)."""
    a, b = digests(optimized_original, through), digests(optimized_rewritten, through)
    names: set[str] = set()
    for graph, (mine, resolve), (theirs, _) in ((optimized_original, a, b), (optimized_rewritten, b, a)):
        present = set(theirs.values())
        for node in graph.node:
            if node.op in _TRANSPARENT or node.op in _CONSTANT or node.name in through or mine[node.name] in present:
                continue
            sources = [resolve(i) for i in _data(node)]
            if all(mine[s] in present for s in sources if s in mine):  # a first difference
                names.add(node.name)
                names.update(sources)
    return frozenset(n for n in names if not is_lms_node(n))


def around(view, names, hops: int) -> frozenset:
    """``names`` and the nodes of the original graph (``view``) within ``hops`` edges of them, in
    either direction. An optimization decided at one node may show only at the next: a pattern
    test on an input's producer fails when a swap node stands in between."""
    frontier = {view.index[n] for n in names if n in view.index}
    seen = set(frontier)
    for _ in range(hops):
        nxt = set()
        for i in frontier:
            nxt.update(view.predecessors(i))
            nxt.update(view.successors(i))
        frontier = nxt - seen
        seen |= frontier
    return frozenset(names) | {view.names[i] for i in seen}


def culprits(plan, names: frozenset, waiters: set | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(tensors, ops)``: the swapped tensors whose producer, rewired consumers, waiters or
    triggers are among ``names``, the recomputed tensors whose cloned ops, rewired consumers or
    triggers are, and the serialized ops among them. Given a set ``waiters``, a swap that only
    its waiters involve is not a culprit: those ops go into ``waiters`` (a control input into
    them changed Grappler's optimizations; another op can wait for the swap-out).

    A tensor whose trigger alone is among ``names`` is a culprit only when no tensor's edges are:
    the nodes Grappler treats differently come with the nodes their inputs come from, and a
    trigger among those is often a bystander (a transformer's attention probabilities were left
    unswapped for a GELU gradient's swap whose product read the same matrix product). If it was
    not, the next round names it again, alone."""
    edges, by_trigger = [], []
    for swap in plan.swaps:
        rewired = {parse_input(swap.tensor)[0], *(swap.near if swap.sync_out else ())}
        triggers = set()
        for group in swap.swap_ins:
            rewired.update(group.consumers)
            triggers.add(group.trigger)
        others = rewired | triggers
        hit = (others | set(swap.waiters)) & names
        if waiters is not None and hit and not hit & others:
            waiters.update(hit)
        elif hit & rewired or (hit and waiters is None and not hit & triggers):
            edges.append(swap.tensor)
        elif hit:
            by_trigger.append(swap.tensor)
    for rec in plan.recomputes:
        rewired = set(rec.ops)
        for group in rec.groups:
            rewired.update(group.consumers)
        if rewired & names:
            edges.append(rec.tensor)
        elif {group.trigger for group in rec.groups} & names:
            by_trigger.append(rec.tensor)
    for stack in plan.host_stacks:  # (named by the StackV2)
        if {stack.stack, *stack.ops} & names:
            edges.append(stack.stack)
    ops = sorted({op for chain in plan.serialize for op in chain if op in names})
    return tuple(sorted(edges or by_trigger)), tuple(ops)


def without(plan, tensors, ops):
    """``plan`` without the swaps and recomputations of ``tensors`` (and the recomputations that
    read a swap-in of theirs) and with ``ops`` taken out of serialized chains."""
    from dataclasses import replace

    drop, gone = set(ops), set(tensors)
    chains = tuple(c for c in (tuple(op for op in chain if op not in drop) for chain in plan.serialize) if len(c) > 1)
    # A recomputation reading one of the dropped swaps' swap-ins, or the clones of a dropped
    # recomputation, goes too (and so on).
    while True:
        more = {r.tensor for r in plan.recomputes if r.tensor not in gone and any(v in gone for v, _g in r.via)}
        if not more:
            break
        gone |= more
    return replace(plan, swaps=tuple(s for s in plan.swaps if s.tensor not in gone), serialize=chains,
                   host_stacks=tuple(h for h in plan.host_stacks if h.stack not in gone),
                   recomputes=tuple(r for r in plan.recomputes if r.tensor not in gone))
