"""The CLI shell: help, version, lazy TensorFlow import, usage errors."""

import subprocess
import sys

import pytest

from lmscli import __version__
from tests.conftest import invoke


def _without_tensorflow(runs) -> subprocess.CompletedProcess:
    """``main(args)`` for each ``(args, exit code)`` of ``runs``, in a fresh interpreter that must
    not import TensorFlow; the finished process (its output, for the caller's checks)."""
    code = (
        "import sys\n"
        "from lmscli.cli import main\n"
        f"for args, rc in {runs!r}:\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == rc, (args, e.code)\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done


def test_help_and_version_do_not_import_tensorflow():
    done = _without_tensorflow([(["--help"], 0), (["--version"], 0), (["analyze", "--help"], 0)])
    assert "analyze" in done.stdout and __version__ in done.stdout


def test_inputs_refused_before_any_graph_is_read_do_not_import_tensorflow(tmp_path):
    """An empty file, a missing one and a missing budget are refused at once (QA r54: 4-7 s each,
    TensorFlow imported first)."""
    empty = tmp_path / "empty.meta"
    empty.write_bytes(b"")
    done = _without_tensorflow([(["analyze", str(empty)], 1), (["analyze", str(tmp_path / "no.meta")], 1),
                                (["tune", str(empty)], 2)])
    assert "the file is empty" in done.stderr and "no such file" in done.stderr and "--gpu-mem" in done.stderr


def test_usage_error_is_exit_2(runner):
    result = invoke(runner, "analyze")
    assert result.exit_code == 2
    result = invoke(runner, "nonsense")
    assert result.exit_code == 2
    result = invoke(runner, "analyze", "x.pb", "--batch-size", "0")
    assert result.exit_code == 2
    # A malformed size is a usage error too (QA: exit 1), caught before the graph is read.
    for args in (("tune", "x.pb", "--gpu-mem", "12XB"), ("rewrite", "x.pb", "y.pb", "--gpu-mem", "0%"),
                 ("verify", "x.pb", "y.pb", "--gpu-mem", "lots"), ("tune", "x.pb", "--gpu-mem", "1GiB",
                                                                    "--host-mem", "12XB")):
        result = invoke(runner, *args)
        assert result.exit_code == 2 and "Invalid value" in result.output, (args, result.output)
    # The stand-in judge's run count means nothing without the stand-in, and needs a run.
    for args in (("tune", "x.pb", "--gpu-mem", "1GiB", "--judge-runs", "2"),
                 ("rewrite", "x.pb", "y.pb", "--gpu-mem", "1GiB", "--judge-runs", "2")):
        result = invoke(runner, *args)
        assert result.exit_code == 2 and "add --stand-in" in result.output, (args, result.output)
    result = invoke(runner, "tune", "x.pb", "--gpu-mem", "1GiB", "--stand-in", "--judge-runs", "0")
    assert result.exit_code == 2 and "Invalid value" in result.output, result.output


def test_console_script_entry_point():
    done = subprocess.run([sys.executable, "-m", "lmscli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and __version__ in done.stdout


def test_tensors_of_unknown_size_are_warned_about(runner, samples):
    """A step with an unknown batch dimension counts those tensors as 0 bytes: analyze, tune and
    rewrite say so on stderr (every figure would be too small), and --batch-size silences it."""
    from tests.conftest import invoke

    done = invoke(runner, "tune", samples / "unknown_batch.meta", "--gpu-mem", "16MiB")
    assert "unknown size and count as 0 bytes" in done.stderr and "--batch-size" in done.stderr
    fixed = invoke(runner, "tune", samples / "unknown_batch.meta", "--gpu-mem", "16MiB", "--batch-size", "4")
    assert "unknown size" not in fixed.stderr
    # analyze lists them in its table, and says so on stderr too (a --json reader sees no table)
    analyzed = invoke(runner, "analyze", samples / "unknown_batch.meta", "--json")
    assert "unknown size and count as 0 bytes" in analyzed.stderr and analyzed.stdout.lstrip().startswith("{")


def test_the_run_search_plans_below_a_plan_that_sits_under_its_budget():
    """When the graph TensorFlow runs needs more than the budget, the next planning margin takes the
    plan's own as-written peak into account: a plan sitting well under its planning budget would
    otherwise come back unchanged round after round (a QA transformer failed at 75% that way)."""
    from types import SimpleNamespace

    from lmscli.plan.tuning import _RunSearch

    search = _RunSearch(budget=100_000, margin=0)
    plan = SimpleNamespace(result=SimpleNamespace(peak_bytes=80_000))
    margin = search.judged(plan, 105_000)
    assert margin >= 100_000 - 80_000 + 5_000  # plan as written for at most 75,000


def test_the_run_search_backs_off_when_the_planner_finds_nothing():
    """After a margin step the planner cannot meet, the search tries half-way back to the margin
    before it, down to steps of 0.5% of the budget, then gives up."""
    from types import SimpleNamespace

    from lmscli.plan.tuning import _RunSearch

    search = _RunSearch(budget=100_000, margin=0)
    search.judged(SimpleNamespace(result=SimpleNamespace(peak_bytes=80_000)), 105_000)
    steps = []
    while (step := search.backoff()) is not None:
        steps.append(step)
    assert steps and steps == sorted(steps, reverse=True) and steps[-1] - 0 <= 2 * (100_000 // 200)


def test_the_run_search_tries_small_margins_while_nothing_fits():
    """The plan for a slightly smaller budget can be another plan, one the graph TensorFlow runs
    needs less with: while nothing fits, margins of 1-6% of the budget are tried, also past the
    round limit (QA: a two-loss net planned at 77% and 79% of its peak, not at 78%); once a plan
    fits, the search keeps the round limit."""
    from types import SimpleNamespace

    from lmscli.plan.tuning import BRACKET_ROUNDS, RUN_ROUNDS, SMALL_MARGINS, _RunSearch

    search = _RunSearch(budget=100_000, margin=0)
    over = SimpleNamespace(result=SimpleNamespace(peak_bytes=99_000))
    margins = [search.judged(over, 101_000) for _ in range(RUN_ROUNDS + len(SMALL_MARGINS) + 1)]
    assert [m for m in margins[RUN_ROUNDS - 1:] if m is not None] == [1_000 * k for k in SMALL_MARGINS]
    assert margins[-1] is None
    fitted = _RunSearch(budget=100_000, margin=0)
    fitted.judged(SimpleNamespace(result=SimpleNamespace(peak_bytes=90_000)), 90_000)  # fits (not within 3%)
    assert [fitted.judged(over, 101_000) for _ in range(RUN_ROUNDS + BRACKET_ROUNDS)][-1] is None
    assert _RunSearch(budget=100_000, margin=0, ladder=False).ladder() is None


def test_a_judged_no_plan_far_over_the_budget_says_how_far():
    """QA r51: "try a slightly larger --gpu-mem" where the closest recompute-only plan needed 1.93x
    the budget; the advice now says how far, and for recomputation alone, the other strategies."""
    from types import SimpleNamespace

    from lmscli.errors import NoFitError
    from lmscli.plan.tuning import _RunSearch

    stuck = NoFitError("no recompute plan found under 11.05 MiB: at x the recompute strategy still needs 22 MiB; "
                       "try a slightly larger --gpu-mem")
    for closest, kind, expected in ((105_000, "recompute", "try a slightly larger --gpu-mem"),
                                    (193_000, "recompute", "the closest plan needed 1.93x the budget: try a --gpu-mem "
                                     "that leaves 188.48 KiB after --reserve or --strategy hybrid"),
                                    (193_000, "swap or recompute", "1.93x the budget: try a --gpu-mem that leaves "
                                     "188.48 KiB after --reserve; ")):
        search = _RunSearch(budget=100_000, margin=0)
        search.judged(SimpleNamespace(result=SimpleNamespace(peak_bytes=90_000)), closest)
        text = str(search.missed(NoFitError(str(stuck).replace("recompute", kind, 1))))
        assert (expected in text + "; ") and text.count("try ") == 1, text
    # Planning for less answered with the lower bound ("can fit"), not "found under": the kind is
    # still its head (QA r52: the answer said the whole explanation twice).
    bound = NoFitError("no swap or recompute plan can fit under 13.19 MiB on a GPU, by lms's model of its executor: "
                       "when x runs the step holds 14.03 MiB > 13.19 MiB")
    text = str(search.missed(bound))
    assert text.startswith("no swap or recompute plan found under") and text.count("holds 14.03 MiB") == 1, text
    # Every round judged over and the search settled (QA r54: two towers, 1.41x, "slightly larger").
    for closest, expected in ((105_000, "> 97.66 KiB after 1 round(s); try a slightly larger --gpu-mem"),
                              (141_000, "still needs 137.70 KiB > 97.66 KiB after 1 round(s); the closest plan needed "
                               "1.41x the budget: try a --gpu-mem that leaves 137.70 KiB after --reserve")):
        search = _RunSearch(budget=100_000, margin=0)
        search.judged(SimpleNamespace(result=SimpleNamespace(peak_bytes=90_000),
                                      plan=SimpleNamespace(predicted={"run_peak_bytes": closest})), closest)
        with pytest.raises(NoFitError) as settled:
            search.best()
        assert expected in str(settled.value) and str(settled.value).count("try ") == 1, str(settled.value)


def test_the_run_search_halves_between_a_margin_over_the_budget_and_one_that_fits():
    """Once a margin was judged over the budget below one judged fitting, the next margins halve
    the bracket (steps by the judge's figures went back and forth between the same two plans: a
    DenseNet-style net on PCIe 3, 5.56 GiB then 8.11 GiB over 6.86, five rounds); the rounds go on
    past RUN_ROUNDS while the bracket is wider than 0.5% of the budget, and not on the stand-in."""
    from types import SimpleNamespace

    from lmscli.plan.tuning import BRACKET_ROUNDS, RUN_ROUNDS, _RunSearch

    def run_peak(margin):  # a plan's need jumps: 56,000 from a margin of 3,000 on, 81,000 below
        return 56_000 if margin >= 3_000 else 81_000

    for refine in (True, False):
        search = _RunSearch(budget=70_000, margin=10_000, ladder=refine)
        margins, margin = [], 10_000
        while margin is not None:
            margins.append(margin)
            margin = search.judged(SimpleNamespace(result=SimpleNamespace(peak_bytes=70_000 - margin)),
                                   run_peak(margin))
        assert margins[:2] == [10_000, -4_000]  # the judge's step: 14,000 under the budget
        assert margins[2] == 3_000  # ... then half-way between -4,000 (over) and 10,000 (fits)
        fits = [m for m in margins if run_peak(m) <= 70_000]
        assert all(m in fits or m < min(fits) for m in margins)  # (nothing tried above a fitting margin)
        if refine:
            assert len(margins) <= RUN_ROUNDS + BRACKET_ROUNDS and min(fits) == 3_000
            assert max(m for m in margins if m < 3_000) >= 3_000 - 70_000 // 200
        else:
            assert len(margins) == RUN_ROUNDS


def test_a_fraction_of_a_mib_is_judged_under_the_whole_mib_below(capsys):
    """QA r48: `lms rewrite --stand-in --gpu-mem 4.5MiB` was judged and proven under 4 MiB (the
    stand-in's allocator takes whole MiB), and only `lms verify` said so."""
    from lmscli import api
    from lmscli.cli import _whole_mib_note

    _whole_mib_note(api.make_device(gpu_mem=int(4.5 * 2**20)), stand_in=True, quiet=False)
    assert "--gpu-mem 4.50 MiB is judged under 4.00 MiB" in capsys.readouterr().err
    for device, stand_in, quiet in ((api.make_device(gpu_mem=4 << 20), True, False),
                                    (api.make_device(gpu_mem=int(4.5 * 2**20)), False, False),
                                    (api.make_device(gpu_mem=int(4.5 * 2**20)), True, True)):
        _whole_mib_note(device, stand_in=stand_in, quiet=quiet)
        assert capsys.readouterr().err == ""


def test_a_plan_turned_down_while_the_variables_were_initialised_says_so():
    """QA r54: a GAN's stand-in runs ran out of memory initialising its 7 MiB of variables and
    slots under 11 MiB, before any step; the answer advised planning for less (no plan changes
    that need) and `verify` blamed the runs' variation."""
    from lmscli.errors import NoFitError
    from lmscli.plan.tuning import _RunSearch
    from lmscli.prove.standin import INIT_PHASE, _oom_message, in_initialisation

    search = _RunSearch(budget=12 << 20, margin=0)
    search.note = _oom_message("OOM when allocating tensor", INIT_PHASE, 11 << 20, "w/Adam/Initializer/zeros", None)
    assert in_initialisation(search.note)
    text = str(search.turned_down(NoFitError("no swap plan found under 10 MiB: at x ...; try a larger --gpu-mem")))
    assert "initialisation ran out of memory before any step ran" in text and "planning for less" not in text, text
    assert text.endswith("try a larger --gpu-mem")
    search.note = _oom_message("OOM when allocating tensor", "running the step", 11 << 20, "x", None)
    assert not in_initialisation(search.note)
    assert "planning for less, to make room" in str(search.turned_down(NoFitError("no plan found; try it")))


def test_an_output_named_for_the_other_format_gets_a_note(tmp_path, samples, runner):
    """QA r54: `lms rewrite model.meta out.pb` wrote a MetaGraphDef (the input's format) into a
    .pb without a word; a note says so (and none when the name fits, or with -q)."""
    other = invoke(runner, "rewrite", samples / "mlp.meta", tmp_path / "out.pb", "--gpu-mem", "1GiB")
    assert other.exit_code == 0, other.output
    assert "out.pb holds a MetaGraphDef, not the GraphDef its name suggests: lms writes the format it read" in other.stderr
    for args in ((tmp_path / "out.meta",), (tmp_path / "again.pb", "-q")):
        done = invoke(runner, "rewrite", samples / "mlp.meta", *args, "--gpu-mem", "1GiB")
        assert done.exit_code == 0 and "its name suggests" not in done.stderr, done.output
