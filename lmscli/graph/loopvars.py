"""Values a lowered TensorFlow 2 loop passes on unchanged become loop invariants.

A TensorFlow 2 ``While`` passes every tensor its body reads from outside as a loop variable.
Lowered (:func:`lmscli.graph.inline.lower_control_flow`), each is an ``Enter`` into a ``Merge``
whose value the body hands back unchanged through a ``NextIteration``, and that leaves through an
``Exit`` to whatever reads it after the loop (the gradient loop reads the forward pass's values
so). That chain holds the value from the loop's start to the end of the gradient loop: it can
never leave the GPU in between. A v1 loop reads such a value through an ``Enter`` with
``is_constant`` (a loop invariant), which lms swaps around a loop
(:func:`lmscli.plan.candidates.loop_entry`). This pass rewrites the first form into the second::

    before
    x -> Enter -> Merge -> Switch -:1-> Identity "in" -> body
                   ^          `-:0-> Exit -> y (after the loop)
                   `- NextIteration <- Identity "out" <- in

    after
    x -> Enter(is_constant) -> Identity "in" -> body
                 pivot ---------^ (control)
    x -> y   (what read the Exit reads x)

``in`` keeps a control input from the loop's pivot (the body's copy of the loop counter's
``Switch:1``), so that, as in a v1 loop, it runs in each iteration the body runs and is dead in
the last, where the loop condition is false. What read the ``Merge`` (the condition's copy of the
value) reads the ``Enter``; what waited for the ``Switch`` or the ``Exit`` (the body's and the
loop's control nodes) waits for the counter's.
Every value computed is the same. Only loops lms lowered itself are changed, and only values
the body returns exactly as it got them (through Identities).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmscli.graph.inline import _split


@dataclass(frozen=True)
class _Passed:
    """One loop variable's chain (node names)."""

    enter: str
    merge: str
    switch: str
    inside: str  # the Identity of Switch:1: the body's copy of the value
    exit: str | None
    next: str
    out: tuple[str, ...]  # Identities from ``inside`` to ``next`` (the body's result)
    passes: bool  # the body hands the value back unchanged


def invariants(graph_def, frames) -> int:
    """Rewrite, in place, the loop variables of the loops ``frames`` (frame names) that the body
    passes on unchanged into loop invariants (see the module docstring); returns how many."""
    frames = set(frames)
    if not frames:
        return 0
    nodes = {n.name: n for n in graph_def.node}
    readers: dict[str, list[tuple[str, int]]] = {}  # node -> (reader, input index)
    for n in graph_def.node:
        for k, ref in enumerate(n.input):
            readers.setdefault(_split(ref)[0], []).append((n.name, k))
    by_frame: dict[str, list[_Passed]] = {}
    for n in graph_def.node:
        if n.op != "Enter" or n.attr["is_constant"].b:
            continue
        frame = n.attr["frame_name"].s.decode("utf-8", "replace")
        if frame in frames:
            chain = _chain(n.name, nodes, readers)
            if chain is not None:
                by_frame.setdefault(frame, []).append(chain)
    gone: dict[str, str] = {}  # removed node -> the Enter that now stands for it
    changed = 0
    for frame in sorted(by_frame):
        chains = by_frame[frame]
        kept = sorted((c for c in chains if not c.passes and c.exit), key=lambda c: c.enter)
        if not kept:
            continue  # no pivot, and no Exit to wait for instead
        pivot, other_switch, other_exit = kept[0].inside, kept[0].switch, kept[0].exit
        for c in sorted(chains, key=lambda c: c.enter):
            if not c.passes or not _only_chain_reads(c, readers, nodes):
                continue
            outer = nodes[c.enter].input[0]
            nodes[c.enter].attr["is_constant"].b = True
            inside = nodes[c.inside]
            refs = [ref for ref in inside.input if _split(ref)[0] != c.switch]
            del inside.input[:]
            inside.input.extend([c.enter] + refs + [f"^{pivot}"])
            _rewire(readers.get(c.merge, ()), nodes, c.merge, c.enter, f"^{c.enter}", skip={c.switch})
            _rewire(readers.get(c.switch, ()), nodes, c.switch, None, f"^{other_switch}",
                    skip={c.inside, c.exit})
            if c.exit:
                _rewire(readers.get(c.exit, ()), nodes, c.exit, outer, f"^{other_exit}", skip=set())
            for name in (c.merge, c.switch, c.next, *c.out) + ((c.exit,) if c.exit else ()):
                gone[name] = c.enter
            changed += 1
    if gone:
        _recolocate(graph_def, gone)
        keep = [n for n in graph_def.node if n.name not in gone]
        del graph_def.node[:]
        graph_def.node.extend(keep)
    return changed


