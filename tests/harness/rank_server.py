"""The client of the rank server (`warm_interpreter.py --ranks`): it forks the ranks a torchrun
agent starts, which run `rank_python.py` as their `python` (torchrun's PYTHON_EXEC)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from harness.repo import HARNESS, REPO

WARM_INTERPRETER = HARNESS / "warm_interpreter.py"
RANK_PYTHON = HARNESS / "rank_python.py"


class RankServer:
    """A rank server started in `folder` (its socket, and the `rank-python` torchrun runs), its
    output in `log`."""

    def __init__(self, folder: Path, log, env: dict):
        self.socket = folder / "ranks.sock"
        self.process = subprocess.Popen([sys.executable, str(WARM_INTERPRETER), "--ranks", str(self.socket)],
                                        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=log, stderr=log)
        self.python = folder / "rank-python"
        self.python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{RANK_PYTHON}" "$@"\n')
        self.python.chmod(0o755)

    def exec_env(self) -> dict:
        """What a torchrun agent's environment needs for its ranks to be forked here."""
        return {"PYTHON_EXEC": self.python, "CPUTRAIN_TEST_RANK_SERVER": self.socket}

    def forked_rank(self, pid: int) -> int | None:
        """The rank a process started as rank_python.py stands in for (None: not such a process)."""
        with contextlib.suppress(OSError, ValueError):
            return int(Path(f"{self.socket}.ranks", str(pid)).read_text())
        return None

    def close(self) -> None:
        """Its stdin closed, the server ends (and every rank still running with it)."""
        self.process.stdin.close()
        self.process.wait(timeout=30)
