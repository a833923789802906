"""The DeepSpeed config for zero3: the user's file is accepted, its "auto" values are filled
from cputrain's config, contradictions are reported, and bad files fail in one line."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from cputrain.config.file import load_config
from cputrain.errors import ConfigError, UserError
from cputrain.parallel import deepspeed_config as dsc
from cputrain.parallel.base import Strategy, StrategyContext, ignored_settings

USER_FILE = Path(__file__).resolve().parents[2] / "configs" / "deepspeed" / "zero3-offload.json"


def _cfg(*overrides):
    return load_config(None, ["hardware.precision=fp32", "parallel.strategy=zero3", *overrides])


def test_the_users_file_is_accepted_and_auto_is_filled():
    cfg = _cfg(f"parallel.deepspeed_config={USER_FILE}", "train.global_batch_size=16", "train.micro_batch_size=2",
               "train.grad_clip=0.5")
    plan = dsc.plan_for(cfg, world_size=2, grad_accum_steps=4, hidden_size=64)
    ds = plan.config
    assert ds["gradient_clipping"] == 0.5  # "auto" in the file
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 16 == 2 * 4 * 2
    assert plan.offload_optimizer and plan.offload_param  # the file's offload stays
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 5e8  # DeepSpeed's own keys untouched
    assert ds["bf16"]["enabled"] is False and ds["steps_per_print"] == 10
    text = "\n".join(plan.notes)
    # contradictions are reported: micro-batch 1 and accumulation 4 in the file; bf16 on a CPU without AMX
    assert "train_micro_batch_size_per_gpu is 1 in the file; using 2" in text
    assert "bf16.enabled is true" in text and "0.3 vs 116" in text
    assert "gradient_accumulation_steps" not in text  # the file's 4 agrees with cputrain
    assert not list(dsc._auto_keys(ds))


def test_generated_config_follows_cputrains_config():
    cfg = _cfg("parallel.offload_optimizer=true", "hardware.precision=bf16")
    plan = dsc.plan_for(cfg, world_size=1, grad_accum_steps=2, hidden_size=128)
    assert plan.notes == []
    assert plan.offload_optimizer and not plan.offload_param
    assert plan.config["bf16"]["enabled"] is True and plan.config["zero_optimization"]["stage"] == 3
    assert plan.config["zero_optimization"]["reduce_bucket_size"] == 128 * 128
    assert plan.config["gradient_clipping"] == 1.0
    assert not plan.fetch_granularity_set  # so the zero3 strategy fetches each decoder block whole


@pytest.mark.parametrize("zero, kept", [({"leaf_module": {"classes": ["my.Block"]}}, True),
                                        ({"stage3_module_granularity_threshold": 5000}, True),
                                        ({"stage3_module_granularity_threshold": 0}, False)])
def test_a_file_that_says_what_deepspeed_fetches_whole_keeps_it(tmp_path, zero, kept):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, **zero}}))
    plan = dsc.plan_for(_cfg(f"parallel.deepspeed_config={path}"), world_size=2, grad_accum_steps=1, hidden_size=64)
    assert plan.fetch_granularity_set is kept


def test_optimizer_scheduler_and_lower_stage_in_the_file_are_reported(tmp_path):
    doc = json.loads(USER_FILE.read_text())
    doc["zero_optimization"]["stage"] = 2
    doc["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    plan = dsc.plan_for(_cfg(f"parallel.deepspeed_config={path}"), 1, 2, 64)
    assert "optimizer" not in plan.config and plan.config["zero_optimization"]["stage"] == 3
    assert any("stage is 2" in n for n in plan.notes) and any("'optimizer' section" in n for n in plan.notes)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"zero_optimization": {"stage": 3,}}', "is not valid JSON: .* at line 1, column"),
        ('{"zero_optimization": {"stage": 4}}', "stage is 4; DeepSpeed has stages 0, 1, 2 and 3"),
        ('{"zero_optimization": {"stage": "three"}}', "stage is 'three'"),
        ('[1, 2]', "must hold a JSON object"),
    ],
)
def test_bad_files_fail_in_one_line(tmp_path, text, expected):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected) as err:
        dsc.plan_for(_cfg(f"parallel.deepspeed_config={path}"), 1, 1)
    assert "\n" not in str(err.value)


def test_missing_file_and_unfillable_auto(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        dsc.plan_for(_cfg(f"parallel.deepspeed_config={tmp_path / 'none.json'}"), 1, 1)
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}')
    with pytest.raises(ConfigError, match="cannot fill \"auto\" for zero_optimization.sub_group_size"):
        dsc.plan_for(_cfg(f"parallel.deepspeed_config={path}"), 1, 1)


def test_deepspeed_missing_or_too_old(monkeypatch):
    with pytest.raises(UserError, match=r"too old .* needs deepspeed>=0\.16\.0"):
        dsc.check_version("0.14.4")
    assert dsc.check_version("0.19.8") == "0.19.8"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dsc.importlib.metadata, "version", not_installed)
    with pytest.raises(UserError, match=r"not installed: pip install 'cputrain\[deepspeed\]'") as err:
        dsc.require_deepspeed()
    assert "\n" not in str(err.value)


def test_this_module_does_not_import_deepspeed():
    import subprocess
    import sys

    code = "import sys, cputrain.parallel.deepspeed_config; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_only_the_zero3_strategy_imports_deepspeed():
    """The score head, the chunked head and the rest ask the strategy; DeepSpeed is the zero3 strategy's alone."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "cputrain"
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "deepspeed" or n.startswith("deepspeed.") for n in names):
                importers.add(str(path.relative_to(package)))
    assert importers == {"parallel/zero3.py"}, importers


def test_offload_on_a_strategy_without_it_is_reported_as_ignored():
    import torch

    cfg = _cfg("parallel.offload_optimizer=true", f"parallel.deepspeed_config={USER_FILE}")
    ddp = Strategy(StrategyContext(cfg, rank=1, world_size=2, compute_dtype=torch.float32))  # rank 1: silent
    ddp.name = "ddp"
    lines = ignored_settings(ddp, cfg)
    assert any("parallel.offload_optimizer=true is ignored: strategy ddp has no offload" in line for line in lines)
    assert any("parallel.deepspeed_config is ignored" in line for line in lines)
    assert not any("offload_param" in line for line in lines)
