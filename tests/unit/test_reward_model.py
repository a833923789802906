"""The reward model: its head (a causal LM's config made a sequence classifier's, a head the files
lack drawn from the seed, trained with LoRA's adapters), the Bradley–Terry loss with TRL's margin
and centering, and each sequence's reward in cputrain's rows (pairs packed, a shared prompt)
equal to transformers' own pooled score of that sequence alone."""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch

from cputrain.errors import ModelError
from cputrain.model.score_head import fit_head, install_token_scores, is_score_config, new_score_head
from cputrain.objectives.reward import pair_scores, sequence_scores
from cputrain.objectives.reward_loss import bradley_terry_losses


def test_bradley_terry_is_trls_loss_with_its_margin_and_centering():
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    margin = torch.tensor([0.5, 0.0, 1.0])
    got = bradley_terry_losses(chosen, rejected, margin, center_coefficient=0.01)
    for i in range(3):
        want = -math.log(1 / (1 + math.exp(-(chosen[i] - rejected[i] - margin[i])))) + \
            0.01 * float(chosen[i] + rejected[i]) ** 2
        assert float(got.losses[i]) == pytest.approx(want, abs=1e-6)
    accuracy, mean_margin, mean_reward = (float(v) / 3 for v in got.stat_sums())
    assert (accuracy, mean_margin, mean_reward) == pytest.approx((1 / 3, -0.5 / 3, 2.75 / 3))
    plain = bradley_terry_losses(chosen, rejected)
    assert plain.losses.tolist() == pytest.approx((-torch.nn.functional.logsigmoid(chosen - rejected)).tolist())


def test_each_sequence_is_scored_at_its_last_token_that_is_not_padding():
    scores = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 0, 7, 0, 0]])  # pad 0; row 1's second sequence ends on pad
    owner = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 3, 3, -1]])
    assert sequence_scores(scores, ids, owner, 4, pad_id=0).tolist() == [2.0, 4.0, 7.0, 9.0]


