"""The CLI shell: help, version, lazy TensorFlow import, usage errors."""

import subprocess
import sys

from lmscli import __version__
from tests.conftest import invoke


def test_help_and_version_do_not_import_tensorflow():
    code = (
        "import sys\n"
        "from lmscli.cli import main\n"
        "for args in (['--help'], ['--version'], ['analyze', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "analyze" in done.stdout and __version__ in done.stdout


def test_usage_error_is_exit_2(runner):
    result = invoke(runner, "analyze")
    assert result.exit_code == 2
    result = invoke(runner, "nonsense")
    assert result.exit_code == 2
    result = invoke(runner, "analyze", "x.pb", "--batch-size", "0")
    assert result.exit_code == 2


def test_console_script_entry_point():
    done = subprocess.run([sys.executable, "-m", "lmscli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and __version__ in done.stdout
