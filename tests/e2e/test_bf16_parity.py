"""The speed-ups of the bf16 step change speed, not what is learned.

In fp32 the chunked head + loss and either attention kernel give the plain path's losses to
1e-4. In bf16, with everything on (chunked loss, fused AdamW, timed attention choice; compiled
blocks under fsdp), every strategy follows the fp32 loss curve within BF16_REL, the tolerance of bf16
rounding over a few steps. Tiny shapes: where bf16 is emulated this is still quick.
"""

from __future__ import annotations

import json

import pytest

from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides
from dist_helpers import losses

pytestmark = pytest.mark.slow

SHORT = {"train.max_steps": 6, "train.eval_every": 100, "train.checkpoint_every": 100, "train.micro_batch_size": 2}
BF16_REL = 2e-2  # bf16 keeps 8 bits of mantissa; six steps of a tiny model stay within 2% of fp32
FP32_REL = 1e-4


def _worst(got: dict[int, float], ref: dict[int, float]) -> float:
    assert sorted(got) == sorted(ref) == list(range(1, SHORT["train.max_steps"] + 1))
    return max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)


@pytest.fixture(scope="module")
def plain_fp32(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("plain-fp32")
    run_cli("train", *tiny_overrides(out, cache_dir, **SHORT, **{"model.chunked_loss": "false",
                                                                 "model.attn_implementation": "sdpa"}), check=True)
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager", "auto"])
def test_fp32_speedups_are_exact(plain_fp32, tmp_path, cache_dir, attn):
    out = tmp_path / attn
    # chunked_loss=auto takes the plain head in fp32 at this vocabulary: ask for the chunked one
    run_cli("train", *tiny_overrides(out, cache_dir, **SHORT, **{"model.attn_implementation": attn,
                                                                 "model.chunked_loss": "true"}), check=True)
    worst = _worst(losses(out), losses(plain_fp32))
    assert worst <= FP32_REL, f"fp32 with the chunked loss and {attn} attention drifts by {worst:.2e}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["chunked_loss"] is True and summary["attn_implementation"] in ("sdpa", "eager")


@pytest.mark.parametrize("strategy,ranks", [("single", 1), ("ddp", 2), ("fsdp", 2), ("zero3", 2)])
def test_bf16_follows_fp32(plain_fp32, tmp_path, cache_dir, strategy, ranks):
    out = tmp_path / strategy
    settings = {**SHORT, "hardware.precision": "bf16", "parallel.strategy": strategy, "model.attn_implementation": "auto",
                # bf16 with compiled blocks on fsdp: the suite's only compile under fsdp. One rank's compile
                # is checked against eager to 1e-4 in tests/e2e/test_compile.py (a second inductor compile of
                # the same blocks here cost ~50 s)
                "model.compile": "true" if strategy == "fsdp" else "false",
                "model.compile_cache_dir": cache_dir / "inductor-bf16"}
    launch = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **settings), *launch, check=True)
    worst = _worst(losses(out), losses(plain_fp32))
    assert worst <= BF16_REL, f"bf16 {strategy} drifts from fp32 by {worst:.2e} (relative)"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["chunked_loss"] is True
    # both peaks are named, and MFU against the measured matmul peak is the larger share
    assert summary["measured_peak_flops"] > 0 and "torch.mm" in summary["measured_peak_flops_how"]
    assert "FLOP/cycle" in summary["peak_flops_how"]
    assert "model.attn_implementation = " in proc.stderr
