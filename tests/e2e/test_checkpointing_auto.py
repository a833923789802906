"""model.activation_checkpointing=auto through `cputrain train`: the worker decides it from the
plan and this machine's memory, and the run folder says what it decided and why."""

from __future__ import annotations

import json

import yaml

from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides


def test_auto_is_decided_by_the_plan_and_recorded(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_cli("train", *tiny_overrides(run, cache_dir, **{"train.max_steps": 2, "model.activation_checkpointing": "auto"}),
            check=True)
    text = (run / "config.yaml").read_text()
    # a tiny model fits any machine: nothing is recomputed, and the reason names the budget
    assert yaml.safe_load(text)["model"]["activation_checkpointing"] is False
    assert "# model.activation_checkpointing = False: the plan without it" in text and "GiB per rank" in text
    assert json.loads((run / "plan.json").read_text())["activation_checkpointing"] is False

    # a number of blocks reaches the run's own plan as it is
    run_cli("train", *tiny_overrides(tmp_path / "one", cache_dir, **{"train.max_steps": 2,
                                                                      "model.activation_checkpointing": 1}), check=True)
    assert json.loads((tmp_path / "one" / "plan.json").read_text())["activation_checkpointing"] == 1
