"""The optimizer guard: a rewrite must not change what Grappler's optimizations do to the graph.

A Session runs Grappler's default optimizations (arithmetic simplification, constant folding,
remapping into fused kernels, ...) on every graph before running it. A swap node in the middle of
a pattern can stop a rewrite the original graph got; the kernels that run instead round
differently in the last bit, and training is no longer bit-identical. The fused-edge rules in
:mod:`lmscli.candidates` avoid the patterns known in advance; the guard checks every plan:

    original  --Grappler-->  optimized original   \\
                                                     compare node by node, looking through
    rewritten --Grappler-->  optimized rewritten  /  Identity nodes (the swap nodes among them)

Nodes that come out differently name the graph nodes involved; the swaps, waiters, triggers and
serialized ops that touch them are the culprits, which the planner then leaves alone.
"""

from __future__ import annotations

from lmscli.graphview import parse_input
from lmscli.rewriter import SCOPE

_TRANSPARENT = frozenset({"Identity", "NoOp"})


def _canonical(graph_def) -> tuple[dict, dict]:
    """``(node name -> (op, data inputs, attrs), resolve)``: inputs are resolved through Identity
    nodes to the tensor they carry; Identity and NoOp nodes themselves are left out."""
    identity = {}
    for node in graph_def.node:
        if node.op == "Identity" and node.input and not node.input[0].startswith("^"):
            identity[node.name] = node.input[0]

    def resolve(text: str) -> str:
        for _ in range(len(identity) + 1):
            name, output, _ = parse_input(text)
            if output == 0 and name in identity:
                text = identity[name]
            else:
                break
        name, output, _ = parse_input(text)
        return name if output == 0 else f"{name}:{output}"

    table = {}
    for node in graph_def.node:
        if node.op in _TRANSPARENT:
            continue
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in node.attr.items()
                             if not k.startswith("_")))
        table[node.name] = (node.op, tuple(resolve(i) for i in node.input if not i.startswith("^")), attrs)
    return table, resolve


def involved(optimized_original, optimized_rewritten) -> frozenset:
    """Names of the graph nodes around every node that Grappler optimizes differently in the
    rewritten graph (the node and the producers of its inputs, in either version); empty when
    both optimize alike. Swap nodes (``lms/``) are looked through."""
    a, _ = _canonical(optimized_original)
    b, _ = _canonical(optimized_rewritten)
    names: set[str] = set()

    def add(name: str, entries) -> None:
        names.add(name)
        for entry in entries:
            if entry is not None:
                names.update(parse_input(i)[0] for i in entry[1])

    for name, entry in a.items():
        other = b.get(name)
        if other != entry:
            add(name, (entry, other))
    for name, entry in b.items():
        if name not in a and not name.startswith(SCOPE):
            add(name, (entry,))
    return frozenset(n for n in names if not n.startswith(SCOPE))


def culprits(plan, names: frozenset) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(tensors, ops)``: the swapped tensors whose producer, rewired consumers, waiters or
    triggers are among ``names``, and the serialized ops among them."""
    tensors = []
    for swap in plan.swaps:
        producer = parse_input(swap.tensor)[0]
        touched = {producer, *swap.waiters, *(swap.near if swap.sync_out else ())}
        for group in swap.swap_ins:
            touched.update(group.consumers)
            touched.add(group.trigger)
        if touched & names:
            tensors.append(swap.tensor)
    ops = sorted({op for chain in plan.serialize for op in chain if op in names})
    return tuple(sorted(tensors)), tuple(ops)


def without(plan, tensors, ops):
    """``plan`` without the swaps of ``tensors`` and with ``ops`` taken out of serialized chains."""
    from dataclasses import replace

    drop = set(ops)
    chains = tuple(c for c in (tuple(op for op in chain if op not in drop) for chain in plan.serialize) if len(c) > 1)
    return replace(plan, swaps=tuple(s for s in plan.swaps if s.tensor not in set(tensors)), serialize=chains)
