"""Supervised fine-tuning on real ranks (gloo on loopback): chat data with LoRA under FSDP2 on 2
ranks, stopped and resumed on 1 rank, follows a 1-rank run; ZeRO-3's first step on chat data is
1 rank's (DeepSpeed's engine takes the loss's divisor as the other strategies do)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from harness.run_cli import run_cli
from harness.tiny_run import sft_overrides, tiny_overrides
from dist_helpers import assert_no_survivors, losses

pytestmark = pytest.mark.slow

STEPS = 8


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model(tie=False)


def _lora(out, cache_dir, chat_file, base, **extra):
    return tiny_overrides(out, cache_dir, **{**sft_overrides(chat_file), "model.name_or_path": base,
                                             "model.lora.enabled": "true", "model.lora.rank": 4, "train.lr": 1e-2,
                                             "train.max_steps": STEPS, "train.eval_every": 100,
                                             "train.micro_batch_size": 2, **extra})


def test_sft_lora_fsdp_on_two_ranks_resumes_on_one(tmp_path, cache_dir, chat_file, base):
    reference = tmp_path / "one"
    run_cli("train", *_lora(reference, cache_dir, chat_file, base), check=True)
    # Every "auto" the run decided is in config.yaml with its value and reason, these four included.
    recorded = (reference / "config.yaml").read_text()
    for decided in ("data.format = chat: the first record has 'messages'", "data.train_on = assistant: chat",
                    "model.lora.target_modules = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
                    "'down_proj']: every attention and MLP projection", "model.lora.base_dtype = "):
        assert f"# {decided}" in recorded, recorded[:3000]
    resolved = yaml.safe_load(recorded)
    assert resolved["data"]["format"] == "chat" and resolved["model"]["lora"]["base_dtype"] in ("bf16", "fp32")
    first = tmp_path / "two"
    run_cli("train", *_lora(first, cache_dir, chat_file, base, **{"parallel.strategy": "fsdp",
                                                                   "train.stop_at_step": 4}),
            "--nproc-per-node", "2", check=True)
    assert_no_survivors(first)
    ref, two = losses(reference), losses(first)
    assert max(_rel(two[s], ref[s]) for s in range(1, 5)) <= 1e-4
    out = tmp_path / "resumed-1"
    shutil.copytree(first, out)
    proc = run_cli("train", *_lora(out, cache_dir, chat_file, base, **{"parallel.strategy": "single"}), check=True)
    assert "resumed from" in proc.stderr
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)) and got[STEPS] < got[1]
    worst = max(_rel(got[s], ref[s]) for s in range(5, STEPS + 1))
    assert worst <= 1e-4, f"SFT LoRA resumed on 1 rank drifts by {worst:.2e}"
    assert (out / "model" / "adapter_model.safetensors").is_file()


def test_zero3_first_step_on_chat_data_is_one_ranks(tmp_path, cache_dir, chat_file):
    pytest.importorskip("deepspeed")
    common = {**sft_overrides(chat_file), "train.max_steps": 1, "train.eval_every": 100, "data.packing": "false",
              "train.micro_batch_size": 2}
    one, z3 = tmp_path / "one", tmp_path / "zero3"
    run_cli("train", *tiny_overrides(one, cache_dir, **common), check=True)
    run_cli("train", *tiny_overrides(z3, cache_dir, **common, **{"parallel.strategy": "zero3"}),
            "--nproc-per-node", "2", check=True)
    assert _rel(losses(z3)[1], losses(one)[1]) <= 1e-5
