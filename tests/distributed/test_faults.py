"""A lost rank: the agent restarts the group, which resumes from the newest complete checkpoint
and ends with the weights of a run never interrupted; a kill during a checkpoint write leaves
the previous checkpoint loadable."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.run_cli import run_cli
from harness.start_cli import start_cli
from harness.tiny_run import tiny_overrides
from harness.warm_client import warm
from dist_helpers import assert_no_survivors, free_port, processes_mentioning

pytestmark = pytest.mark.slow

LONG = {"train.max_steps": 40, "train.checkpoint_every": 5, "train.eval_every": 100, "data.seq_len": 64}


def _start(out, cache_dir, *flags, **extra):
    """`cputrain train` forked from the warm interpreter as run_cli does (no fresh interpreter's
    seconds of imports), not waited for."""
    return start_cli("train", *tiny_overrides(out, cache_dir, **{**LONG, **extra}), *flags)


def _start_under_outside_torchrun(out, cache_dir):
    """torchrun as the user's own launcher, with its store shared across restart rounds."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "-m", "cputrain", "train", *tiny_overrides(out, cache_dir, **LONG)]
    # its ranks (and those of each restart) forked by the warm rank server through PYTHON_EXEC, as the
    # ranks of cputrain's own agent are: a rank's stand-in killed takes its rank with it
    env = cli_env(**warm().ranks.exec_env())
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rank_process(out, local_rank: int):
    for p in processes_mentioning(str(out)):
        try:
            if p.environ().get("LOCAL_RANK") == str(local_rank) and "TORCHELASTIC_RUN_ID" in p.environ():
                return p
        except Exception:
            continue
    return None


def _wait_for(predicate, timeout_s: float, poll_s: float = 0.005):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return None


RESTART_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir):
    ref = tmp_path_factory.mktemp("uninterrupted")
    run_cli("train", *tiny_overrides(ref, cache_dir, **LONG), "--nproc-per-node", "2", check=True)
    return ref


@pytest.mark.parametrize("launcher", ["cputrain", "outside-torchrun"])
def test_sigkill_of_a_rank_restarts_and_ends_with_the_same_weights(uninterrupted, tmp_path, cache_dir, launcher):
    out = tmp_path / "killed"
    if launcher == "cputrain":
        proc = _start(out, cache_dir, "--nproc-per-node", "2", "--max-restarts", "2")
    else:
        proc = _start_under_outside_torchrun(out, cache_dir)
    assert _wait_for(lambda: (out / "checkpoints" / "step-000010").is_dir(), 300), "no checkpoint appeared"
    victim = _rank_process(out, 1)
    assert victim is not None
    killed_at = len((out / "metrics.jsonl").read_text().splitlines())
    victim.send_signal(signal.SIGKILL)
    try:
        _, stderr = proc.communicate(timeout=RESTART_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in processes_mentioning(str(out)):
            p.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"the restarted group did not finish within {RESTART_TIMEOUT_S} s:\n{stderr[-3000:]}")
    # Every restarted group must form: a stale address from the killed round fails it here.
    assert proc.returncode == 0, stderr[-3000:]
    assert killed_at < 40, "the run ended before the kill; the test proved nothing"
    assert "resumed from" in stderr
    a = load_file(str(uninterrupted / "model" / "model.safetensors"))
    b = load_file(str(out / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=f"{key} differs after the restart")
    assert_no_survivors(out)


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path, cache_dir):
    out = tmp_path / "run"
    for attempt in range(3):  # the write takes milliseconds; try again if the kill missed it
        proc = _start(out, cache_dir, "--nproc-per-node", "2")
        assert _wait_for(lambda: (out / "checkpoints" / "step-000005").is_dir(), 300)
        tmp = out / "checkpoints" / "step-000010.tmp"
        caught = _wait_for(lambda: tmp.is_dir() and (tmp / "state").is_dir(), 120, poll_s=0.001)
        for p in processes_mentioning(str(out)):
            if p.pid != proc.pid:
                p.send_signal(signal.SIGKILL)  # every rank dies mid-write, as in a node loss
        proc.kill()
        proc.communicate()
        if caught and tmp.is_dir():
            break
        import shutil

        shutil.rmtree(out)
    else:
        pytest.skip("the kill never landed inside a checkpoint write on this machine")
    assert not (out / "checkpoints" / "step-000010").exists()
    resumed = run_cli("train", *tiny_overrides(out, cache_dir, **{**LONG, "train.max_steps": 12}),
                      "--nproc-per-node", "2", check=True)
    assert "step 5" in resumed.stderr or "step-000005" in resumed.stderr
    assert (out / "checkpoints" / "step-000012").is_dir()
    assert_no_survivors(out)


def test_sigterm_to_the_agent_saves_where_the_ranks_are_and_resumes_exactly(uninterrupted, tmp_path, cache_dir):
    """A pod's SIGTERM reaches the agent: it forwards it, both ranks finish the step they are in,
    agree on it, save a checkpoint there and exit 75; the agent ends with one line and no
    traceback. The same command then resumes and ends with the uninterrupted run's weights."""
    out = tmp_path / "stopped"
    proc = _start(out, cache_dir, "--nproc-per-node", "2")
    metrics = out / "metrics.jsonl"
    assert _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 7, 300), "no steps logged"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=RESTART_TIMEOUT_S)
    assert proc.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("cputrain: stopped by SIGTERM") and "re-run the same command" in last, last
    reached = max(int(line.split('"step": ')[1].split(",")[0]) for line in metrics.read_text().splitlines())
    assert 7 <= reached < 40
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps[-1] == f"step-{reached:06d}", (steps, reached)  # saved where the ranks stopped, not at a multiple of 5
    assert not (out / "run.lock").exists()
    assert_no_survivors(out)

    resumed = run_cli("train", *tiny_overrides(out, cache_dir, **LONG), "--nproc-per-node", "2", check=True)
    assert f"(step {reached})" in resumed.stderr
    a = load_file(str(uninterrupted / "model" / "model.safetensors"))
    b = load_file(str(out / "model" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=f"{key} differs after the stop")


def test_a_killed_rank_without_restarts_ends_in_one_line_naming_it(tmp_path, cache_dir):
    """Rank 1 dies (SIGKILL, as the OOM killer does); rank 0's next collective fails on the closed
    socket. The agent's last line names rank 1, not rank 0, and no rank prints a traceback."""
    out = tmp_path / "killed"
    proc = _start(out, cache_dir, "--nproc-per-node", "2")  # launch.max_restarts: 0
    metrics = out / "metrics.jsonl"
    assert _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, 300), "no steps logged"
    victim = _rank_process(out, 1)
    assert victim is not None
    victim.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=RESTART_TIMEOUT_S)
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    # The agent may see rank 0 fail too (its collective) or stop it first: 1 or 2 failed ranks.
    assert re.match(r"cputrain: error: [12] rank\(s\) failed; rank 1 first: exited with SIGKILL", last), last
    assert_no_survivors(out)
