"""The client of the warm interpreter (warm_interpreter.py): one server per test process, started on
first use, that forks each `cputrain` command from an interpreter that has imported torch and
transformers; and beside it the rank server that forks the ranks of the commands' torchrun agents."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.cli_env import cli_env
from harness.rank_server import WARM_INTERPRETER, RankServer
from harness.repo import REPO


class WarmInterpreter:
    """The command server and the rank server, their files in one temporary folder."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="cputrain-warm-"))
        self.log = open(self.folder / "server.log", "w")  # noqa: SIM115 (open while the server lives)
        # The ranks of a command's torchrun agent are forked by a second warm server; the agent runs
        # rank_python.py as their `python` (torchrun's PYTHON_EXEC).
        self.ranks = RankServer(self.folder, self.log, cli_env())
        self.server = subprocess.Popen([sys.executable, str(WARM_INTERPRETER)], cwd=REPO,
                                       env=cli_env(**self.ranks.exec_env()), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.calls = 0

    def _answer(self, key: str, timeout_s: float | None):
        import select

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.server.stdout], [], [], wait)[0]:
                return None
            line = self.server.stdout.readline()
            if not line:
                raise RuntimeError(f"the warm interpreter ended: {(self.folder / 'server.log').read_text()[-2000:]}")
            with contextlib.suppress(ValueError):
                answer = json.loads(line)
                if key in answer:
                    return answer[key]

    def start(self, argv: list[str], cwd, environ: dict | None = None,
              fork_spawns: bool = False) -> tuple[int, Path, Path]:
        """Fork `python -m cputrain ARGV` (in `environ`, where given); its pid and the files of its
        stdout and stderr. The server forks nothing else until returncode() has answered for it.
        `fork_spawns`: the processes it spawns (multiprocessing) are forked by the rank server too,
        where its environment names the rank server (warm_interpreter._fork_spawns)."""
        self.calls += 1
        out, err = self.folder / f"{self.calls}.out", self.folder / f"{self.calls}.err"
        request = {"argv": argv, "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "fork_spawns": fork_spawns}
        if environ is not None:
            request["environ"] = environ
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        return self._answer("pid", None), out, err

    def returncode(self, timeout_s: float | None) -> int | None:
        """The exit code of the started command, or None if it has not ended within timeout_s."""
        return self._answer("returncode", timeout_s)

    def run(self, argv: list[str], cwd, timeout_s: float, environ: dict | None = None) -> subprocess.CompletedProcess:
        pid, out, err = self.start(argv, cwd, environ, fork_spawns=True)
        code = self.returncode(timeout_s)
        timed_out = code is None
        if timed_out:  # as subprocess.run does: kill it, then raise
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            self._answer("returncode", None)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        cmd = [sys.executable, "-m", "cputrain", *argv]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout_s, stdout, stderr)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=30)
        self.ranks.close()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_WARM: list[WarmInterpreter] = []  # this test process's, once started


def warm() -> WarmInterpreter:
    if not _WARM:
        _WARM.append(WarmInterpreter())
    return _WARM[0]


def close_warm() -> None:
    """At the session's end: the servers end, their folder is removed."""
    for server in _WARM:
        server.close()


def with_forked_ranks(processes: list) -> list:
    """`processes` (psutil) and, for each that stands in for a rank the warm rank server forked,
    that rank: it is not under the agent in the process tree, nor named by its command line."""
    import psutil

    ranks = []
    for p in processes:
        pid = _WARM[0].ranks.forked_rank(p.pid) if _WARM else None
        with contextlib.suppress(psutil.NoSuchProcess):
            if pid is not None:
                ranks.append(psutil.Process(pid))
    return [*ranks, *processes]
