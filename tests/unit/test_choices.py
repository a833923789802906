"""Every "auto" of a run is decided in one place, in one order, each with its reason, and a run's
config then admits no "auto" by type (cputrain.training.choices, config.resolved.DecidedConfig)."""

from __future__ import annotations

import pytest

from cputrain.training import choices
from cputrain.config import Config
from cputrain.config.resolved import DecidedConfig, PlannedConfig
from cputrain.distributed.env import RankEnv
from cputrain.hardware import detect
from cputrain.config.resolve import resolve
from cputrain.run_folder.layout import RunFolder
from cputrain.run_folder.run_config import read_recorded

ONE_RANK = RankEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="python")


def _decide(**sections):
    # attention fixed: timing kernels is not what this checks
    cfg = Config.model_validate({**sections, "model": {"attn_implementation": "sdpa", **sections.get("model", {})}})
    hw = detect()
    return choices.decide(resolve(cfg, hw, 1, 1), hw, ONE_RANK, read_recorded(RunFolder(cfg.output_dir)))


def test_a_lora_chat_run_decides_every_auto_with_a_reason(tiny_model, tmp_path):
    res = _decide(model={"name_or_path": str(tiny_model()), "lora": {"enabled": True}},
                  data={"source": "builtin:pydoc-sft", "format": "auto", "cache_dir": str(tmp_path)},
                  output_dir=str(tmp_path / "run"))
    cfg, why = res.config, {key: reason for key, _, reason in res.reasons}
    assert isinstance(cfg, DecidedConfig)
    assert (cfg.data.format, cfg.data.train_on) == ("chat", "assistant")
    assert cfg.model.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]
    assert cfg.model.lora.base_dtype in ("bf16", "fp32")
    for key in ("data.format", "data.train_on", "model.lora.target_modules", "model.lora.base_dtype",
                "model.chunked_loss", "hardware.allocator"):
        assert why.get(key), f"{key} was decided without a reason: {res.reasons}"
    order = [key for key, _, _ in res.reasons]
    assert order.index("data.format") < order.index("data.train_on") < order.index("model.lora.target_modules")


def test_text_trains_every_token_and_a_set_value_is_kept_without_a_reason(tmp_path):
    res = _decide(data={"cache_dir": str(tmp_path), "train_on": "all"}, model={"chunked_loss": False},
                  output_dir=str(tmp_path / "run"))
    assert res.config.data.train_on == "all" and res.config.model.chunked_loss is False
    assert not {"data.train_on", "model.chunked_loss", "data.format"} & {key for key, _, _ in res.reasons}


def test_a_config_with_an_auto_left_is_not_a_decided_one():
    with pytest.raises(ValueError, match="attn_implementation"):
        DecidedConfig.model_validate(Config().model_dump())


# --- `cputrain plan` and `cputrain k8s` decide by the same list, with a plan's facts -------------

