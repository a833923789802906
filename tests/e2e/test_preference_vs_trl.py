"""Full-weight DPO against TRL's DPOTrainer after one optimizer update: the same tiny model, pairs,
β and optimizer settings (fp32, AdamW, no warm-up, no weight decay, clipping at 1), every pair in
each step's batch on both sides (TRL's batch of 8 pairs set as such, train.global_batch_pairs: one
pair a row, 8 rows a step, and each step logs its 8 pairs). The first step's loss is ln 2 on any implementation (policy = reference);
the second step's loss, rewards and margins show the gradients and the update are TRL's too.
The first step's summed log-probabilities agree to 1e-4, the second step's figures to 1e-3.

LoRA is left out of this comparison: peft and cputrain draw the A matrices from different random
streams, so one update moves the two policies differently by design; LoRA's log-probabilities are
compared with TRL's in tests/unit/test_preference_vs_trl.py.
"""

from __future__ import annotations


import pytest

from harness.run_cli import run_cli
from harness.run_metrics import metrics_rows
from harness.tiny_run import tiny_overrides
from harness.trl_peer import write_topic_pairs

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow

PAIRS = 8
LR, BETA, TOLERANCE = 1e-3, 0.1, 1e-3
FIGURES = ("grad_norm", "logps/chosen", "logps/rejected", "loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def _trl_second_step(base, data, tmp_path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    logged: list[dict] = []
    # bf16=False: TRL's configs default to bf16 autocast where the CPU has it (this comparison is fp32)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_steps=2,
                     per_device_train_batch_size=PAIRS, gradient_accumulation_steps=1, learning_rate=LR,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                     adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, beta=BETA, max_length=None,
                     logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args=args,
                         processing_class=AutoTokenizer.from_pretrained(base),
                         train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"))
    trainer.add_callback(type("Rows", (TrainerCallback,), {
        "on_log": lambda self, a, state, control, logs=None, **kw: logged.append(dict(logs or {}))})())
    trainer.train()
    rows = [r for r in logged if "rewards/margins" in r]
    assert len(rows) == 2, logged
    return rows


def test_second_step_equals_trls(tmp_path, cache_dir, tiny_model):
    base = tiny_model()
    data = tmp_path / "pairs.jsonl"
    write_topic_pairs(data, PAIRS)
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{
        "model.name_or_path": base, "data.source": data, "data.format": "preference", "data.packing": "false",
        "data.seq_len": 256, "data.val_fraction": 0, "data.max_documents": "null", "train.objective": "dpo",
        "train.dpo_beta": BETA, "train.max_steps": 2, "train.global_batch_pairs": PAIRS,
        "train.micro_batch_size": PAIRS // 2, "train.lr": LR, "train.warmup_steps": 0, "train.weight_decay": 0,
        "train.beta1": 0.9, "train.beta2": 0.95, "train.grad_clip": 1.0, "train.eval_every": 100,
        "train.checkpoint_every": 100}), check=True)
    ours = metrics_rows(out)
    ours = [r for r in ours if "loss" in r]
    theirs = _trl_second_step(base, data, tmp_path)
    assert [r["step"] for r in ours] == [1, 2]
    assert [r["pairs_per_step"] for r in ours] == [PAIRS, PAIRS] and f" {PAIRS} pairs/step " in proc.stderr
    assert f"batch: {PAIRS} preference pairs a step, one a row" in proc.stderr
    table = "\n".join(f"{k}: cputrain {[r[k] for r in ours]} TRL {[r[k] for r in theirs]}" for k in FIGURES)
    print(f"\n{table}")
    # step 1: the policy is its reference on both sides; the answers' summed log-probabilities agree
    assert abs(ours[0]["loss"] - theirs[0]["loss"]) < 1e-5, table
    for key in ("logps/chosen", "logps/rejected"):
        assert abs(ours[0][key] - theirs[0][key]) < 1e-4, f"{key} differs at step 1\n{table}"
    # step 2: after one update with the same settings
    for key in FIGURES:
        assert abs(ours[1][key] - theirs[1][key]) < TOLERANCE, f"{key} differs after one update\n{table}"
    # the update moved the policy: a comparison of two unmoved policies would prove nothing
    assert abs(ours[1]["rewards/margins"]) > 10 * TOLERANCE, table
