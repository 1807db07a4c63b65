"""The README's commands run as documented (on the sample graphs), and its exit-code table is true."""

import re
import shlex
from pathlib import Path

from lmscli import errors
from tests.conftest import invoke

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_commands():
    text = README.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if line.strip().startswith("lms ")]


def test_readme_commands_run(samples, runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {
        # (the sample CNN: its steps run on the stand-in in half the U-Net's time)
        "model.meta": str(samples / "cnn.meta"),
        "model.pb": str(samples / "frozen_cnn.pb"),
        "in.meta": str(samples / "cnn.meta"),
        "out.meta": str(tmp_path / "out.meta"),
    }
    commands = readme_commands()
    assert len(commands) >= 7
    # plan.json comes from the tune command that writes it, so run that one first.
    commands.sort(key=lambda c: "--plan-out" not in c)
    for command in commands:
        args = [names.get(a, a) for a in shlex.split(command)[1:]]
        if "--batch-size" in args:
            args[1] = str(samples / "unknown_batch.meta")
        result = invoke(runner, *args)
        assert result.exit_code == 0, (command, result.stderr)


def test_exit_code_table():
    text = README.read_text()
    table = dict(re.findall(r"^\| (\d) \| (.+?) \|$", text, re.M))
    assert table["0"].startswith("success")
    assert "bad input" in table[str(errors.EXIT_ERROR)]
    assert "usage" in table[str(errors.EXIT_USAGE)]
    assert "no plan fits" in table[str(errors.EXIT_NO_FIT)]
    assert "different results" in table[str(errors.EXIT_DIFFERENT)]
    assert "ran out of memory" in table[str(errors.EXIT_OUT_OF_MEMORY)]
