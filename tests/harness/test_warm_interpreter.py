"""run_cli forks most commands from a warm interpreter (tests/harness/warm_interpreter.py): what a test sees
of such a process — exit code, stdout, stderr, a timeout — is what it sees of a fresh one."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides

pytestmark = pytest.mark.slow  # one test trains until its timeout; both were in tests/e2e's slow tier


def _both(*args) -> dict[str, subprocess.CompletedProcess]:
    return {"warm": run_cli(*args), "fresh": run_cli(*args, fresh=True)}


def test_a_refusal_and_a_report_are_the_same_from_either_interpreter():
    refused = _both("train", "no.such.key=1")
    assert refused["warm"].returncode == refused["fresh"].returncode == 2
    assert refused["warm"].stderr == refused["fresh"].stderr
    assert refused["warm"].stderr.strip().startswith("cputrain: error: unknown config key")
    facts = _both("doctor", "--json")
    warm, fresh = (json.loads(facts[k].stdout) for k in ("warm", "fresh"))
    assert warm["cpu_model"] == fresh["cpu_model"] and warm["flags"] == fresh["flags"]


def test_a_command_past_its_timeout_is_killed_as_subprocess_kills_it(tmp_path, cache_dir):
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("train", *tiny_overrides(tmp_path / "run", cache_dir, **{"train.max_steps": 10**6}),
                timeout=3)
    # the server is free again: the next command runs
    assert run_cli("train", "no.such.key=1").returncode == 2
