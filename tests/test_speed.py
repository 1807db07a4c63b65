"""Speed tooling: the per-phase profile, --time-limit, the progress line, and Grappler's
optimizations in a second process. Functional checks only: times are measured by bench/phases.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import ROOT, invoke


def test_profile_lists_the_phases(samples, runner):
    res = invoke(runner, "tune", samples / "cnn.meta", "--gpu-mem", "80%", "--reserve", "0", "-q", "--profile")
    assert res.exit_code == 0, res.stderr
    for phase in ("time by phase", "load", "prepare", "shape inference", "Grappler's scheduler", "tune", "plan",
                  "emit", "guard", "judge", "Grappler's estimate"):
        assert phase in res.stderr, phase
    assert res.stdout == ""


def test_verify_and_measure_say_where_their_time_went(samples, runner, tmp_path):
    """`lms verify` and `lms measure` take --profile and --profile-out like the planning commands
    (a CI gate's minutes go to traced steps and runs on the stand-in: now they are told)."""
    out = tmp_path / "verify.prof.json"
    done = invoke(runner, "verify", samples / "mlp.meta", samples / "mlp.meta", "--no-measure", "--profile-out", out)
    assert done.exit_code == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "lms.profile" and doc["command"] == "verify"
    names = [phase["phase"] for phase in doc["phases"]]
    assert "load" in names and "train both graphs" in names, names
    done = invoke(runner, "measure", samples / "mlp.meta", "--runs", "1", "--profile")
    assert done.exit_code == 0, done.stderr
    for phase in ("time by phase", "find the smallest limit", "predict", "traced steps on the stand-in",
                  "bisection on the stand-in"):  # (QA r45: the bisection's runs had no row of their own)
        assert phase in done.stderr, phase


def test_time_limit_returns_the_best_fitting_plan_found(samples, runner):
    """A limit that has passed before planning starts: the first fitting plan comes back, marked,
    and it swaps at least as much as the plan found without a limit."""
    args = ("tune", samples / "resnet50.meta", "--gpu-mem", "85%", "--reserve", "0", "--json", "--strategy", "swap")
    limited = invoke(runner, *args, "--time-limit", "0.001", "-v")
    assert limited.exit_code == 0, limited.stderr
    doc = json.loads(limited.stdout)
    assert doc["fits"] and doc["time_limited"]
    assert "stopped at --time-limit" in limited.stderr
    free = json.loads(invoke(runner, *args).stdout)
    assert free["fits"] and not free["time_limited"]
    assert doc["plan"]["predicted"]["swap_out_bytes"] >= free["plan"]["predicted"]["swap_out_bytes"]
    assert doc["plan"]["predicted"]["run_peak_bytes"] <= doc["plan"]["device"]["budget_bytes"]


def test_optimizations_in_a_second_process_equal_the_in_process_ones():
    """In a fresh process (few threads) the optimization is forked; its GraphDef is the same as the
    one computed in-process, and a cancelled child is reaped."""
    script = textwrap.dedent(f"""
        import os
        from lmscli import api, forked, grappler
        model = api.load({str(ROOT / "sample_graphs" / "cnn.meta")!r})
        forkable = forked.may_fork()  # this process runs no more threads than after importing TF
        pending = grappler.optimize_in_parallel(model.meta_graph, model.fetches)
        assert (pending.pid is not None) == forkable
        forked = pending()
        here = grappler.optimize(model.meta_graph, model.fetches)
        assert forked.SerializeToString(deterministic=True) == here.SerializeToString(deterministic=True)
        os.environ["LMS_NO_FORK"] = "1"
        assert grappler.optimize_in_parallel(model.meta_graph, model.fetches).pid is None
        del os.environ["LMS_NO_FORK"]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_forked_functions_result_and_error_reach_the_caller():
    """lmscli.forked runs a function in a child process: its result comes back, and an LmsError it
    raises is raised in the caller with the same message (Grappler's scheduler refusing a graph
    falls back to the roofline model on that error)."""
    script = textwrap.dedent("""
        import os

        from lmscli import forked
        from lmscli.errors import LmsError

        def where(values):
            return sorted(values), os.getpid()

        def refuse(text):
            raise LmsError(f"{text} (in {os.getpid()})")

        forkable = forked.may_fork()
        done = forked.start("test", where, [3, 1, 2])
        assert (done.pid is not None) == forkable
        values, pid = done()
        assert values == [1, 2, 3] and (pid != os.getpid()) == forkable
        try:
            forked.start("test", refuse, "Grappler could not schedule the graph")()
        except LmsError as exc:
            text, _, pid = str(exc).rpartition(" (in ")
            assert text == "Grappler could not schedule the graph" and (pid != f"{os.getpid()})") == forkable
        else:
            raise AssertionError("no error")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_cancelled_child_is_reaped():
    script = textwrap.dedent(f"""
        import os
        from lmscli import api, forked, grappler
        model = api.load({str(ROOT / "sample_graphs" / "resnet50.meta")!r})
        if not forked.may_fork():
            print("ok")  # nothing forked on this system: nothing to reap
            raise SystemExit(0)
        pending = grappler.optimize_in_parallel(model.meta_graph, model.fetches)
        pid = pending.pid
        assert pid is not None
        pending.cancel()
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_progress_line_shows_the_library_step():
    import io

    from rich.console import Console

    from lmscli import timing
    from lmscli.progress import Progress

    with timing.Clock() as clock:
        progress = Progress(Console(file=io.StringIO(), force_terminal=True))
        assert clock.listener == progress.detail
        with progress.phase("tuning"):
            with timing.phase("judge"):
                timing.step("round 2: planning")
                assert "judge: round 2: planning" in str(progress._status.status)
        progress.detail("after the pass")  # no status line any more: ignored
    assert [t.path for t in clock.table()] == [("judge",)]
    assert clock.table()[0].calls == 1


def test_phases_nest_and_sum():
    from lmscli import timing

    with timing.Clock() as clock:
        for _ in range(2):
            with timing.phase("outer"):
                with timing.phase("inner"):
                    pass
        with timing.phase("inner"):
            pass
    paths = {t.path: t.calls for t in clock.table()}
    assert paths == {("outer",): 2, ("outer", "inner"): 2, ("inner",): 1}
    assert not timing.out_of_time()
