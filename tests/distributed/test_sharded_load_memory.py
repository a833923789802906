"""FSDP sharded loading: each rank's peak RSS while loading a pretrained model stays at or below
model_bytes ÷ world_size × 1.3 + the fixed overhead of a rank that holds no weights yet.

The model (~170 MB in fp32) is big enough that loading it whole in a rank would break the
bound by far. The fixed overhead is measured in the same run: the RSS each rank holds just
before any weight exists (the `model skeleton` row of memory.json: python, torch, transformers,
the process group, the tokenizer and the packed data). An import-only python is measured too
and shown where the bound breaks, since the rank's own data and code come on top of it whatever the strategy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from harness.cli_env import cli_env
from harness.run_cli import run_cli
from harness.tiny_model import make_tiny_model
from harness.tiny_run import tiny_overrides
from dist_helpers import assert_no_survivors

# every rank starts as a user's does, a fresh interpreter: the tests measure its memory
pytestmark = [pytest.mark.slow, pytest.mark.fresh_interpreter]

GIB = 2**30
WORLD = 2

EMPTY_PROCESS = ("import torch, torch.distributed, transformers; from transformers import LlamaForCausalLM; "
                 "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")


def _empty_process_gib() -> float:
    """The peak RSS of an interpreter that has only imported torch and the Llama code: shown beside
    a broken bound (measured then, in a fresh interpreter of its own: ~5 s a passing run need not pay)."""
    return int(subprocess.run([sys.executable, "-c", EMPTY_PROCESS], env=cli_env(), capture_output=True,
                              text=True, check=True).stdout) * 1024 / GIB


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def folder_170mb(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-170mb"), hidden=768, layers=8)


def test_fsdp_sharded_load_peak_rss(tmp_path_factory, cache_dir, folder_170mb):
    folder = folder_170mb
    original = _tensors(folder / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in original.values())
    assert model_bytes > 150e6, model_bytes  # the shard must stand out from the process's own noise

    out = tmp_path_factory.mktemp("run")
    # One step at a vanishing learning rate: the weights come back unchanged, so the export
    # (gathered from the shards) also checks that every rank read the right rows.
    overrides = tiny_overrides(out, cache_dir, **{
        "model.name_or_path": folder, "parallel.strategy": "fsdp", "train.max_steps": 1, "train.lr": 1e-30,
        "train.global_batch_size": 2, "train.micro_batch_size": 1, "train.eval_every": 100,
        "data.max_documents": 100})
    overrides = [o for o in overrides if not o.startswith(("model.arch.", "model.tokenizer_vocab_size"))]
    run_cli("train", *overrides, "--nproc-per-node", WORLD, check=True, timeout=300)
    assert_no_survivors(out)

    memory = json.loads((out / "memory.json").read_text())
    assert len(memory["ranks"]) == WORLD
    for rank in memory["ranks"]:
        phases = {row["phase"]: row for row in rank["phases"]}
        overhead_gib = phases["model skeleton"]["rss_gib"]
        # high-water mark since the process started: an upper bound of the peak while loading
        peak_gib = phases["sharded weights"]["peak_rss_gib"]
        bound_gib = model_bytes / WORLD * 1.3 / GIB + overhead_gib
        assert peak_gib <= bound_gib, (
            f"rank {rank['rank']}: peak RSS while loading {peak_gib * 1024:.0f} MiB > bound {bound_gib * 1024:.0f} MiB "
            f"(model {model_bytes / 2**20:.0f} MiB ÷ {WORLD} × 1.3 + {overhead_gib * 1024:.0f} MiB held before the "
            f"weights; an empty rank (torch and the Llama code imported) holds {_empty_process_gib() * 1024:.0f} MiB)")
        # and the rank holds its shard, not the model
        assert phases["sharded weights"]["param_bytes"] <= model_bytes / WORLD * 1.05

    exported = _tensors(out / "model" / "model.safetensors")
    for key, tensor in original.items():
        # 1e-30 steps move only weights that are themselves ~0; a wrong row would differ by ~1e-2
        assert torch.allclose(exported[key], tensor, rtol=0, atol=1e-20), f"{key} differs after sharded loading"


@pytest.mark.parametrize("strategy, world", [("single", 1), ("ddp", 2)])
def test_whole_model_load_peak_is_the_weights_not_twice_them(tmp_path_factory, cache_dir, folder_170mb, strategy,
                                                            world):
    """single and ddp read each tensor with plain reads into its parameter: the peak while loading
    is the weights once (not the weights plus the mapped file's pages), and ddp sends no copy of
    them at start-up (each rank reads the files; replica_check compares fingerprints)."""
    folder = folder_170mb
    model_bytes = sum(t.numel() * t.element_size() for t in _tensors(folder / "model.safetensors").values())
    out = tmp_path_factory.mktemp("run")
    overrides = tiny_overrides(out, cache_dir, **{
        "model.name_or_path": folder, "parallel.strategy": strategy, "train.max_steps": 1,
        "train.global_batch_size": 2, "train.micro_batch_size": 1, "train.eval_every": 100, "data.max_documents": 100})
    overrides = [o for o in overrides if not o.startswith(("model.arch.", "model.tokenizer_vocab_size"))]
    run_cli("train", *overrides, "--nproc-per-node", world, check=True, timeout=300)
    assert_no_survivors(out)
    for rank in json.loads((out / "memory.json").read_text())["ranks"]:
        phases = {row["phase"]: row for row in rank["phases"]}
        overhead_gib = phases["model skeleton"]["rss_gib"]
        peak_gib = phases["sharded weights"]["peak_rss_gib"]
        bound_gib = overhead_gib + model_bytes * 1.15 / GIB  # through the map it was ~2 × the weights
        assert peak_gib <= bound_gib, (
            f"{strategy} rank {rank['rank']}: peak RSS while loading {peak_gib * 1024:.0f} MiB > "
            f"{bound_gib * 1024:.0f} MiB ({overhead_gib * 1024:.0f} MiB before the weights + the "
            f"{model_bytes / 2**20:.0f} MiB model × 1.15)")