def _chain(enter: str, nodes: dict, readers: dict) -> _Passed | None:
    """The chain of the loop variable entering through ``enter``; None when it is not the plain
    lowered form (one Merge, one Switch, one Identity of Switch:1, at most one Exit)."""
    merges = [r for r, _k in readers.get(enter, ()) if nodes[r].op == "Merge"]
    if len(merges) != 1:
        return None
    merge = nodes[merges[0]]
    data = [ref for ref in merge.input if not ref.startswith("^")]
    nexts = [_split(ref)[0] for ref in data if nodes.get(_split(ref)[0]) is not None
             and nodes[_split(ref)[0]].op == "NextIteration"]
    if len(data) != 2 or len(nexts) != 1:
        return None
    switches = [r for r, k in readers.get(merge.name, ()) if nodes[r].op == "Switch" and k == 0]
    if len(switches) != 1:
        return None
    switch = switches[0]
    inside = [r for r, k in readers.get(switch, ()) if nodes[r].input[k] == f"{switch}:1"]
    exits = [r for r, k in readers.get(switch, ()) if _split(nodes[r].input[k]) == (switch, "")
             or nodes[r].input[k] == f"{switch}:0"]
    if (len(inside) != 1 or nodes[inside[0]].op != "Identity" or len(exits) > 1
            or any(nodes[r].op != "Exit" for r in exits)):
        return None
    out: list[str] = []
    ref = next(r for r in nodes[nexts[0]].input if not r.startswith("^"))
    name, port = _split(ref)
    while name != inside[0] and nodes.get(name) is not None and nodes[name].op == "Identity" and port in ("", ":0"):
        out.append(name)
        name, port = _split(next((r for r in nodes[name].input if not r.startswith("^")), "^"))
    passes = name == inside[0] and port in ("", ":0")
    return _Passed(enter, merge.name, switch, inside[0], exits[0] if exits else None, nexts[0], tuple(out), passes)


def _recolocate(graph_def, gone: dict) -> None:
    """Colocation constraints (``_class: loc:@NAME``) naming a removed node name its ``Enter``."""
    for node in graph_def.node:
        if "_class" not in node.attr:
            continue
        values = list(node.attr["_class"].list.s)
        moved = []
        for v in values:
            text = v.decode("utf-8", "replace")
            if text.startswith("loc:@") and text[5:] in gone:
                v = f"loc:@{gone[text[5:]]}".encode()
            if v not in moved:
                moved.append(v)
        if moved != values:
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(moved)


def _only_chain_reads(c: _Passed, readers: dict, nodes: dict) -> bool:
    """Nothing but the chain reads the body's result, and the Merge's second output (its index)
    and the Switch's outputs are read by nothing else than the body's copy and the Exit."""
    for name in c.out:
        if {r for r, _k in readers.get(name, ())} - {c.next, *c.out}:
            return False
    for r in {r for r, _k in readers.get(c.merge, ())}:
        if any(_split(ref) == (c.merge, ":1") for ref in nodes[r].input):
            return False
    for r in {r for r, _k in readers.get(c.switch, ())} - {c.inside, c.exit}:
        if any(_split(ref)[0] == c.switch and not ref.startswith("^") for ref in nodes[r].input):
            return False
    return True


def _rewire(found, nodes: dict, old: str, data: str | None, control: str, skip: set) -> None:
    """Make the readers ``found`` of node ``old`` (other than ``skip``) read ``data`` where they
    read its output 0, and wait for ``control`` where they waited for it (without duplicates)."""
    for reader in sorted({r for r, _k in found} - skip):
        node = nodes[reader]
        refs = []
        for ref in node.input:
            name, port = _split(ref)
            if name == old and port == "^":
                ref = control
            elif name == old and port in ("", ":0") and data is not None:
                ref = data
            if not (ref.startswith("^") and ref in refs):
                refs.append(ref)
        del node.input[:]
        node.input.extend(refs)
