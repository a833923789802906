"""The plans count online RL's rollout: the memory plan its KV cache (cputrain.rollouts'
kv_cache_bytes) and last-position logits, the time plan its forwards; an lm run's plans are as
they were."""

from __future__ import annotations

import pytest

from cputrain.config.file import load_config
from cputrain.plan.time.step_time import ROLLOUT_RATE_SHARE, StepSettings
from cputrain.rollouts.fused_weight_size import fused_weight_bytes
from cputrain.rollouts.kv_cache_size import kv_cache_bytes
from cputrain.training.choices import decide_and_plan

RL = ["train.objective=grpo", "train.rewards=[exact_answer]", "data.format=prompt", "data.source=prompts.jsonl",
      "train.num_generations=8", "train.global_batch_size=32", "train.max_completion_length=64",
      "data.seq_len=256", "hardware.precision=fp32"]


@pytest.fixture(scope="module")
def plans():
    """(a GRPO run's plan, the same shape's lm run's), decided once for the module."""
    return tuple(decide_and_plan(load_config(None, overrides), 1, vocab_size=4096) for overrides in (RL, RL[-2:]))


def test_the_memory_plan_counts_the_rollouts_kv_cache_and_logits(plans):
    plan, lm = plans
    rank = plan.peak_rank
    m = plan.shape
    shape = m.config_sizes
    assert rank.rollout_bytes == (kv_cache_bytes(shape, 32, 256, "fp32") + 2 * 32 * m.vocab * 4
                                  + fused_weight_bytes(shape, "fp32"))
    assert lm.peak_rank.rollout_bytes == 0


def test_the_time_plan_counts_one_forward_a_rollout_position(plans):
    plan, lm = plans
    assert StepSettings.of_plan(plan, 32).rollout_positions == 32 * 256
    assert StepSettings.of_plan(lm, 32).rollout_positions == 0
    assert all(0 < share < 1 for share in ROLLOUT_RATE_SHARE.values())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_rollout_is_planned_at_the_measured_share_of_the_training_rate(plans, precision):
    """A rollout position costs one forward (a third of a trained token's model FLOPs) at the
    precision's measured share of the rate the training runs at."""
    from dataclasses import replace

    from cputrain.plan.time import Compute
    from cputrain.plan.time.step_time import plan_step_time, token_flops

    plan, _ = plans
    settings = replace(StepSettings.of_plan(plan, 32), precision=precision)
    step = plan_step_time(settings, 1, 1, plan.shape, Compute(1e11, 0.5))
    ft = token_flops(plan.shape, settings.seq_len, settings.activation_checkpointing)
    forward_s = settings.rollout_positions * ft.model / 3 / (1e11 * 0.5)
    assert step.rollout_s == pytest.approx(forward_s / ROLLOUT_RATE_SHARE[precision])
    assert step.rollout_rate_share == ROLLOUT_RATE_SHARE[precision]


@pytest.mark.parametrize("weights, compute, lora", [("fp32", "fp32", False), ("fp32", "bf16", False),
                                                    ("fp32", "fp32", True), ("bf16", "bf16", True)])
