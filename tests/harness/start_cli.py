"""A `cputrain` command forked from the warm interpreter and not waited for: for a test that reads
its output while it works, signals it, then waits for its exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Self

from harness import tiers
from harness.repo import REPO
from harness.warm_client import warm, with_forked_ranks


class WarmProcess:
    """A `cputrain` command forked from the warm interpreter and not waited for (start_cli): a test
    reads its stderr while it runs, signals it, then waits for its exit code. As a context
    manager, a command still running at the end is killed with everything under it."""

    def __init__(self, argv: list[str], cwd):
        self.pid, self._out, self._err = warm().start(argv, cwd)
        self.returncode: int | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if self.returncode is None:
            self.kill_tree()

    @staticmethod
    def _text(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""  # the child opens it after the fork

    def stderr(self) -> str:
        """What it has written to stderr so far (all of it once it has ended)."""
        return self._text(self._err)

    def stdout(self) -> str:
        return self._text(self._out)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = warm().returncode(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = warm().returncode(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"cputrain (pid {self.pid})", timeout, None, self.stderr())
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once it has ended, as Popen.communicate gives them; past `timeout` it is
        killed with everything under it (the warm interpreter must not wait on it for the next
        test), then TimeoutExpired."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            raise
        return self.stdout(), self.stderr()

    def kill_tree(self) -> None:
        """SIGKILL to the command and every process under it, as a node loss would: each is
        stopped first (so none starts another or sees another die), then all are killed."""
        import psutil

        stopped: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.pid)
            while new := [p for p in with_forked_ranks([root, *root.children(recursive=True)]) if p.pid not in stopped]:
                for p in new:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.send_signal(signal.SIGSTOP)
                    stopped[p.pid] = p
        for p in stopped.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        self.wait(60)


def start_cli(*args, cwd=None) -> WarmProcess:
    """`python -m cputrain ARGS` forked from the warm interpreter, as run_cli does, but not waited
    for: for a test that signals a command while it works. One at a time: wait for it (or kill
    it) before the next run_cli; use it as a context manager so a failing test leaves nothing
    running."""
    tiers.refuse_training_in_fast_tier(args)
    return WarmProcess([str(a) for a in args], cwd or REPO)
