"""run_cli forks each command from the warm interpreter, except where only a fresh interpreter will
do: a call with an environment of its own (the warm server's was fixed when it started), `fresh=True`,
and a test marked `fresh_interpreter`.

What tells the two apart: PYTHONPROFILEIMPORTTIME is read once, as an interpreter starts, and makes
it write `import time:` lines on stderr. A command forked from the warm server, started long before
the variable was set, writes none, whatever environment it is given; a fresh interpreter with the
variable writes them. `cputrain --help` costs a fresh interpreter a fraction of a second."""

from __future__ import annotations

import pytest

from harness.cli_env import cli_env
from harness.run_cli import run_cli
from harness.warm_client import warm

IMPORT_TIMES = "import time:"


def _ran_fresh(proc) -> bool:
    assert proc.returncode == 0 and proc.stdout.startswith("usage: cputrain"), proc.stderr[-2000:]
    return IMPORT_TIMES in proc.stderr


@pytest.fixture
def import_times_in_the_environment(monkeypatch):
    """PYTHONPROFILEIMPORTTIME set in this test's environment, after the warm server has started
    (so the server, and what it forks, never sees it)."""
    warm()
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")


def test_a_call_with_its_own_environment_starts_a_fresh_interpreter():
    assert not _ran_fresh(run_cli("--help"))
    assert _ran_fresh(run_cli("--help", env=cli_env(PYTHONPROFILEIMPORTTIME="1")))


def test_fresh_starts_a_fresh_interpreter(import_times_in_the_environment):
    assert not _ran_fresh(run_cli("--help"))  # forked warm: the variable is not seen
    assert _ran_fresh(run_cli("--help", fresh=True))


@pytest.mark.fresh_interpreter
def test_a_test_marked_fresh_interpreter_runs_its_commands_fresh(import_times_in_the_environment):
    assert _ran_fresh(run_cli("--help"))


def test_fresh_ranks_forks_the_command_in_the_tests_environment(tmp_path, monkeypatch):
    """fresh="ranks": the command is forked warm (no import times) but runs in the environment the
    test has now, which its agent hands to the fresh ranks it starts: a variable the command reads
    at run time (TORCHELASTIC_ERROR_FILE, where a refused command records its message) is seen."""
    warm()
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    plain = run_cli("plan", "no_such.key=1")
    assert plain.returncode != 0 and not error_file.exists()  # the warm server's environment
    proc = run_cli("plan", "no_such.key=1", fresh="ranks")
    assert proc.returncode == plain.returncode and IMPORT_TIMES not in proc.stderr
    assert "no_such" in error_file.read_text()
