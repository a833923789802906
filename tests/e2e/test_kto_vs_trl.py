"""KTO against TRL's KTOTrainer after one optimizer update, full weights and LoRA: the same tiny
model, feedback, β, weights and optimizer settings (fp32, AdamW, constant lr, no weight decay,
clipping at 1), every example in one batch on both sides (cputrain's global batch of 8 in two
micro-batches of 4 is TRL's batch of 8: cputrain's KL estimate is over the global batch, TRL's
over its one batch, and the KL sequences pair each example with the one before it on both).
The first step's loss is half the mean weight on any implementation (policy = reference, z = 0), its summed
log-probabilities agree to 1e-4; the second step's loss, KL estimate, rewards and
log-probabilities to 1e-3 show the loss, the KL estimate and the update are TRL's.

LoRA starts from the same adapters on both sides: peft and cputrain draw the A matrices from
different random streams, so TRL's are overwritten with cputrain's initial ones (B is zero).
"""

from __future__ import annotations

import json

import pytest

from harness.run_cli import run_cli
from harness.run_metrics import metrics_rows
from harness.tiny_run import tiny_overrides
from harness.trl_peer import cputrain_adapters, logged_rows, start_from

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow

EXAMPLES, SEED, RANK, ALPHA = 8, 0, 4, 32.0
BETA, DESIRABLE_WEIGHT, TOLERANCE = 0.1, 1.2, 1e-3
LR = {"full": 1e-3, "lora": 2e-2}
FIGURES = ("loss", "grad_norm", "kl", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
           "rewards/margins")


def _feedback(path) -> None:
    from pydoc_data.topics import topics

    names = sorted(topics)[:EXAMPLES + 1]
    with open(path, "w") as f:
        for i in range(EXAMPLES):
            answer = " " + " ".join(topics[names[i + i % 2]].split())[: 40 + 25 * (i % 4)]
            f.write(json.dumps({"prompt": f"Question: what is {names[i]}?\nAnswer:", "completion": answer,
                                "label": i % 3 != 1}) + "\n")


def _trl_steps(base, data, tmp_path, kind) -> list[dict]:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    torch.manual_seed(0)
    # bf16=False: TRL's configs default to bf16 autocast where the CPU has it (this comparison is fp32)
    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_steps=2,
                     per_device_train_batch_size=EXAMPLES, gradient_accumulation_steps=1, learning_rate=LR[kind],
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                     adam_epsilon=1e-8, max_grad_norm=1.0, beta=BETA, desirable_weight=DESIRABLE_WEIGHT,
                     max_length=None, logging_steps=1, save_strategy="no", disable_tqdm=True,
                     dataloader_num_workers=0, gradient_checkpointing=False)
    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        from cputrain.config import LLAMA_PROJECTIONS

        peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(LLAMA_PROJECTIONS),
                                 task_type="CAUSAL_LM")
    trainer = KTOTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args=args,
                         processing_class=AutoTokenizer.from_pretrained(base), peft_config=peft_config,
                         train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"))
    if kind == "lora":
        start_from(trainer.model, cputrain_adapters(base, RANK, ALPHA, SEED))
    logged = logged_rows(trainer)
    trainer.train()
    rows = [r for r in logged if "kl" in r]
    assert len(rows) == 2, logged
    return rows


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_second_step_equals_trls(tmp_path, cache_dir, tiny_model, kind):
    base = tiny_model()
    data = tmp_path / "feedback.jsonl"
    _feedback(data)
    out = tmp_path / "run"
    run_cli("train", *tiny_overrides(out, cache_dir, **{
        "seed": SEED, "model.name_or_path": base, "data.source": data, "data.format": "feedback",
        "data.packing": "false", "data.seq_len": 256, "data.val_fraction": 0, "data.max_documents": "null",
        "train.objective": "kto", "train.kto_beta": BETA, "train.kto_desirable_weight": DESIRABLE_WEIGHT,
        "train.max_steps": 2, "train.global_batch_size": EXAMPLES, "train.micro_batch_size": EXAMPLES // 2,
        "train.lr": LR[kind], "train.warmup_steps": 0, "train.weight_decay": 0, "train.beta1": 0.9,
        "train.beta2": 0.95, "train.grad_clip": 1.0, "train.eval_every": 100, "train.checkpoint_every": 100,
        "model.lora.enabled": str(kind == "lora").lower(), "model.lora.rank": RANK, "model.lora.alpha": ALPHA}),
        check=True)
    ours = metrics_rows(out)
    ours = [r for r in ours if "loss" in r]
    theirs = _trl_steps(base, data, tmp_path, kind)
    assert [r["step"] for r in ours] == [1, 2]
    table = "\n".join(f"{k}: cputrain {[r[k] for r in ours]} TRL {[r[k] for r in theirs]}" for k in FIGURES)
    print(f"\n{table}")
    # step 1: the policy is its reference on both sides (z = 0): each loss is half its label's weight;
    # the answers' log-probabilities agree
    weights = [DESIRABLE_WEIGHT if i % 3 != 1 else 1.0 for i in range(EXAMPLES)]
    assert abs(ours[0]["loss"] - 0.5 * sum(weights) / EXAMPLES) < 1e-6, table
    assert abs(ours[0]["loss"] - theirs[0]["loss"]) < 1e-5, table
    for key in ("logps/chosen", "logps/rejected"):
        assert abs(ours[0][key] - theirs[0][key]) < 1e-4, f"{key} differs at step 1\n{table}"
    # step 2: after one update with the same settings
    for key in FIGURES:
        assert abs(ours[1][key] - theirs[1][key]) < TOLERANCE, f"{key} differs after one update\n{table}"
    # the update moved the policy and the KL estimate: a comparison of two unmoved policies would prove nothing
    assert abs(ours[1]["rewards/margins"]) > 10 * TOLERANCE and ours[1]["kl"] > 10 * TOLERANCE, table
