"""Real ranks (gloo on loopback): 1 rank, 2-rank DDP and 2-rank FSDP train the same way, and a
checkpoint saved on 2 ranks resumes on 1 and on 4 ranks into the same loss curve."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides
from dist_helpers import assert_no_survivors, losses

pytestmark = pytest.mark.slow

STEPS = 10
# micro-batch 2 so the global batch of 8 splits on 1, 2 and 4 ranks (accumulation 4, 2, 1)
COMMON = {"train.max_steps": STEPS, "train.micro_batch_size": 2, "train.eval_every": 100}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, trained_run):
    """One rank, trained once per session (test_parity_resume.py and test_zero3.py compare with the same run)."""
    out = tmp_path_factory.mktemp("single") / "run"
    trained_run(out, **COMMON)
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_match_one_rank(strategy, reference, tmp_path, cache_dir):
    out = tmp_path / strategy
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **COMMON, **{"parallel.strategy": strategy}),
                   "--nproc-per-node", "2", check=True)
    assert "2 × 1" in proc.stderr  # the summary names 2 ranks × 1 thread
    ref, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(_rel(got[s], ref[s]) for s in ref)
    assert worst <= 1e-4, f"{strategy} losses drift from 1 rank by {worst:.2e} (relative)"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["comm_sent_bytes"] > 0 and 0 <= r["comm_fraction"] <= 1 for r in rows if "loss" in r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["comm_sent_bytes_per_step"] > 0
    assert (out / "model" / "model.safetensors").is_file()
    assert_no_survivors(out)


def test_saved_on_two_ranks_resumes_on_one_and_four(reference, tmp_path, cache_dir):
    first = tmp_path / "two"
    # stop after 5 of 10 steps with a checkpoint, as a preempted run would
    run_cli("train", *tiny_overrides(first, cache_dir, **COMMON, **{"parallel.strategy": "fsdp",
                                                                   "train.stop_at_step": 5}),
            "--nproc-per-node", "2", check=True)
    assert (first / "checkpoints" / "step-000005").is_dir()
    ref = losses(reference)
    for ranks, strategy in ((1, "single"), (4, "fsdp")):
        out = tmp_path / f"resumed-{ranks}"
        shutil.copytree(first, out)
        overrides = tiny_overrides(out, cache_dir, **COMMON, **{"parallel.strategy": strategy})
        proc = run_cli("train", *overrides, "--nproc-per-node", str(ranks), check=True)
        assert "resumed from" in proc.stderr
        got = losses(out)
        assert sorted(got) == list(range(1, STEPS + 1))
        worst = max(_rel(got[s], ref[s]) for s in range(6, STEPS + 1))
        assert worst <= 1e-4, f"resumed on {ranks} rank(s), losses drift by {worst:.2e}"
        assert_no_survivors(out)
