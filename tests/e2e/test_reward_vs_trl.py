"""The reward model against TRL's RewardTrainer after one optimizer update, full weights and LoRA:
the same starting classifier (a tiny Llama with one score head, saved once), pairs, margin-free
Bradley–Terry loss with reward centering, and optimizer settings (fp32, AdamW, constant lr, no
weight decay, clipping at 1), every pair in one batch on both sides (TRL's batch of 8 pairs set as such: train.global_batch_pairs,
one pair a row). The first step's loss and
accuracy agree (1e-5), the second step's loss, accuracy and mean margin to 1e-3, and after the
two steps the score of every sequence from cputrain's exported model (through `cputrain score`)
is the one TRL's trained model gives it (1e-3).

LoRA starts from the same adapters on both sides (TRL's overwritten with cputrain's initial ones,
as tests/e2e/test_kto_vs_trl.py does); the head is trained with them on both (peft's
modules_to_save under TRL).
"""

from __future__ import annotations

import json

import pytest

from harness.run_cli import run_cli
from harness.run_metrics import metrics_rows
from harness.tiny_run import tiny_overrides
from harness.trl_peer import cputrain_adapters, logged_rows, start_from, write_topic_pairs

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow

PAIRS, SEED, RANK, ALPHA, CENTER = 8, 0, 4, 32.0, 0.01
TOLERANCE = 1e-3
LR = {"full": 1e-3, "lora": 2e-2}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tiny_model):
    """The tiny Llama with a score head drawn once and saved: both sides start from its files."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base, out = tiny_model(), tmp_path_factory.mktemp("classifier") / "model"
    tok = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _trl_model(start, data, tmp_path, kind):
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_steps=2,
                        per_device_train_batch_size=PAIRS, gradient_accumulation_steps=1, learning_rate=LR[kind],
                        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                        adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, max_length=None, logging_steps=1,
                        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False,
                        center_rewards_coefficient=CENTER)
    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        from cputrain.config import LLAMA_PROJECTIONS

        peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(LLAMA_PROJECTIONS),
                                 task_type="SEQ_CLS")
    trainer = RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(start, dtype=torch.float32),
                            args=args, processing_class=AutoTokenizer.from_pretrained(start), peft_config=peft_config,
                            train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"))
    if kind == "lora":
        start_from(trainer.model, cputrain_adapters(start, RANK, ALPHA, SEED, head="score"))
    logged = logged_rows(trainer)
    trainer.train()
    rows = [r for r in logged if "accuracy" in r]
    assert len(rows) == 2, logged
    return trainer.model.eval(), trainer.train_dataset, rows


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_second_step_and_every_score_equal_trls(tmp_path, cache_dir, classifier, kind):
    import torch

    data = tmp_path / "pairs.jsonl"
    write_topic_pairs(data, PAIRS)
    out = tmp_path / "run"
    run_cli("train", *tiny_overrides(out, cache_dir, **{
        "seed": SEED, "model.name_or_path": classifier, "data.source": data, "data.format": "preference",
        "data.packing": "false", "data.seq_len": 256, "data.val_fraction": 0, "data.max_documents": "null", "train.objective": "reward",
        "train.center_rewards_coefficient": CENTER, "train.max_steps": 2, "train.global_batch_pairs": PAIRS,
        "train.micro_batch_size": PAIRS // 2, "train.lr": LR[kind], "train.warmup_steps": 0,
        "train.min_lr_ratio": 1,  # a constant lr, as TRL's here: the second update is compared too
        "train.weight_decay": 0, "train.beta1": 0.9, "train.beta2": 0.95, "train.grad_clip": 1.0,
        "train.eval_every": 100, "train.checkpoint_every": 100, "model.lora.enabled": str(kind == "lora").lower(),
        "model.lora.rank": RANK, "model.lora.alpha": ALPHA}), check=True)
    ours = [r for r in metrics_rows(out) if "loss" in r]
    model, tokenized, theirs = _trl_model(classifier, data, tmp_path, kind)
    table = "\n".join(f"{k}: cputrain {[r[k] for r in ours]} TRL {[r[k] for r in theirs]}"
                      for k in ("loss", "grad_norm", "accuracy", "margin", "mean_reward"))
    print(f"\n{table}")
    assert abs(ours[0]["loss"] - theirs[0]["loss"]) < 1e-5 and ours[0]["accuracy"] == theirs[0]["accuracy"], table
    for key in ("loss", "accuracy", "margin", "mean_reward", "grad_norm"):
        assert abs(ours[1][key] - theirs[1][key]) < TOLERANCE, f"{key} differs after one update\n{table}"
    assert abs(ours[1]["margin"] - ours[0]["margin"]) > 10 * TOLERANCE, table  # the update moved the scores
    # every sequence's score after the two updates: cputrain's model/ through `cputrain score`, TRL's model
    scored = out / "scored.jsonl"
    run_cli("score", out, "--data", data, "--out", scored, check=True)
    ours_scores = [json.loads(line) for line in scored.read_text().splitlines()]
    with torch.no_grad():
        for record, example in zip(ours_scores, tokenized):
            for key in ("chosen", "rejected"):
                theirs_score = float(model(input_ids=torch.tensor([example[f"{key}_ids"]])).logits[0, 0])
                assert abs(record[f"reward_{key}"] - theirs_score) < TOLERANCE, (key, record, theirs_score)
