"""model.activation_checkpointing=selective: the step of a run without checkpointing, no matmul run
twice in the backward, and per block the bytes the plan counts (cputrain.plan.memory.activations)."""

from __future__ import annotations

import re

import pytest

LAYERS = 3
BATCH, SEQ = 2, 32
# wide enough that LoRA's lora_B (rank 4 into 32 or more) is a thin matmul, as at real sizes
SHAPE = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 2}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_llama(lora: bool = False, attention: str = "sdpa"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, num_hidden_layers=LAYERS, max_position_embeddings=64,
                      attn_implementation=attention, **SHAPE)
    model = LlamaForCausalLM(cfg).train()
    if lora:  # as cputrain.lora.adapters puts them in, on a model with weights
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.requires_grad_(".lora_" in name)
                if ".lora_B." in name:  # lora_B starts at zero: give every adapter a gradient to compare
                    p.normal_(0, 0.02)
        # what transformers does to a LoRA model it checkpoints (the first block's input then needs a
        # gradient, three more matmuls): done for every setting, so their matmuls compare
        model.enable_input_require_grads()
    return model


def _step(model, setting, bf16: bool = False):
    """One forward + backward: the loss, the gradients, and how many matmuls (not thin ones:
    LoRA's rank-wide products) and attention forwards the backward ran."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from cputrain import model as models
    from cputrain.model.selective_checkpointing import (
        ATTENTION_OPS,
        MATMUL_OPERANDS,
        is_thin_matmul,
    )

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            operands = MATMUL_OPERANDS.get(func)
            if func in ATTENTION_OPS or operands and not is_thin_matmul(args[operands[0]], args[operands[1]]):
                self.count += 1
            return func(*args, **(kwargs or {}))

    models.enable_activation_checkpointing(model, setting)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, labels=ids).loss
    counter = CountMatmuls()
    with counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, counter.count


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_selective_steps_as_without_checkpointing_and_runs_no_matmul_twice(lora):
    """Loss and every gradient as without checkpointing (fp32, 1e-6); the backward runs as many
    matmuls as without checkpointing, whole blocks run every block's again. LoRA: only lora_B's
    thin products (rank 4 into the projection's width) may run again, and are not counted."""
    import torch

    none, whole, selective, mixed = (_step(_tiny_llama(lora), s) for s in (False, True, "selective", "1+selective"))
    for loss, grads, _ in (selective, whole, mixed):
        assert loss == pytest.approx(none[0], abs=1e-6)
        assert grads.keys() == none[1].keys() and grads
        for name, g in none[1].items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert selective[2] == none[2]
    # whole blocks: every block's projections and attention again (but down_proj's own product,
    # which no backward reads: torch stops a block's recompute once it has what the backward needs)
    assert whole[2] >= none[2] + LAYERS * len(TARGETS)
    # the first block whole, the other two selective: that one block's matmuls again, no more
    assert none[2] + len(TARGETS) <= mixed[2] <= none[2] + (whole[2] - none[2]) / LAYERS


def _kept_per_block(monkeypatch, lora: bool, bf16: bool, attention: str = "sdpa") -> float:
    """Bytes selective checkpointing keeps per block in the forward: what the policy names, read
    from the ops' own outputs (each storage once)."""
    import torch
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import CheckpointPolicy

    from cputrain.model import selective_checkpointing as sc

    kept: dict[int, int] = {}
    policy = sc.policy

    def counting(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE:
            for t in tree_leaves(ctx.op_output):
                if isinstance(t, torch.Tensor):
                    kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return decision

    monkeypatch.setattr(sc, "policy", counting)
    _step(_tiny_llama(lora, attention), "selective", bf16=bf16)
    return sum(kept.values()) / LAYERS


@pytest.mark.parametrize("lora,bf16,attention", [(False, False, "sdpa"), (False, True, "sdpa"), (True, False, "sdpa"),
                                                 (False, False, "eager")],
                         ids=["full-fp32", "full-bf16", "lora-fp32", "eager-fp32"])
def test_the_plan_counts_what_selective_keeps(monkeypatch, lora, bf16, attention):
    """The plan's bytes kept per block (selective_block_bytes) against the outputs the policy kept
    in a real forward, within 2% (equal on this model); and with the block's input, under 60% of
    what a block keeps without checkpointing."""
    from cputrain.plan.memory.activations import activation_bytes, selective_block_bytes
    from cputrain.plan.model_shape import shape_of

    measured = _kept_per_block(monkeypatch, lora, bf16, attention)
    m = shape_of(_tiny_llama(lora))
    matmul_bytes = 2 if bf16 else 4
    # eager at seq 32, head_dim 16: q·kᵀ is not thin (16 × 4 > 32), its 2 × 4 × 32² scores are kept
    planned = selective_block_bytes(m, BATCH, SEQ, matmul_bytes, eager_attention=attention == "eager")
    assert measured == pytest.approx(planned, rel=0.02), f"measured {measured:,.0f} B, planned {planned:,} B"
    # the plan of a whole run: every block's input and kept outputs + one block recomputed, over none
    precision = "bf16" if bf16 else "fp32"
    plan = {s: activation_bytes(m, BATCH, SEQ, precision, s, local_weight_params=0,
                                eager_attention=attention == "eager").saved_bytes
            for s in (False, True, "selective", "1+selective")}
    block_input = BATCH * SEQ * m.hidden * 4
    one_block = (plan[False] - plan[True] + LAYERS * block_input) / (LAYERS - 1)  # what a kept block adds
    assert plan["selective"] - plan[True] == LAYERS * planned
    assert plan["1+selective"] - plan[True] == (LAYERS - 1) * planned  # the first block whole
    assert planned + block_input < 0.6 * one_block


# model.compile=true with selective (torch.compile traces the policy into each block's graph) is
# trained against eager without checkpointing in tests/e2e/test_compile.py, on the compile that
# test makes anyway.


def test_cputrain_plan_shows_selective_with_no_matmul_recomputed():
    """`cputrain plan ... model.activation_checkpointing=selective`: named in the plan's first
    lines, activations between none and every block, and step FLOPs those of no checkpointing."""
    from cputrain.config.file import load_config
    from cputrain.plan.memory.report import table_lines
    from cputrain.plan.time import step_flops
    from cputrain.training.choices import decide_and_plan

    plans = {s: decide_and_plan(load_config(None, ["model.arch.num_hidden_layers=6", "data.seq_len=512",
                                                f"model.activation_checkpointing={s}"]), 1)
             for s in ("false", "selective", "true")}
    assert any("activation checkpointing selective" in line for line in table_lines(plans["selective"]))
    act = {s: p.peak_rank.activation_bytes for s, p in plans.items()}
    assert act["true"] < act["selective"] < act["false"]
    flops = {s: step_flops(p.shape, 512, 8, p.inputs.activation_checkpointing) for s, p in plans.items()}
    assert flops["selective"] == flops["false"] < flops["true"]


def test_zero3_refuses_selective_in_one_line():
    from cputrain.config.file import load_config
    from cputrain.errors import ConfigError

    for setting in ("selective", "2+selective"):
        with pytest.raises(ConfigError, match=re.escape(f"{setting} does not take parallel.strategy=zero3")) as err:
            load_config(None, [f"model.activation_checkpointing={setting}", "parallel.strategy=zero3"])
        assert "\n" not in str(err.value)