def test_fused_weight_bytes_is_what_the_fused_decoder_holds_beside_the_model(weights, compute, lora):
    """The bytes of decoder_weights()'s tensors whose storage is not one of the model's own."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.rollouts.decoder_weights import decoder_weights
    from cputrain.rollouts.packed_weights import reorders

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtypes[weights])
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"]))
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = decoder_weights(model, dtypes[compute])
    tensors = [held.head] + [t for b in held.blocks for t in (b.qkv, b.out, b.gate_up, b.down)]
    new = sum(t.numel() * t.element_size() for t in tensors
              if t.is_mkldnn or t.untyped_storage().data_ptr() not in own)  # a reordered weight is a copy
    planned = fused_weight_bytes(config, compute)
    if not reorders(dtypes[compute]):  # the plan's upper bound: the head and out/down kept
        assert new <= planned
        return
    assert new == planned > 0


def test_an_fp32_rollout_counts_every_projection_and_the_head_anew_whatever_the_blocks_are_held_in(plans):
    """Under fp32 compute the fused decoder reorders every projection and the head (packed_weights.py),
    so a base whose block matrices are stored in bf16 (LoRA's model.lora.base_dtype) and one of fp32
    masters plan the same copy: every block's matrices and the head, in fp32."""
    from dataclasses import replace

    from cputrain.plan.memory.estimate import PlanInputs, rollout_bytes

    m = plans[0].shape
    inp = PlanInputs(strategy="single", precision="fp32", world_size=1, micro_batch=32, seq_len=256,
                     rollout_rows=32, rollout_len=256)
    bf16_blocks = replace(m, params=tuple(replace(p, stored_bytes=2) if p.unit != "root" and len(p.shape) == 2 else p
                                          for p in m.params))
    shape = m.config_sizes
    def held_in_bf16(shape):
        return any(p.stored_bytes == 2 for p in shape.params if p.unit != "root" and len(p.shape) == 2)

    assert held_in_bf16(bf16_blocks) and not held_in_bf16(m)
    assert rollout_bytes(bf16_blocks, inp) == rollout_bytes(m, inp)
    projections = sum(p.numel for p in m.params if p.unit != "root" and len(p.shape) == 2)
    head = m.vocab * shape["hidden_size"]  # its own tensor, or the embedding's where they are tied
    assert fused_weight_bytes(shape, "fp32") == (projections + head) * 4


def test_an_fsdp_rank_counts_the_whole_model_gathered_for_its_rollout(plans):
    """Under fsdp the fused decoder's weights are every unit gathered and copied, not the rank's
    shards: the plan counts the whole model in the compute dtype (checked against decoder_weights()
    on sharded ranks in tests/distributed/test_rollout_fsdp.py)."""
    from cputrain.plan.memory.estimate import PlanInputs, rollout_bytes

    m = plans[0].shape
    shape = m.config_sizes
    settings = dict(precision="bf16", world_size=2, micro_batch=32, seq_len=256, rollout_rows=32, rollout_len=256)
    fsdp, ddp = (rollout_bytes(m, PlanInputs(strategy=s, **settings)) for s in ("fsdp", "ddp"))
    gathered = fused_weight_bytes(shape, "bf16", gathered=True)
    assert fsdp - ddp == gathered - fused_weight_bytes(shape, "bf16") > 0
    assert gathered > m.vocab * shape["hidden_size"] * 2 * 2  # the embedding table and the head at least


def test_an_fsdp_rank_rolls_out_through_its_modules_where_the_copy_would_not_fit_the_node():
    """The trainer's call (rank 0's memory plan, broadcast): fused where the node holds the plan with
    the whole model's copy, else the modules, a block gathered at a time; never for ddp's copy."""
    from cputrain.plan.memory.estimate import fused_decoder_bytes
    from cputrain.plan.memory.runtime import GIB, fused_rollout_fits

    fsdp, ddp = (decide_and_plan(load_config(None, [*RL[:-1], "hardware.precision=bf16", f"parallel.strategy={s}"]),
                                 2, vocab_size=4096) for s in ("fsdp", "ddp"))
    node_gib = 2 * fsdp.peak_rank.total_bytes / GIB
    copy = fused_decoder_bytes(fsdp.shape, fsdp.inputs)
    assert copy == fused_weight_bytes(fsdp.shape.config_sizes, "bf16", gathered=True) > 0
    assert fused_rollout_fits(fsdp, 2, node_gib * 1.01) == (True, "")
    fits, why = fused_rollout_fits(fsdp, 2, node_gib * 0.99)
    assert not fits and f"({copy / GIB:.1f} GiB a rank)" in why and "2 rank(s)" in why
    assert fused_rollout_fits(ddp, 2, 0.001)[0]
