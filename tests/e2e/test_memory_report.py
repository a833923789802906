"""memory.json for every strategy: each rank, each setup phase and the step peak, with RSS and
the bytes this rank really holds in parameters, gradients and optimizer state."""

from __future__ import annotations

import importlib.util
import json

import pytest

from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides
from cputrain.metrics.phases import PHASES

pytestmark = pytest.mark.slow

SHORT = {"train.max_steps": 2, "train.micro_batch_size": 2, "train.eval_every": 100, "train.checkpoint_every": 100}
CASES = [("single", 1), ("ddp", 2), ("fsdp", 2), ("zero3", 1)]


@pytest.mark.parametrize("strategy, ranks", CASES)
def test_memory_json_for_every_strategy(strategy, ranks, tmp_path, cache_dir):
    if strategy == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("strategy zero3 needs the deepspeed extra: scripts/install.sh dev,deepspeed")
    out = tmp_path / strategy
    args = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **SHORT, **{"parallel.strategy": strategy}), *args,
                   check=True)
    doc = json.loads((out / "memory.json").read_text())
    assert [r["rank"] for r in doc["ranks"]] == list(range(ranks))
    summary = json.loads((out / "summary.json").read_text())
    n_params = summary["parameters"]
    for rank in doc["ranks"]:
        rows = {row["phase"]: row for row in rank["phases"]}
        assert tuple(rows) == PHASES  # stable names, in build order
        assert all(row["rss_gib"] > 0 for row in rows.values())
        assert rows["model skeleton"]["param_bytes"] == 0  # the skeleton is on the meta device
        held = rows["sharded weights"]["param_bytes"]
        whole = 4 * n_params  # fp32
        if strategy in ("fsdp", "zero3") and ranks > 1:
            assert held < 0.75 * whole  # a shard, not the model
        else:
            assert held >= whole
        # Gradients exist only inside the step; they are measured there, not guessed.
        first = rows["first step done"]
        assert first["grad_bytes"] >= 0.4 * held
        # AdamW: two fp32 moments per parameter this rank steps
        assert first["optimizer_bytes"] >= 2 * 0.4 * held
        assert rows["training step peak"]["rss_gib"] >= max(r["rss_gib"] for r in rank["phases"][:-1]) - 1e-6
    # Cores and threads as each rank really ran: the configured thread count, on disjoint cores.
    import os

    cpu_sets = [set(r["cpus"]) for r in doc["ranks"]]
    assert all(r["threads"] == 1 for r in doc["ranks"]), [r["threads"] for r in doc["ranks"]]
    assert all(cpu_sets) and all(s <= os.sched_getaffinity(0) for s in cpu_sets)
    if ranks > 1 and len(os.sched_getaffinity(0)) >= ranks:
        assert not set.intersection(*cpu_sets), f"ranks share cores: {cpu_sets}"
    # rank 0 prints the table
    assert "first step done" in proc.stderr and "optim GiB" in proc.stderr
