"""A measurement in a fresh Python process: the environment it runs in, the JSON line it prints,
and its own peak RSS."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
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



def run_measured_child(peer: str, script: str, *args: str) -> tuple[dict, str]:
    """`script --child ARGS...` (the peer's side of a comparison: TRL, peft) in a fresh interpreter:
    the JSON dict of its last stdout line with its whole life's peak RSS (process_peak_rss_gib), and
    its stderr. A failed child raises with its stderr's end, naming `peer`."""
    stdout, stderr, code, process_peak = run_measured([sys.executable, script, "--child", *args])
    if code:
        raise RuntimeError(f"{peer} failed:\n{stderr[-3000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), "process_peak_rss_gib": process_peak}, stderr


def comparison_args(runs: int, child: Callable[[dict], dict]) -> argparse.Namespace | None:
    """The command line of a script that runs its peer's side in a child of itself
    (run_measured_child): --quick, --runs (`runs` by default) and --child OPTS. In the child it runs
    `child(OPTS)`, prints the JSON line the parent reads, and returns None."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return None
    return args
