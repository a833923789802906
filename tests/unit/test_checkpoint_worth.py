"""A checkpoint's worth, said before the run: the interval between saves at the planned step, the
work a lost node costs at that rate, in `cputrain plan` and among a run's first lines."""

from __future__ import annotations

import json
import re

import pytest

from cputrain.plan.time import CheckpointWorth, duration, worth_here
from harness.run_cli_here import run_cli_here


def test_the_interval_is_the_sooner_of_steps_and_seconds():
    by_steps = CheckpointWorth(step_s=600.0, every_steps=50, every_s=None, save_s=60.0, nnodes=4,
                               node_price_per_hour=2.0)
    assert by_steps.interval_s == 30_000.0
    assert by_steps.lost_node_hours == pytest.approx(30_000 * 4 / 3600)
    assert by_steps.lost_usd == pytest.approx(30_000 * 4 / 3600 * 2.0)
    assert by_steps.save_share == pytest.approx(60 / 30_060)
    bounded = CheckpointWorth(step_s=600.0, every_steps=50, every_s=3600.0, save_s=60.0, nnodes=4)
    assert bounded.interval_s == 3600.0 and bounded.lost_node_hours == pytest.approx(4.0)
    assert bounded.lost_usd is None
    assert "whichever comes first" in bounded.line() and "1.0 h" in bounded.line()
    assert "bounds the interval" in by_steps.line()  # the key to set, said where it is not set


def test_durations_read_in_their_unit():
    assert [duration(s) for s in (0.004, 12.0, 90.0, 7200.0)] == ["4 ms", "12.0 s", "1.5 min", "2.0 h"]


def test_cputrain_plan_says_what_a_lost_node_costs():
    """The 8B FSDP case on 4 nodes: the interval is train.checkpoint_every steps at the plan's own
    step, the lost work that interval on each of the 4 nodes."""
    result = run_cli_here("plan", "configs/llama3-8b-fsdp.yaml", "--nnodes", "4", "--nproc-per-node", "2", "--json",
                          check=True)
    doc = json.loads(result.stdout)
    from cputrain.config.file import load_config

    every = load_config("configs/llama3-8b-fsdp.yaml", []).train.checkpoint_every
    step_s, worth = doc["time"]["step_s"], doc["time"]["checkpoints"]
    assert worth["interval_s"] == pytest.approx(every * step_s)
    assert worth["lost_node_hours"] == pytest.approx(worth["interval_s"] * 4 / 3600)
    bounded = run_cli_here("plan", "configs/llama3-8b-fsdp.yaml", "train.checkpoint_every_s=3600", "--nnodes", "4",
                           "--nproc-per-node", "2", check=True)
    line = next(x for x in bounded.stdout.splitlines() if x.strip().startswith("checkpoints"))
    assert re.search(r"a save every 1\.0 h .*4\.0 node-hours", line), line


def test_a_run_plans_its_interval_on_its_own_node():
    from cputrain.config.file import load_config
    from cputrain.hardware import detect
    from cputrain.plan.memory.build import make_plan
    from cputrain.training.choices import decide_for_plan

    cfg = load_config(None, ["model.arch.hidden_size=256", "model.arch.num_hidden_layers=4",
                             "train.checkpoint_every=10", "hardware.threads=1", "hardware.precision=fp32"])
    cfg = decide_for_plan(cfg, 1, vocab_size=4096).config
    plan = make_plan(cfg, 1, nproc_per_node=1, vocab_size=4096)
    worth = worth_here(plan, cfg, detect(), world_size=1, ranks_per_node=1)
    assert worth.nnodes == 1 and worth.step_s > 0
    assert worth.interval_s == pytest.approx(10 * worth.step_s)
