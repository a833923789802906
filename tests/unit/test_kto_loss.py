"""KTO's loss against its formula (TRL's KTOTrainer, loss_type="kto"), TRL's figures and its
warning on unbalanced labels, and the KL estimate taken over the whole global batch: a step's loss
and figures are the same however its examples are cut into micro-batches (and so ranks)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cputrain.objectives.kto import KtoObjective, feedback_reference_table, weights_advice
from cputrain.objectives.kto_loss import SUM_NAMES, kl_estimate, kto_figures, kto_losses


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_losses_are_trls_formula():
    logps, ref = torch.tensor([-10.0, -12.0, -7.0]), torch.tensor([-11.0, -11.5, -7.0])
    desirable = torch.tensor([True, False, True])
    beta, kl, wd, wu = 0.1, 0.3, 1.5, 0.7
    got = kto_losses(logps, ref, desirable, kl, beta, wd, wu)
    expect = [wd * (1 - _sigmoid(beta * (1.0 - kl))), wu * (1 - _sigmoid(beta * (kl - (-0.5)))),
              wd * (1 - _sigmoid(beta * (0.0 - kl)))]
    assert got.losses.tolist() == pytest.approx(expect, abs=1e-6)
    assert got.rewards.tolist() == pytest.approx([0.1, -0.05, 0.0], abs=1e-6)
    # at the start the policy is its reference: every loss 1 - σ(∓β·z), 0.5 with no KL
    assert kto_losses(logps, logps, desirable, 0.0, beta).losses.tolist() == [0.5, 0.5, 0.5]


def test_the_kl_estimate_is_a_mean_never_below_zero():
    assert kl_estimate(3.0, 4) == 0.75
    assert kl_estimate(-3.0, 4) == 0.0  # TRL clamps it so
    assert kl_estimate(0.0, 0) == 0.0


def test_figures_are_means_over_each_labels_own_examples():
    losses = kto_losses(torch.tensor([-4.0, -6.0, -8.0]), torch.tensor([-5.0, -5.0, -5.0]),
                        torch.tensor([True, True, False]), 0.25, beta=1.0)
    sums = losses.stat_sums()
    assert len(sums) == len(SUM_NAMES)
    figures = kto_figures(sums, 3)
    assert figures["rewards/chosen"] == pytest.approx((1.0 - 1.0) / 2)
    assert figures["rewards/rejected"] == pytest.approx(-3.0)
    assert figures["logps/chosen"] == pytest.approx(-5.0) and figures["logps/rejected"] == pytest.approx(-8.0)
    assert figures["rewards/margins"] == pytest.approx(3.0) and figures["kl"] == pytest.approx(0.25)
    none_rejected = kto_figures(kto_losses(torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([True]), 0.0,
                                           1.0).stat_sums(), 1)
    assert math.isnan(none_rejected["rewards/rejected"]) and math.isnan(none_rejected["rewards/margins"])


def test_unbalanced_labels_get_trls_warning_with_its_recommended_weights():
    # TRL's bounds for 35 desirable and 19 undesirable examples at weights 1 and 1
    advice = weights_advice(35, 19, 1.0, 1.0)
    assert "train.kto_desirable_weight in [0.54, 0.72]" in advice
    assert "train.kto_undesirable_weight in [1.39, 1.84]" in advice
    assert weights_advice(35, 19, 0.6, 1.0) is None  # a weight in range: nothing to say
    assert weights_advice(20, 20, 1.0, 1.0) is None  # balanced


@pytest.fixture(scope="module")
def model_and_rows(tiny_model_dir):
    """The tiny model and 8 feedback examples (one a row), the reference computed as prepare does."""
    from transformers import AutoModelForCausalLM

    from cputrain.data.tokenizer import load_tokenizer
    from harness.feedback_rows import FEEDBACK_RECORDS, feedback_rows

    tok = load_tokenizer(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    records = FEEDBACK_RECORDS + [{**r, "label": not r["label"], "prompt": r["prompt"] + "Again: "}
                                  for r in FEEDBACK_RECORDS[:3]]
    rows, _ = feedback_rows(tok, records, packing=False)
    # a reference other than the policy: the policy's log-probabilities, shifted
    rows.reference_logps = feedback_reference_table(model, rows, 4, _no_autocast) - 0.5
    return model, rows


def _no_autocast():
    return torch.autocast("cpu", enabled=False)


@pytest.mark.parametrize("micro_batch", [1, 3, 8])
def test_a_steps_loss_does_not_depend_on_how_it_is_cut(model_and_rows, micro_batch):
    """z over the whole global batch (start_step) and the examples' summed loss ÷ their number:
    the same for one micro-batch of 8 as for 8 of one (or 3, 3, 2), as for ranks sharing them."""
    model, rows = model_and_rows
    cfg = SimpleNamespace(kto_beta=0.1, kto_desirable_weight=1.0, kto_undesirable_weight=1.0)
    objective = KtoObjective(cfg, None)
    indices = np.arange(8)
    batches = [rows.batch(indices[i : i + micro_batch]) for i in range(0, 8, micro_batch)]
    objective.start_step(model, batches, _no_autocast)
    with torch.no_grad():
        total = sum(float(objective.loss(model, b, 8)[0]) for b in batches)
        sums = sum(objective.loss(model, b, 8)[1] for b in batches)
    whole = KtoObjective(cfg, None)
    one = [rows.batch(indices)]
    whole.start_step(model, one, _no_autocast)
    with torch.no_grad():
        want_total, want_sums = whole.loss(model, one[0], 8)
    assert objective.kl == pytest.approx(whole.kl, abs=1e-6) and whole.kl > 0
    assert total == pytest.approx(float(want_total), abs=1e-6)
    assert objective.figures(sums, 8) == pytest.approx(whole.figures(want_sums, 8), abs=1e-5)
