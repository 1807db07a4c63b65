"""Regenerate the README's sample terminal report and docs/unet3d-memory.png.

Run from anywhere: ``.venv/bin/python docs/regenerate.py``. It runs the command shown in the
README (between the ``lms-report`` markers) from the repository's root with an 80-column,
colourless terminal, writes the plot that command names, and puts the output back in the README.
tests/test_reports.py checks that the README still shows what the command prints.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- lms-report:begin -->\n```console\n\$ )(lms [^\n]*)\n.*?(```\n<!-- lms-report:end -->)", re.S)


def command(readme: str) -> str:
    """The ``lms ...`` command line of the README's sample report."""
    match = BLOCK.search(readme)
    if not match:
        raise SystemExit("README.md has no lms-report block")
    return match.group(2)


def main() -> None:
    readme = README.read_text(encoding="utf-8")
    line = command(readme)
    env = dict(os.environ, COLUMNS="80", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("NO_COLOR", None)
    done = subprocess.run([sys.executable, "-m", "lmscli"] + shlex.split(line)[1:], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)
    output = "\n".join(text.rstrip() for text in done.stdout.rstrip("\n").splitlines())
    new = BLOCK.sub(lambda m: f"{m.group(1)}{line}\n{output}\n{m.group(3)}", readme)
    tmp = README.with_name(".README.md.tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, README)  # atomically
    print(f"README.md: {len(output.splitlines())} lines from `{line}`")


if __name__ == "__main__":
    main()
