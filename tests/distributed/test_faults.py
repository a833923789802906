"""A lost rank: the agent restarts the group, which resumes from the newest complete checkpoint
and ends with the weights of a run never interrupted; a kill during a checkpoint write leaves
the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, cli_env, run_cli, tiny_overrides
from dist_helpers import assert_no_survivors, processes_mentioning

pytestmark = pytest.mark.slow

LONG = {"train.max_steps": 40, "train.checkpoint_every": 5, "train.eval_every": 100, "data.seq_len": 64}


def _start(out, cache_dir, *flags, **extra):
    args = [sys.executable, "-m", "cputrain", "train", *tiny_overrides(out, cache_dir, **{**LONG, **extra}), *flags]
    return subprocess.Popen(args, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


# After the agent restarts the group, creating the new gloo process group sometimes fails or
# never completes (torch 2.13, about one restart in four here): the new rank 0 dials the address
# the killed rank 1 had published in the agent's store in the previous round ("Gloo
# connectFullMesh failed ... Connection refused"), or both new ranks wait in ProcessGroupGloo's
# constructor. That is the store's, not the resume logic's, so such a restart is retried in a
# fresh run folder; a test where every attempt ends that way still fails.
RESTART_ATTEMPTS, RESTART_TIMEOUT_S = 3, 180


def _killed_run(out, cache_dir):
    """Start a 2-rank run, SIGKILL rank 1 after checkpoint 10; (stderr, rows logged before the
    kill), or None when the restarted group could not form its gloo group (see above)."""
    proc = _start(out, cache_dir, "--nproc-per-node", "2", "--max-restarts", "2")
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
        proc.communicate()
        return None
    if proc.returncode != 0 and "connectFullMesh failed" in stderr:
        return None
    assert proc.returncode == 0, stderr[-3000:]
    return stderr, killed_at


def test_sigkill_of_a_rank_restarts_and_ends_with_the_same_weights(tmp_path, cache_dir):
    ref = tmp_path / "uninterrupted"
    run_cli("train", *tiny_overrides(ref, cache_dir, **LONG), "--nproc-per-node", "2", check=True)

    for attempt in range(RESTART_ATTEMPTS):
        out = tmp_path / f"killed-{attempt}"
        result = _killed_run(out, cache_dir)
        if result is not None:
            break
    else:
        pytest.fail(f"the restarted group could not form in any of {RESTART_ATTEMPTS} attempts "
                    f"(hung past {RESTART_TIMEOUT_S} s or gloo connectFullMesh failed)")
    stderr, killed_at = result
    assert killed_at < 40, "the run ended before the kill; the test proved nothing"
    assert "resumed from" in stderr
    a, b = load_file(str(ref / "model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
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
