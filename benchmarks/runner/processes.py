"""A measurement in a fresh Python process: the environment it runs in, the JSON line it prints,
and its own peak RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


def env() -> dict:
    """This process's environment without a launcher's rank variables (a child is a run of its own),
    offline, unbuffered, with the tokenizers' own threads off."""
    e = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    e.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    return e


def run_child(script: str, *args: str) -> dict:
    """Run `script --child ARGS...` in a fresh interpreter; its last stdout line is a JSON dict."""
    proc = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, env=env(), cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_measured(cmd: list[str]) -> tuple[str, str, int, float]:
    """(stdout, stderr, exit code, peak RSS in GiB) of `cmd`: the peak is wait4's ru_maxrss, that
    process and any it waited for, over its whole life."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env(), cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        return out.read(), err.read(), proc.returncode, usage.ru_maxrss * 1024 / GIB