def _key(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("files", ["fp32", "bf16"])
def test_a_plan_decides_the_lora_keys_as_a_run_does(tiny_model, tmp_path, files):
    """On the same model folder the planning decision and a run's give the same targets, base dtype
    and head, with the same reasons: one walk, one rule per key. Under fp32 compute the base dtype
    follows the files (read from their headers in both)."""
    import torch

    folder = tiny_model(dtype=torch.bfloat16) if files == "bf16" else tiny_model()
    sections = {"model": {"name_or_path": str(folder), "lora": {"enabled": True}}, "hardware": {"precision": "fp32"},
                "data": {"cache_dir": str(tmp_path)}, "output_dir": str(tmp_path / "run")}
    run = _decide(**sections)
    plan = choices.decide_for_plan(Config.model_validate(sections), 1)
    assert isinstance(plan.config, PlannedConfig)
    run_why, plan_why = ({key: why for key, _, why in res.reasons} for res in (run, plan))
    for key in ("model.lora.target_modules", "model.lora.base_dtype", "model.chunked_loss"):
        assert _key(plan.config, key) == _key(run.config, key), key
        assert plan_why[key] == run_why[key] and plan_why[key], key
    assert plan.config.model.lora.base_dtype == files


def test_cputrain_plan_reads_what_the_choices_decided(tiny_model, tmp_path):
    """`cputrain plan` on a LoRA config with every key left auto: each key the plan reads is decided
    by choices.decide_for_plan and printed with its reason; the plan is made of those values.
    The data is not read (its file is not on this machine): its keys are the run's to decide."""
    import json

    from harness.run_cli_here import run_cli_here

    from cputrain.config.file import load_config

    overrides = [f"model.name_or_path={tiny_model()}", "model.lora.enabled=true", "model.activation_checkpointing=auto",
                 "data.format=auto", f"data.source={tmp_path / 'not-here.jsonl'}", "data.seq_len=64",
                 "train.micro_batch_size=2", "train.global_batch_size=2"]
    doc = json.loads(run_cli_here("plan", *overrides, "--json", check=True).stdout)
    decided = choices.decide_for_plan(load_config(None, overrides), 1)
    assert [key for key, _, _ in decided.reasons] == [
        "hardware.precision", "parallel.strategy", "model.lora.target_modules", "model.lora.base_dtype",
        "model.attn_implementation", "model.chunked_loss", "model.activation_checkpointing"]  # the list's order
    for key, value, why in decided.reasons:
        assert f"{key}=auto → {value}: {why}" in doc["notes"]
    cfg = decided.config
    assert doc["lora"]["target_modules"] == sorted(cfg.model.lora.target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert (doc["precision"], doc["strategy"]) == (cfg.hardware.precision, cfg.parallel.strategy) == ("bf16", "single")
    assert doc["lora"]["frozen_bytes_per_parameter"] == 2 and cfg.model.lora.base_dtype == "bf16"  # bf16 compute
    assert doc["activation_checkpointing"] is cfg.model.activation_checkpointing is True
    assert doc["chunked_loss"] is cfg.model.chunked_loss is True
    assert (cfg.data.format, cfg.data.train_on, cfg.hardware.allocator) == ("auto", "auto", "auto")


def test_a_known_hub_id_is_planned_from_its_bf16_files_without_the_hub():
    """Meta-Llama-3-8B, not on this machine: planned in fp32 compute with its base stored as its
    published files are (bf16), the one files-are-bf16 answer the plan has."""
    from cputrain.config.file import load_config

    cfg = load_config("configs/llama3-8b-fsdp.yaml", ["parallel.strategy=single", "hardware.precision=fp32",
                                                      "model.lora.enabled=true"])
    decided = choices.decide_for_plan(cfg, 1)
    assert decided.config.model.lora.base_dtype == "bf16"
    assert "the files hold bf16" in {key: why for key, _, why in decided.reasons}["model.lora.base_dtype"]


def test_a_resumed_lora_rank_builds_one_skeleton_plans_once_and_reads_config_yaml_once(tiny_model, tmp_path,
                                                                                         monkeypatch):
    """A LoRA run with model.lora.target_modules=auto and model.activation_checkpointing=auto,
    resumed in one process as `cputrain train` runs it: the checks before any work, LoRA's targets,
    the plan of activation checkpointing and the trainer take one meta skeleton between them (one
    build); the memory plan is made once for each thing it decides or records (activation
    checkpointing's choice: none fits this node, from the config; plan.json: from the trainer's
    skeleton); and the run folder's config.yaml is read once (the choices and the folder's check)."""
    import gc

    from harness.run_cli_here import _process_state

    from cputrain.config.file import load_config
    from cputrain.model import skeleton
    from cputrain.plan.memory import build as plan_build
    from cputrain.run_folder.layout import RunFolder
    from cputrain.training.preflight import check_before_work
    from cputrain.training.worker import run_worker

    def config(max_steps: int):
        return load_config(None, [
            f"model.name_or_path={tiny_model()}", "model.lora.enabled=true", "model.activation_checkpointing=auto",
            f"output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", "data.max_documents=200",
            "data.seq_len=32", f"train.max_steps={max_steps}", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.checkpoint_every=1", "train.eval_every=1", "train.eval_batches=1",
            "train.sample_tokens=0", "hardware.precision=fp32", "hardware.threads=1",
            "model.attn_implementation=sdpa", "hardware.allocator=system"])

    with _process_state(None, None):
        run_worker(config(1))
    builds, reads, plans = [], [], []
    build, read_text, plan = skeleton._from_config, RunFolder.read_text, plan_build._plan
    monkeypatch.setattr(skeleton, "_built", None)  # this process built it for the first session
    monkeypatch.setattr(skeleton, "_from_config", lambda *args: builds.append(args) or build(*args))
    monkeypatch.setattr(RunFolder, "read_text",
                        lambda self, *parts: reads.append(parts) or read_text(self, *parts))
    # every memory plan, make_plan's and plan_of_built's, is made by build._plan
    monkeypatch.setattr(plan_build, "_plan", lambda cfg, *args: plans.append(
        cfg.model.activation_checkpointing) or plan(cfg, *args))
    try:
        with _process_state(None, None):
            cfg = config(2)
            check_before_work(cfg)
            summary = run_worker(cfg)
    finally:
        gc.unfreeze()  # the worker froze what this process had made
    assert summary["status"] == "finished" and summary["final_step"] == 2
    assert len(builds) == 1, f"{len(builds)} skeleton builds in one rank"
    assert plans == [False, False], f"memory plans made in one rank, by activation checkpointing: {plans}"
    assert reads.count(("config.yaml",)) == 1, reads
