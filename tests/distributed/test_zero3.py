"""DeepSpeed ZeRO-3 on real gloo ranks: the same losses as one rank (with and without offload),
the user's DeepSpeed file unchanged, resume from an engine checkpoint, a plain-transformers export."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.repo import REPO
from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides
from dist_helpers import assert_no_survivors, losses

pytest.importorskip("deepspeed", reason="strategy zero3 needs the deepspeed extra: scripts/install.sh dev,deepspeed")
pytestmark = pytest.mark.slow

STEPS = 10
COMMON = {"train.max_steps": STEPS, "train.micro_batch_size": 2, "train.eval_every": 100}
USER_FILE = REPO / "configs" / "deepspeed" / "zero3-offload.json"


def _worst(got: dict, ref: dict) -> float:
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    return max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, trained_run):
    """One rank, trained once per session (test_parity_resume.py and test_zero3.py compare with the same run)."""
    out = tmp_path_factory.mktemp("single") / "run"
    trained_run(out, **COMMON)
    return out


@pytest.mark.parametrize("offload", ["none", "optimizer+param"])
def test_zero3_on_two_ranks_matches_one_rank(offload, reference, tmp_path, cache_dir):
    out = tmp_path / "zero3"
    flags = {"parallel.strategy": "zero3"}
    if offload != "none":
        flags.update({"parallel.offload_optimizer": "true", "parallel.offload_param": "true"})
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **COMMON, **flags), "--nproc-per-node", "2", check=True)
    assert "2 × 1" in proc.stderr and "(zero3, fp32)" in proc.stderr
    expected_offload = "on" if offload != "none" else "off"
    assert f"optimizer offload {expected_offload}, parameter offload {expected_offload}" in proc.stderr
    assert "zero3: each LlamaDecoderLayer fetched whole" in proc.stderr  # the losses below are of blocks fetched whole
    worst = _worst(losses(out), losses(reference))
    assert worst <= 1e-4, f"zero3 ({offload}) losses drift from 1 rank by {worst:.2e} (relative)"

    # Each rank holds half of every parameter: its partition is half the single rank's bytes (± padding).
    single = json.loads((reference / "memory.json").read_text())["ranks"][0]["phases"]
    mem = json.loads((out / "memory.json").read_text())["ranks"]
    assert len(mem) == 2
    whole = next(r for r in single if r["phase"] == "sharded weights")["param_bytes"]
    for rank in mem:
        part = next(r for r in rank["phases"] if r["phase"] == "sharded weights")["param_bytes"]
        assert 0.4 * whole <= part <= 0.6 * whole * (2 if offload != "none" else 1)
        first = next(r for r in rank["phases"] if r["phase"] == "first step done")
        assert first["grad_bytes"] > 0 and first["optimizer_bytes"] > 0

    # The export holds the full weights, and plain transformers loads them.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert sum(p.numel() for p in model.parameters()) == json.loads((out / "summary.json").read_text())["parameters"]
    assert_no_survivors(out)


def test_users_deepspeed_file_runs_unchanged_and_resumes(reference, tmp_path, cache_dir):
    """The recipe's file as it is (bf16, offload, micro-batch 1, "auto" clipping), stopped at step 5
    and resumed from the DeepSpeed checkpoint, trains like one uninterrupted rank."""
    first = tmp_path / "run"
    flags = {"parallel.strategy": "zero3", "parallel.deepspeed_config": USER_FILE}
    proc = run_cli("train", *tiny_overrides(first, cache_dir, **COMMON, **flags, **{"train.stop_at_step": 5}),
                   "--nproc-per-node", "2", check=True)
    # contradictions with cputrain's config are reported before the first step
    notes = proc.stderr[: proc.stderr.index("step 1/")]
    assert "train_micro_batch_size_per_gpu is 1 in the file; using 2" in notes
    assert "bf16.enabled is true in the file; training in fp32" in notes
    assert (first / "checkpoints" / "step-000005" / "state" / "zero3").is_dir()
    assert not (first / "checkpoints" / "step-000010").exists()

    again = run_cli("train", *tiny_overrides(first, cache_dir, **COMMON, **flags), "--nproc-per-node", "2", check=True)
    assert "resumed from" in again.stderr
    worst = _worst(losses(first), losses(reference))
    assert worst <= 1e-4, f"resumed zero3 losses drift from 1 rank by {worst:.2e} (relative)"
    assert_no_survivors(first)


def test_plain_python_one_rank(tmp_path, cache_dir, reference):
    """`python -m cputrain` with no launcher: DeepSpeed alone would die on KeyError: 'LOCAL_RANK'."""
    out = tmp_path / "one"
    run_cli("train", *tiny_overrides(out, cache_dir, **COMMON, **{"parallel.strategy": "zero3"}), check=True)
    worst = _worst(losses(out), losses(reference))
    assert worst <= 1e-4
    shutil.rmtree(out / "checkpoints")
