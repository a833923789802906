"""One writer per run folder: a second run on the same output_dir is refused naming the first;
a killed run's lock is taken over at once on the same host; metrics.jsonl holds each step once,
as valid JSON, after any sequence of kills and restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.run_cli import run_cli
from harness.start_cli import start_cli
from harness.tiny_run import tiny_overrides

LOCK = "run.lock"


def _start(out, cache_dir, **extra) -> subprocess.Popen:
    args = [sys.executable, "-m", "cputrain", "train", *tiny_overrides(out, cache_dir, **extra)]
    return subprocess.Popen(args, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _rows(out) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # an append in progress
    return rows


def _wait_for(predicate, timeout_s: float = 120, poll_s: float = 0.005):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    raise AssertionError("timed out")


def _strict_rows(out) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_second_run_is_refused_and_a_killed_ones_lock_taken_over(tmp_path, cache_dir):
    out = tmp_path / "run"
    endless = {"train.max_steps": 100000, "train.checkpoint_every": 10, "train.eval_every": 100000}
    first = _start(out, cache_dir, **endless)
    try:
        _wait_for(lambda: len(_rows(out)) >= 3)
        holder = json.loads((out / LOCK).read_text())
        assert holder["pid"] == first.pid
        rows_before = len(_rows(out))
        second = run_cli("train", *tiny_overrides(out, cache_dir, **endless))
        assert second.returncode == 2, second.stderr[-3000:]
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"cputrain: error: output_dir '{out}' is in use by another run (host {holder['host']}, "
                               f"pid {first.pid}, user {holder['user']}, since {holder['since']}, last heartbeat "), line
        assert "Traceback" not in second.stderr
        assert first.poll() is None, "the first run goes on"
        assert len(_rows(out)) > rows_before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (out / LOCK).exists()  # a SIGKILL releases nothing
    _wait_for(lambda: any((out / "checkpoints").glob("step-*[0-9]")))
    step = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*[0-9]"))
    third = run_cli("train", *tiny_overrides(out, cache_dir, **{**endless, "train.max_steps": step + 3}))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"its process {first.pid} on this host has ended" in third.stderr
    assert not (out / LOCK).exists()  # released at the end
    steps = [r["step"] for r in _strict_rows(out)]
    assert steps == list(range(1, step + 4)), steps


def test_metrics_rows_are_unique_after_kills_and_restarts(tmp_path, cache_dir):
    out = tmp_path / "run"
    common = {"train.max_steps": 60, "train.checkpoint_every": 7, "train.eval_every": 5}
    for kill_after_step in (4, 16, 30, 45):
        # forked warm (start_cli): each start is the run's, not ~4 s of a fresh interpreter's imports
        with start_cli("train", *tiny_overrides(out, cache_dir, **common)) as run:
            _wait_for(lambda: run.poll() is not None or any(r["step"] >= kill_after_step for r in _rows(out)))
            run.send_signal(signal.SIGKILL)
            run.wait(60)
        if kill_after_step == 30:  # as if killed in the middle of an append
            with open(out / "metrics.jsonl", "a") as f:
                f.write('{"step": 31, "loss": 3.1')
    last = run_cli("train", *tiny_overrides(out, cache_dir, **common))
    assert last.returncode == 0, last.stderr[-3000:]
    rows = _strict_rows(out)
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 61)), f"each step once, in order: {steps}"
    assert [r["step"] for r in rows if "val_loss" in r] == list(range(5, 61, 5))
    assert not (out / LOCK).exists()


def test_take_over_lock_flag(tmp_path, cache_dir):
    """A lock of a run on another host with a fresh heartbeat: refused; --take-over-lock takes it."""
    out = tmp_path / "run"
    out.mkdir()
    holder = {"token": "other", "host": "node-b", "pid": 4242, "user": "ana", "since": "2026-01-01T00:00:00Z",
              "heartbeat_s": time.time() + 3600}  # fresh for the hour this test may take
    (out / LOCK).write_text(json.dumps(holder))
    args = tiny_overrides(out, cache_dir, **{"train.max_steps": 2})
    refused = run_cli("train", *args)
    assert refused.returncode == 2
    assert "host node-b, pid 4242, user ana, since 2026-01-01T00:00:00Z" in refused.stderr.strip().splitlines()[-1]
    assert not (out / "metrics.jsonl").exists()
    taken = run_cli("train", *args, "--take-over-lock")
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert "taking over run.lock" in taken.stderr and "--take-over-lock" in taken.stderr
    assert [r["step"] for r in _strict_rows(out)] == [1, 2] and not (out / LOCK).exists()
