"""`python -m cputrain ARGS` in a process of its own, waited for: what most tests run."""

from __future__ import annotations

import subprocess
import sys

from harness import tiers
from harness.cli_env import cli_env
from harness.repo import REPO
from harness.warm_client import warm


def run_cli(*args, cwd=None, env=None, timeout=600, check=False, fresh=False) -> subprocess.CompletedProcess:
    """`python -m cputrain ARGS` in a process of its own, as a user would run it: forked from a
    warm interpreter (warm_interpreter.py) that has imported torch and transformers, or a fresh
    interpreter where the call sets its own environment, asks for one (`fresh=True`), or the test is
    marked `fresh_interpreter` (it measures a process's memory). `fresh="ranks"`: the command (the
    launcher and its torchrun agent) forked warm in the test's environment, the ranks it starts
    fresh interpreters, as a user's are: for a test that measures the ranks' memory, not the
    launcher's (it saves the launcher's imports, ~4.7 s of CPU)."""
    tiers.refuse_training_in_fast_tier(args)
    argv = [str(a) for a in args]
    if fresh == "ranks" and env is None and not tiers.RUNNING["fresh"]:
        proc = warm().run(argv, cwd or REPO, timeout, environ=cli_env())
    elif env is None and not fresh and not tiers.RUNNING["fresh"]:
        proc = warm().run(argv, cwd or REPO, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "cputrain", *argv],
            cwd=cwd or REPO, env=env or cli_env(), capture_output=True, text=True, timeout=timeout,
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"cputrain {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc
