"""Every "auto" of a run is decided in one place, in one order, each with its reason, and a run's
config then admits no "auto" by type (cputrain.run_choices, config.resolved.DecidedConfig)."""

from __future__ import annotations

import pytest

from cputrain import run_choices
from cputrain.config import Config
from cputrain.config.resolved import DecidedConfig
from cputrain.distributed.env import RankEnv
from cputrain.hardware import detect
from cputrain.resolve import resolve

ONE_RANK = RankEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="python")


def _decide(**sections):
    # attention fixed: timing kernels is not what this checks
    cfg = Config.model_validate({**sections, "model": {"attn_implementation": "sdpa", **sections.get("model", {})}})
    hw = detect()
    return run_choices.decide(resolve(cfg, hw, 1, 1), hw, ONE_RANK)


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
