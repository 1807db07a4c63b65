"""v1 control flow: swaps whose tensors, consumers or triggers live inside the branches of a cond.

``cond_branch.meta`` (a deep residual branch or a 1x1 conv, chosen by a placeholder that defaults
to True) peaks inside the true branch's gradient. Every rewrite is trained against the original
with the predicate True and False: a control edge from a node of one branch to a node that runs
in the other (or outside the cond) would silently stop that node when the branch is not taken.
"""

from __future__ import annotations

import json

import pytest

from lmscli import api
from lmscli.candidates import branch_safe
from lmscli.graphview import GraphView
from lmscli.prove import steps
from tests.conftest import invoke


def _with_predicate(meta_graph, value: bool):
    """A copy of ``meta_graph`` whose boolean PlaceholderWithDefault nodes default to ``value``."""
    from tensorflow.core.protobuf import meta_graph_pb2

    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(meta_graph)
    nodes = {n.name: n for n in out.graph_def.node}
    changed = 0
    for node in out.graph_def.node:
        if node.op == "PlaceholderWithDefault" and node.attr["dtype"].type == 10:  # DT_BOOL
            nodes[node.input[0].split(":")[0]].attr["value"].tensor.bool_val[:] = [value]
            changed += 1
    assert changed
    return out


@pytest.fixture(scope="module")
def cond_branch(samples):
    model = api.load(str(samples / "cond_branch.meta"))
    return model, api.prepare(model)


def test_the_peak_lies_inside_a_branch(cond_branch):
    _model, prepared = cond_branch
    analysis = api.analyze(prepared)
    view = prepared.view
    assert view.conditional(view.index[analysis.peak_op])


def test_branch_safe_edges():
    true, false = frozenset({(("p", 0), 1)}), frozenset({(("p", 0), 0)})
    assert branch_safe(frozenset(), true) and branch_safe(true, true)
    assert not branch_safe(true, frozenset()) and not branch_safe(true, false)


def test_swaps_inside_branches_keep_every_op_in_its_branch_and_train_identically(cond_branch, tmp_path):
    """At 65% of the peak (out of reach while lms triggered nothing inside branches: it stopped at
    80%), the plan swaps tensors made in the branch and a Switch output forwarding the stem's
    activation into it, with swap-ins triggered from inside the branch. No original op changes
    branch, and both branches train bit-identically."""
    model, prepared = cond_branch
    device = api.make_device(gpu_mem=int(0.65 * api.analyze(prepared).peak_bytes), reserve=0.0)
    result = api.tune(prepared, device)
    assert result.fits
    view = prepared.view
    tags = view.branch_tags()
    triggers = [view.index[g.trigger] for s in result.plan.swaps for g in s.swap_ins]
    assert any(tags[t] for t in triggers), "no swap-in is triggered from inside a branch"
    assert any(view.ops[view.index[s.tensor.rsplit(":", 1)[0]]] == "Switch" for s in result.plan.swaps)

    new_graph, _report = api.rewrite(prepared, result.plan)
    after = GraphView(new_graph.graph_def)
    new_tags = after.branch_tags()
    for i, name in enumerate(view.names):
        assert new_tags[after.index[name]] == tags[i], name

    for value in (True, False):
        before = steps.run_steps(_with_predicate(model.meta_graph, value), model.fetches, steps=2)
        rewritten = steps.run_steps(_with_predicate(new_graph, value), model.fetches, steps=2)
        assert steps.first_difference(before, rewritten) is None, f"predicate {value}"


def test_the_cli_plans_inside_branches(samples, runner, tmp_path):
    out = tmp_path / "cond.meta"
    result = invoke(runner, "rewrite", samples / "cond_branch.meta", out, "--gpu-mem", "65%", "--reserve", "0",
                    "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["swap_ins"] >= 5
    predicted = doc["plan"]["predicted"]
    assert predicted["run_peak_bytes"] <= predicted["budget_bytes"]



def test_no_plan_with_verbose_still_shows_the_planners_log(samples, runner):
    result = invoke(runner, "tune", samples / "cond_branch.meta", "--gpu-mem", "50%", "--reserve", "0", "-v")
    assert result.exit_code == 3
    assert "[LMS] greedy planning" in result.stderr and "stuck at" in result.stderr
