"""objectives.rl_loss on small tensors whose figures are known by hand: the group-relative and
leave-one-out advantages, each loss type's sum and what it is divided by, the clipping and the KL
(the whole step against TRL's trainers: test_online_rl_vs_trl)."""

from __future__ import annotations

import math

import pytest
import torch

from cputrain.objectives import rl_loss


def test_group_advantages_scale_by_the_groups_std_the_batchs_or_none():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])
    group, zero_std = rl_loss.group_advantages(rewards, 2, "group")
    assert group.tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-4), 1 / (math.sqrt(2) + 1e-4), 0.0, 0.0])
    assert zero_std.tolist() == [False, False, True, True]
    none, _ = rl_loss.group_advantages(rewards, 2, "none")
    assert none.tolist() == [-1.0, 1.0, 0.0, 0.0]
    batch, _ = rl_loss.group_advantages(rewards, 2, "batch", batch_std=2.0)
    assert batch.tolist() == pytest.approx([-1 / 2.0001, 1 / 2.0001, 0.0, 0.0])


def test_leave_one_out_baseline_is_the_mean_of_the_other_rewards():
    advantages = rl_loss.leave_one_out_advantages(torch.tensor([1.0, 2.0, 6.0]), 3)
    assert advantages.tolist() == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5])


def test_a_group_of_equal_rewards_has_advantages_of_exactly_zero():
    """8 rewards of 0.3: their fp32 mean is 0.3 less an ulp, which ÷ (std 0 + 1e-4) would be an
    advantage of ~3e-4; an exact 0 is what lets the step leave the group out of its rows."""
    rewards = torch.tensor([0.3] * 8 + [0.0, 1.0] * 4)
    assert float(rewards[:8].mean()) != 0.3  # the rounding the exact zero is there for
    for scale in ("group", "batch", "none"):
        advantages, _ = rl_loss.group_advantages(rewards, 8, scale, batch_std=0.5)
        assert advantages[:8].tolist() == [0.0] * 8 and (advantages[8:] != 0).all(), scale
    loo = rl_loss.leave_one_out_advantages(rewards, 8)
    assert loo[:8].tolist() == [0.0] * 8 and (loo[8:] != 0).all()


def test_each_loss_type_sums_and_counts_as_trl_normalises():
    logps = torch.zeros(2, 3)  # ratio 1: the loss is −advantage on every token
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    grpo = rl_loss.grpo_loss(logps, logps, advantages, mask, "grpo", 0.2, 0.2, 4)
    assert float(grpo.summed) == pytest.approx(-1.0 + 2.0)  # each completion's token mean, summed
    dapo = rl_loss.grpo_loss(logps, logps, advantages, mask, "dapo", 0.2, 0.2, 4)
    assert float(dapo.summed) == pytest.approx(-3.0 + 2.0)  # every token
    assert rl_loss.items_of("grpo", 2, 4, 4) == 2
    assert rl_loss.items_of("dapo", 2, 4, 4) == 4
    assert rl_loss.items_of("dr_grpo", 2, 4, 4) == 8


def test_the_ratio_is_clipped_where_it_would_gain_and_the_kl_is_added():
    old = torch.zeros(1, 2)
    logps = torch.tensor([[math.log(1.5), math.log(0.5)]])  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    out = rl_loss.grpo_loss(logps, old, torch.tensor([1.0]), mask, "dapo", 0.2, 0.28, 4)
    # positive advantage: min(1.5, 1.28) and min(0.5, 0.8) → −(1.28 + 0.5)
    assert float(out.summed) == pytest.approx(-(1.28 + 0.5))
    assert out.sums.tolist()[:5] == [2.0, 1.0, 0.0, 1.0, 1.0]  # one token clipped high
    with_kl = rl_loss.grpo_loss(logps, old, torch.tensor([1.0]), mask, "dapo", 0.2, 0.28, 4, beta=0.1,
                                ref_logps=old)
    kl = rl_loss.token_kl(logps, old).sum()
    assert float(with_kl.summed) == pytest.approx(float(out.summed) + 0.1 * float(kl))
    figures = rl_loss.loss_figures(with_kl.sums, sequence_level=False, beta=0.1)
    assert figures["clip_ratio/high_mean"] == 0.5 and figures["kl"] == pytest.approx(float(kl) / 2)


def test_rloo_takes_the_ratio_of_the_whole_completion():
    old = torch.zeros(2, 2)
    logps = torch.tensor([[0.1, 0.2], [0.0, 0.0]])
    out = rl_loss.rloo_loss(logps, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), 0.2, 0.2)
    ratio = math.exp(0.3)  # above 1.2: clipped for the positive advantage
    assert float(out.summed) == pytest.approx(-min(ratio, 1.2) + 1.0)


def test_completion_logps_runs_the_head_from_the_first_completion_position_with_the_same_figures():
    """Rows whose prompts differ in length: the head runs from the earliest position predicting a
    completion token (logits_to_keep), and each token's log-probability and gradient are those of
    the logits of every position."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.objectives.rollout_batch import completion_logps, rollout_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    batch = rollout_batch([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]], [[20, 21, 22], [23]], pad_id=0)
    kept = []
    model.register_forward_pre_hook(lambda _, args, kwargs: kept.append(kwargs.get("logits_to_keep")),
                                    with_kwargs=True)
    logps = completion_logps(model, batch, temperature=0.7)
    assert kept == [batch.input_ids.shape[1] - 3]  # the second row's first completion token comes from position 3
    logps.sum().backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()

    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits.float() / 0.7
    every = torch.log_softmax(logits, -1).gather(-1, batch.labels.clamp(min=0)[:, 1:, None]).squeeze(-1)
    expected = torch.stack([every[r, batch.predicted_from[r]] for r in range(2)]) * batch.completion_mask
    expected.sum().backward()
    assert torch.allclose(logps, expected, atol=1e-6)
    assert torch.allclose(grad, model.lm_head.weight.grad, atol=1e-6)