def test_a_causal_lms_config_becomes_a_classifiers_and_back_is_refused(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    fit_head(config, "lm", 0)  # nothing to do
    assert not is_score_config(config)
    fit_head(config, "score", 7)
    assert is_score_config(config) and config.num_labels == 1 and config.pad_token_id == 7
    assert config.architectures == ["LlamaForSequenceClassification"] and not config.tie_word_embeddings
    with pytest.raises(ModelError, match="train.objective=reward"):
        fit_head(config, "lm", 0)


def _skeleton(tiny_model_dir, pad_id):
    from transformers import AutoConfig

    from cputrain import model as models
    from cputrain.config import ModelConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    fit_head(config, "score", pad_id)
    return models.build_skeleton(models.ModelSource(tiny_model_dir, config), ModelConfig(attn_implementation="sdpa"))


def test_a_new_head_is_drawn_from_the_seed_and_trained_with_lora(tiny_model_dir):
    from cputrain.config import LoraConfig
    from cputrain.lora.adapters import add_adapters, peft_config

    skeleton = _skeleton(tiny_model_dir, 1)
    assert type(skeleton).__name__ == "LlamaForSequenceClassification"
    head = new_score_head(skeleton, tiny_model_dir, seed=3)
    again = new_score_head(copy.deepcopy(skeleton), tiny_model_dir, seed=3)
    assert head.name == "score.weight" and torch.equal(head.initial, again.initial)
    assert not torch.equal(head.initial, new_score_head(skeleton, tiny_model_dir, seed=4).initial)
    assert head.initial.std() == pytest.approx(skeleton.config.initializer_range, rel=0.3)
    assert new_score_head(skeleton, None, seed=3) is None  # random weights draw the head with the rest
    add_adapters(skeleton, LoraConfig(rank=4), frozen_dtype=torch.bfloat16, seed=0)
    trained = {n for n, p in skeleton.named_parameters() if p.requires_grad}
    assert "score.weight" in trained and skeleton.score.weight.dtype == torch.float32
    assert all(".lora_" in n for n in trained - {"score.weight"})
    assert peft_config(skeleton, LoraConfig(rank=4)).task_type == "SEQ_CLS"


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_rewards_in_packed_pairs_are_transformers_pooled_scores(tiny_model_dir, shared_prompt):
    """Pairs packed several a row (and the shared-prompt layout, its rejected answer attending to
    the prompt through the batch's mask): each sequence's reward from the rows is what
    transformers' LlamaForSequenceClassification gives that sequence alone."""
    from transformers import AutoModelForSequenceClassification

    from cputrain.data import chat_template, sequences
    from cputrain.data.preference import tokenize as tokenize_preferences
    from cputrain.data.preference.rows import PairRows
    from cputrain.data.preference.tokenize import PreferenceSpec
    from cputrain.data.tokenizer import load_tokenizer
    from harness.feedback_rows import Records

    tok = load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1,
                                                               pad_token_id=tok.pad_token_id).eval()
    records = [{"prompt": f"Question {i}: what is {w}?\nAnswer:", "chosen": f" {w} is a kind of object{'!' * i}",
                "rejected": f" nobody knows{'?' * (3 - i)}"} for i, w in enumerate(["list", "dict", "set"])]
    spec = PreferenceSpec("prompt", "chosen", "rejected", chat_template.template_of(tok, None),
                          chat_template.template_variables(tok), 512, shared_prompt)
    sequences.init_worker(None, Records(records), spec, tok.backend_tokenizer.to_str(), tok.eos_token_id, "uint16")
    chunk = tokenize_preferences.tokenize_rows(0, 3, np.zeros(3, bool))
    ids, lengths = chunk.parts["train.bin"], chunk.parts["train.lengths.bin"]
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    with torch.no_grad():
        expected = [float(model(input_ids=torch.from_numpy(ids[a:b].astype(np.int64))[None]).logits[0, 0])
                    for a, b in zip(bounds, bounds[1:])]
    rows = PairRows(ids, chunk.parts["train.mask.bin"], lengths, 512, True, tok.pad_token_id, shared_prompt)
    assert len(rows) == 1  # the three pairs in one row
    install_token_scores(model)
    with torch.no_grad():
        got = pair_scores(model, rows.batch([0]), tok.pad_token_id).tolist()
    assert got == pytest.approx(expected, abs=1e-4)


def _reward_adapter_folder(tiny_model_dir, out):
    """A LoRA reward model's folder as a run exports it: adapters and the trained score head (peft's
    modules_to_save) on the tiny Llama."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    peft_model = get_peft_model(classifier, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj"],
                                                       modules_to_save=["score"]))
    peft_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return peft_model


def test_a_lora_reward_model_loads_its_head_without_transformers_newly_initialized_report(tiny_model_dir, tmp_path):
    """The base has no score head, so transformers reports score.weight MISSING "newly initialized"
    on every load, though the adapter folder's trained head replaces it: the report is held back,
    the head checked instead (a folder without it is refused), and the head is the trained one."""
    from safetensors.torch import load_file, save_file

    from cputrain.lora.adapter_folder import WEIGHTS_NAME, load_adapted

    trained = _reward_adapter_folder(tiny_model_dir, tmp_path / "model")
    reports = []  # what transformers' loader logs, seen where it is logged (its own handler may be quiet)
    seen = logging.Handler()
    seen.emit = lambda record: reports.append(record.getMessage())
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(seen)
    try:
        loaded = load_adapted(tmp_path / "model")
    finally:
        logger.removeHandler(seen)
    assert not [r for r in reports if "MISSING" in r], reports
    head = [p for n, p in loaded.named_parameters() if "score" in n and "modules_to_save" in n]
    want = [p for n, p in trained.named_parameters() if "score" in n and "modules_to_save" in n]
    assert len(head) == 1 and torch.equal(head[0], want[0])
    weights = load_file(tmp_path / "model" / WEIGHTS_NAME)
    save_file({k: v for k, v in weights.items() if "score" not in k}, tmp_path / "model" / WEIGHTS_NAME)
    with pytest.raises(ModelError, match="hold no trained score head"):
        load_adapted(tmp_path / "model")
