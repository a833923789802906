"""Each FSDP layout through the real command: its losses and logged gradient norms (clipping on)
equal one rank's, on 2 ranks of one node and on 2 nodes of 2 ranks (two agents on this
machine's loopback, each one node), and a hybrid checkpoint resumes on one rank.

The gradient itself is compared layout by layout, in and out of bf16, in
test_fsdp_collectives.py; here the wiring is: the config's layout reaching FSDP2, the step's
micro-batches toggling it, the logged norm (which a gradient W× off would change W-fold; the
clipped update then changes every later loss).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides
from harness.warm_client import warm
from dist_helpers import assert_no_survivors, free_port

pytestmark = pytest.mark.slow

STEPS = 10  # the layouts' losses against one rank's over 10 steps
SAVED_AT = 5  # the hybrid checkpoint one rank resumes
SETTINGS = {"train.max_steps": STEPS, "train.global_batch_size": 16, "train.micro_batch_size": 2,
            "train.grad_clip": 0.5, "train.checkpoint_every": SAVED_AT, "train.keep_last": 2, "train.eval_every": 100}


def rows(run_dir) -> dict[int, dict]:
    found = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in found if "loss" in r}


def assert_same_steps(run_dir, reference_dir, steps=range(1, STEPS + 1)) -> None:
    got, want = rows(run_dir), rows(reference_dir)
    for step in steps:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), (step, got[step], want[step])
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), (step, got[step])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("layouts") / "one-rank"
    run_cli("train", *tiny_overrides(out, cache_dir, **SETTINGS), check=True)
    return out


def test_gather_once_on_two_ranks_equals_one_rank(one_rank, tmp_path, cache_dir):
    out = tmp_path / "run"
    run_cli("train", *tiny_overrides(out, cache_dir, **SETTINGS, **{"parallel.strategy": "fsdp",
                                                                     "parallel.layout": "gather_once"}),
            "--nproc-per-node", "2", check=True)
    assert_same_steps(out, one_rank)
    # a step sends each block once and its gradients once, not once per micro-batch: 4 micro-batches
    # of full_shard would send about 4× as much (test_fsdp_collectives.py counts the rest)
    assert rows(out)[2]["comm_sent_bytes"] > 0


def two_nodes(out, cache_dir, layout: str) -> list[str]:
    """Two agents on loopback, each a node of 2 ranks; the stderr of each."""
    endpoint = f"127.0.0.1:{free_port()}"
    # Two agents at once: each a fresh interpreter (the warm server forks one command at a time),
    # their 4 ranks forked by the warm rank server, as run_cli's agents' are.
    env = cli_env(**warm().ranks.exec_env())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cputrain", "train",
         *tiny_overrides(out, cache_dir, **SETTINGS, **{"parallel.strategy": "fsdp", "parallel.layout": layout,
                                                         "launch.rdzv_timeout_s": 60}),
         "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-endpoint", endpoint],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    assert_no_survivors(str(out))
    return errs


@pytest.mark.parametrize("layout", ["node_reshard", "hybrid"])
def test_node_layouts_on_two_nodes_equal_one_rank(one_rank, tmp_path, cache_dir, layout):
    out = tmp_path / "run"
    two_nodes(out, cache_dir, layout)
    assert_same_steps(out, one_rank)
    if layout == "hybrid":  # its checkpoint of step SAVED_AT, resumed by one rank, goes on as one rank did
        resumed = tmp_path / "resumed"
        shutil.copytree(out, resumed, ignore=shutil.ignore_patterns(f"step-{STEPS:06d}"))
        overrides = tiny_overrides(resumed, cache_dir, **SETTINGS)
        result = run_cli("train", *overrides, check=True)
        assert "resumed from" in result.stderr and f"step {SAVED_AT}" in result.stderr
        assert_same_steps(resumed, one_rank, steps=range(SAVED_AT + 1, STEPS + 1))
