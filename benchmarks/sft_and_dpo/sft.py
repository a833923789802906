"""Supervised fine-tuning on chat data: cputrain against TRL's SFTTrainer, side by side, full and
LoRA. Writes block sft of docs/benchmarks/sft-and-dpo.md.

    python benchmarks/sft_and_dpo/sft.py            # needs the sft-peer extra (trl); ~15 min on 2 cores: run it alone
    python benchmarks/sft_and_dpo/sft.py --quick    # a tiny model and 3 steps, one run: checks the script only

The model: a ~100M-parameter Llama (768 wide, 12 layers, 8,192-token head) with random weights,
saved as a Hugging Face folder (benchmarks/runner/base_model.py) with a byte-level BPE trained on
builtin:pydoc. The data: conversations built from pydoc's help topics whose answers run from a
few tokens to ~1,000 (log-uniform lengths), a third with a system prompt and a second turn, all
rendered with one ChatML template that marks each answer and its end token with
`{% generation %}` (TRL finds answers only through such markers; cputrain needs none, and takes
the same file as data.chat_template so both train the very same tokens).

cputrain    `cputrain train`, data.format=chat, packed (data.packing=true) into rows of 1,024
            tokens, 8 rows per step (2 × 4 micro-batches), LoRA r=16 on all seven projections
            for the LoRA rows.
TRL         SFTTrainer with assistant_only_loss, 16 conversations per step (4 × 4 micro-batches),
            max_length 1,024: `pad` is its CPU default (each micro-batch padded to its longest),
            `packing` is packing=True (its bfd strategy, padding-free with position ids). LoRA
            rows pass peft's LoraConfig (the same r, alpha and targets).

Trained tokens/s is the median over steps after the first --warmup of (targets that carry loss
in the step) ÷ (step time), counted from each side's own batches. The padding share is padding
÷ all token positions the model ran on. Step peak RSS is the high-water mark reset before each
step and read after it (cputrain's memory.json "training step peak"; a Trainer callback on TRL's
side). The first-step loss is each side's own first batch: the batches hold different
conversations (packed rows against 16 padded conversations), so the losses differ by that.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.base_model import make_base  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.processes import comparison_args, run_measured_child  # noqa: E402
from benchmarks.runner.timing import steady_median  # noqa: E402
from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from benchmarks.runner.hf_trainer_clock import count_trainer_steps  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402
from cputrain.data.chat_template import MARKED_CHATML  # noqa: E402
from cputrain.data.examples.rows import open_examples  # noqa: E402

ARCH_100M = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "max_position_embeddings": 2048, "tie_word_embeddings": False}
QUICK_ARCH = {**ARCH_100M, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
SEQ_LEN, LR, SEED = 1024, 1e-4, 1337
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_chats(path: Path, n: int, seed: int = SEED) -> None:
    """`n` conversations whose answers are log-uniform in length, 40 to 4,000 characters."""
    import random

    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = sorted(topics)
    with open(path, "w") as f:
        for i in range(n):
            name = names[i % len(names)]
            text = " ".join(topics[name].split())
            answer = text[: int(math.exp(rng.uniform(math.log(40), math.log(4000))))]
            messages = [{"role": "user", "content": f"Tell me about {name} in Python."},
                        {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                messages = [{"role": "system", "content": "You explain Python."}, *messages,
                            {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Glad to help."}]
            f.write(json.dumps({"messages": messages}) + "\n")


# ------------------------------------------------------------------------------------------
# cputrain


def run_cputrain(base: str, data: Path, template: Path, lora: bool, steps: int, warmup: int, cache_dir: str) -> dict:
    overrides = [f"model.name_or_path={base}",
                 f"data.source={data}", "data.format=chat", f"data.chat_template={template}", f"data.seq_len={SEQ_LEN}",
                 "data.val_fraction=0", f"data.cache_dir={cache_dir}", f"train.max_steps={steps}",
                 "train.global_batch_size=8", "train.micro_batch_size=2", f"train.lr={LR}", "train.warmup_steps=2",
                 "train.log_every=1", "train.eval_every=100000", "train.checkpoint_every=100000",
                 "train.sample_tokens=0", f"seed={SEED}"]
    if lora:
        overrides += ["model.lora.enabled=true", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}"]
    run = train_measured(overrides)
    rows, step_peak, process_peak = run.metrics_rows, run.step_peak["rss_gib"], run.process_peak_rss_gib
    # the rows as the run packed them: their fill is 1 - the padding share
    examples = open_examples(next(Path(cache_dir).glob("packed/*/stats.json")).parent, packing=True)
    stats = examples.stats
    return {"trained_tokens_per_s": steady_median([r["trained_tokens_per_s"] for r in rows], warmup),
            "tokens_per_s": steady_median([r["tokens_per_s"] for r in rows], warmup),
            "padding_share": 1 - stats["packing_efficiency"],
            "step_peak_rss_gib": step_peak, "process_peak_rss_gib": process_peak, "first_loss": rows[0]["loss"],
            "trained_token_share": stats["trained_token_share"]}


# ------------------------------------------------------------------------------------------
# TRL (in its own process; prints one JSON line)


def trl_child(opts: dict) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(physical_cores())  # the threads cputrain's `auto` gives one rank
    tok = AutoTokenizer.from_pretrained(opts["base"])
    tok.chat_template = MARKED_CHATML
    dtype = torch.bfloat16 if opts["bf16"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(opts["base"], dtype=torch.float32 if not opts["lora"] else dtype,
                                                 attn_implementation="sdpa")
    peft_config = None
    if opts["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                                 task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out, max_steps=opts["steps"], per_device_train_batch_size=4, gradient_accumulation_steps=4,
            learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0,
            seed=SEED, use_cpu=True, bf16=opts["bf16"], report_to="none", save_strategy="no", eval_strategy="no",
            logging_strategy="steps", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
            assistant_only_loss=True, max_length=SEQ_LEN, packing=opts["packing"],
        )
        trainer = SFTTrainer(model=model, args=args, processing_class=tok, peft_config=peft_config,
                             train_dataset=datasets.load_dataset("json", data_files=opts["data"], split="train"))

        def count(batch) -> dict[str, int]:
            labels = batch["labels"]
            padding = int((batch["attention_mask"] == 0).sum()) if "attention_mask" in batch else 0
            return {"trained": int((labels[:, 1:] != -100).sum()), "positions": labels.numel(), "padding": padding}

        clock, per_step, losses = count_trainer_steps(trainer, count)
        t0 = time.perf_counter()
        trainer.train()
    marks = clock.marks
    times = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    positions = sum(s["positions"] for s in per_step)
    return {"trained_tokens_per_s": steady_median([s["trained"] / t for s, t in zip(per_step, times)], opts["warmup"]),
            "tokens_per_s": steady_median([s["positions"] / t for s, t in zip(per_step, times)], opts["warmup"]),
            "padding_share": sum(s["padding"] for s in per_step) / max(1, positions),
            "step_peak_rss_gib": max(clock.peaks), "first_loss": losses[0] if losses else float("nan")}


def run_trl(base: str, data: Path, lora: bool, packing: bool, steps: int, warmup: int, bf16: bool) -> dict:
    opts = {"base": base, "data": str(data), "lora": lora, "packing": packing, "steps": steps, "warmup": warmup,
            "bf16": bf16}
    result, stderr = run_measured_child("TRL", __file__, json.dumps(opts))
    process_peak = result.pop("process_peak_rss_gib")  # kept last, after the warnings
    result["warnings"] = sorted({line.split("]")[-1].strip()[:160] for line in stderr.splitlines()
                                 if "packing" in line.lower() and "warn" in line.lower()})
    return {**result, "process_peak_rss_gib": process_peak}


# ------------------------------------------------------------------------------------------


def main() -> None:
    args = comparison_args(2, trl_child)
    if args is None:  # this process was TRL's side
        return
    from cputrain.hardware import detect

    hw = detect()
    bf16 = hw.has_fast_bf16
    steps, warmup, runs = (3, 1, 1) if args.quick else (8, 2, args.runs)
    work = Path(tempfile.mkdtemp(prefix="cputrain-sft-bench-"))
    cache_dir = str(work / "cache")
    data, template = work / "chat.jsonl", work / "marked_chatml.jinja"
    write_chats(data, 64 if args.quick else 320)
    template.write_text(MARKED_CHATML)
    base = make_base(work / "base", QUICK_ARCH if args.quick else ARCH_100M, "builtin:pydoc", cache_dir,
                     "bfloat16" if bf16 else "float32")
    sides = {
        "cputrain full": lambda: run_cputrain(str(work / "base"), data, template, False, steps, warmup, cache_dir),
        "TRL full, pad": lambda: run_trl(str(work / "base"), data, False, False, steps, warmup, bf16),
        "TRL full, packing": lambda: run_trl(str(work / "base"), data, False, True, steps, warmup, bf16),
        "cputrain LoRA": lambda: run_cputrain(str(work / "base"), data, template, True, steps, warmup, cache_dir),
        "TRL LoRA, pad": lambda: run_trl(str(work / "base"), data, True, False, steps, warmup, bf16),
    }
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(runs):  # alternated: every configuration once per round
        for name, run in sides.items():
            results[name].append(run())
            print(name, json.dumps(results[name][-1]), flush=True)

    print("\n".join(render(results, base["parameters"], bf16, steps, runs)))
    if not args.quick:
        write_block("sft", "\n".join(render(results, base["parameters"], bf16, steps, runs)))


def render(results: dict[str, list[dict]], parameters: int, bf16: bool, steps: int, runs: int) -> list[str]:
    """The docs block: medians over the runs of each configuration, ratios against TRL padding."""
    def med(name, key):
        return statistics.median(r[key] for r in results[name])

    lines = [machine_line(), "",
             f"{parameters / 1e6:.1f}M Llama ({'bf16' if bf16 else 'fp32'}), 320 chat conversations "
             "(answers 40–4,000 characters), seq_len 1,024, "
             f"{steps} steps, median of {runs} alternated runs (`python benchmarks/sft_and_dpo/sft.py`).", "",
             "| run | trained tokens/s | vs TRL pad | all tokens/s | padding share | step peak RSS (GiB) | first-step loss |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in results:
        peer = "TRL LoRA, pad" if "LoRA" in name else "TRL full, pad"
        ratio = med(name, "trained_tokens_per_s") / med(peer, "trained_tokens_per_s")
        lines.append(f"| {name} | {med(name, 'trained_tokens_per_s'):,.0f} | {ratio:.2f}× | "
                     f"{med(name, 'tokens_per_s'):,.0f} | {med(name, 'padding_share'):.1%} | "
                     f"{med(name, 'step_peak_rss_gib'):.2f} | {results[name][0]['first_loss']:.4f} |")
    said = sorted({w for r in results.get("TRL full, packing", []) for w in r.get("warnings", [])})
    if said:
        lines += ["", "TRL with packing=True said: " + "; ".join(said)]
    return lines


if __name__ == "__main__":
    main()
