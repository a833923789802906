"""KTO and reward models: cputrain against TRL's KTOTrainer and RewardTrainer, side by side, with
LoRA. Writes blocks kto and reward_model of docs/benchmarks/sft-and-dpo.md.

    python benchmarks/sft_and_dpo/kto.py            # needs the sft-peer extra (trl); tens of minutes on 2 cores: run it alone
    python benchmarks/sft_and_dpo/kto.py --quick    # a tiny model and 3 steps, one run: checks the script only

The model: benchmarks/sft_and_dpo/dpo.py's (an ~88M-parameter Llama with random weights and a byte-level BPE
trained on builtin:pydoc). The feedback: a question on one of pydoc's help topics answered with
that topic's text (a thumbs-up) or another topic's (a thumbs-down), alternately, each answer cut
to a log-uniform length of 40 to 1,500 characters, plain strings (TRL's unpaired preference
format). The pairs of the reward model: benchmarks/sft_and_dpo/dpo.py's.

cputrain    `cputrain train` with LoRA (rank 16, every projection), 2 rows of 1,024 tokens a step
            (2 micro-batches of 1), the examples or pairs packed into them without cross-talk.
            kto: train.objective=kto, β 0.1, the reference's log-probabilities of every example
            and KL sequence computed once before the first step (the base, adapters off), the KL
            sequences run without gradients at each step. reward: train.objective=reward, each
            pair's prompt laid out once (data.shared_prompt's auto).
TRL         KTOTrainer and RewardTrainer as a user takes them (their CPU defaults: each
            micro-batch padded to its longest sequence, gradient checkpointing on; KTO's reference
            the base with the adapters disabled on every step, its KL sequences the batch's own
            completions rotated), as many examples or pairs per step as cputrain's 2 rows held on
            average (2 micro-batches), max_length 1,024.

Trained tokens/s (KTO) is the median over the steps after the first --warmup of (the answers'
tokens, which carry loss, in the step) ÷ (step time); a reward model's loss reads each sequence
whole, so its rate is every position the model ran on, padding included on both sides (cputrain's
at a row's end, TRL's to each micro-batch's longest). Examples/s or pairs/s: the same for the
step's items, the ratio against TRL.
Setup is each side's wall time before its first step. Step peak RSS is the high-water mark reset
before each step and read after it (cputrain's memory.json "training step peak"; a Trainer
callback on TRL's side). The first-step KTO loss is 0.5 on both sides (policy = reference, z = 0).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.sft_and_dpo.dpo import write_pairs  # noqa: E402
from benchmarks.runner.base_model import make_base  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.processes import comparison_args, run_measured_child  # noqa: E402
from benchmarks.runner.timing import steady_median  # noqa: E402
from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from benchmarks.sft_and_dpo.sft import ARCH_100M, QUICK_ARCH  # noqa: E402
from benchmarks.runner.hf_trainer_clock import count_trainer_steps  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402

SEQ_LEN, LR, SEED, BETA = 1024, 5e-5, 1337, 0.1
ROWS_PER_STEP = 2  # cputrain's global batch counts packed rows (several examples or pairs each)
ACCUM = 2  # micro-batches per step on both sides
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ITEM = {"kto": "examples", "reward": "pairs"}


def write_feedback(path: Path, n: int, seed: int = SEED) -> None:
    """`n` answers, alternately a topic's own text (label true) and another topic's (false), each
    cut to a log-uniform length of 40 to 1,500 characters."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = sorted(topics)

    def cut(text: str) -> str:
        return " " + " ".join(text.split())[: int(math.exp(rng.uniform(math.log(40), math.log(1500))))]

    with open(path, "w") as f:
        for i in range(n):
            name, desirable = names[i % len(names)], i % 2 == 0
            answer = topics[name] if desirable else topics[names[(i + 7) % len(names)]]
            f.write(json.dumps({"prompt": f"Question: what is {name} in Python?\nAnswer:", "completion": cut(answer),
                                "label": desirable}) + "\n")


# ------------------------------------------------------------------------------------------
# cputrain


def run_cputrain(objective: str, base: str, data: Path, steps: int, warmup: int, cache_dir: str) -> dict:
    fmt = "unpaired" if objective == "kto" else "preference"
    run = train_measured([
        f"model.name_or_path={base}", f"data.source={data}", f"data.format={fmt}", f"data.seq_len={SEQ_LEN}",
        "data.val_fraction=0", f"data.cache_dir={cache_dir}", f"train.objective={objective}", f"train.kto_beta={BETA}",
        f"train.max_steps={steps}", f"train.global_batch_size={ROWS_PER_STEP}",
        f"train.micro_batch_size={ROWS_PER_STEP // ACCUM}", f"train.lr={LR}", "train.warmup_steps=0",
        "train.log_every=1", "train.eval_every=100000", "train.checkpoint_every=100000",
        "train.sample_tokens=0", f"seed={SEED}", "model.lora.enabled=true", f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}", "model.lora.dropout=0.0", f"model.lora.target_modules=[{','.join(TARGETS)}]"])
    rows = [r for r in run.metrics_rows if "step_time_s" in r]
    wall_s, step_peak, process_peak = run.wall_s, run.step_peak["rss_gib"], run.process_peak_rss_gib
    # a reward model's loss reads every position (padding at a row's end included); KTO's the answers' tokens
    rate_key = "tokens_per_s" if objective == "reward" else "trained_tokens_per_s"
    step_s = sum(r["step_time_s"] for r in rows)
    return {"tokens_per_s": steady_median([r[rate_key] for r in rows], warmup),
            "items_per_s": steady_median([r["pairs_per_s"] for r in rows], warmup),
            "items_per_step": statistics.mean(r["pairs_per_s"] * r["step_time_s"] for r in rows),
            "setup_s": wall_s - step_s, "step_peak_rss_gib": step_peak, "process_peak_rss_gib": process_peak,
            "first_loss": rows[0]["loss"]}


# ------------------------------------------------------------------------------------------
# TRL (in its own process; prints one JSON line)


def trl_child(opts: dict) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    t_start = time.perf_counter()
    torch.set_num_threads(physical_cores())  # the threads cputrain's `auto` gives one rank
    tok = AutoTokenizer.from_pretrained(opts["base"])
    dtype = torch.bfloat16 if opts["bf16"] else torch.float32
    data = datasets.load_dataset("json", data_files=opts["data"], split="train")
    common = dict(max_steps=opts["steps"], per_device_train_batch_size=opts["micro_items"],
                  gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=0,
                  weight_decay=0.0, max_grad_norm=1.0, seed=SEED, use_cpu=True, bf16=opts["bf16"],
                  report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="steps",
                  logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, max_length=SEQ_LEN)
    with tempfile.TemporaryDirectory() as out:
        if opts["objective"] == "kto":
            from trl import KTOConfig, KTOTrainer

            model = AutoModelForCausalLM.from_pretrained(opts["base"], dtype=dtype, attn_implementation="sdpa")
            peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                                     bias="none", task_type="CAUSAL_LM")
            trainer = KTOTrainer(model=model, args=KTOConfig(output_dir=out, beta=BETA, **common),
                                 processing_class=tok, peft_config=peft_config, train_dataset=data)

            def count(batch) -> dict[str, int]:
                return {"trained": int(batch["completion_mask"].sum()), "positions": batch["input_ids"].numel(),
                        "padding": int((batch["attention_mask"] == 0).sum())}
        else:
            from trl import RewardConfig, RewardTrainer

            model = AutoModelForSequenceClassification.from_pretrained(
                opts["base"], dtype=dtype, attn_implementation="sdpa", num_labels=1, pad_token_id=tok.pad_token_id)
            peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                                     bias="none", task_type="SEQ_CLS")
            trainer = RewardTrainer(model=model, args=RewardConfig(output_dir=out, **common), processing_class=tok,
                                    peft_config=peft_config, train_dataset=data)

            def count(batch) -> dict[str, int]:  # every position the model ran on, as cputrain's tokens/s
                return {"trained": batch["input_ids"].numel(), "positions": batch["input_ids"].numel(),
                        "padding": int((batch["attention_mask"] == 0).sum())}

        clock, per_step, losses = count_trainer_steps(trainer, count)
        t0 = time.perf_counter()
        trainer.train()
    marks = clock.marks  # each step's end; the first step runs from t0
    times = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    return {"tokens_per_s": steady_median([s["trained"] / t for s, t in zip(per_step, times)], opts["warmup"]),
            "items_per_s": steady_median([opts["micro_items"] * ACCUM / t for t in times], opts["warmup"]),
            "items_per_step": opts["micro_items"] * ACCUM,
            "padding_share": sum(s["padding"] for s in per_step) / max(1, sum(s["positions"] for s in per_step)),
            "setup_s": t0 - t_start, "step_peak_rss_gib": max(clock.peaks),
            "first_loss": losses[0] if losses else float("nan")}


def run_trl(objective: str, base: str, data: Path, steps: int, warmup: int, bf16: bool, items_per_step: float) -> dict:
    # KTO needs 2 examples a micro-batch at least: with one, its KL term is the example's own reward
    least = 2 if objective == "kto" else 1
    opts = {"objective": objective, "base": base, "data": str(data), "steps": steps, "warmup": warmup, "bf16": bf16,
            "micro_items": max(least, math.ceil(items_per_step / ACCUM))}
    return run_measured_child("TRL", __file__, json.dumps(opts))[0]


# ------------------------------------------------------------------------------------------


def main() -> None:
    args = comparison_args(3, trl_child)
    if args is None:  # this process was TRL's side
        return
    from cputrain.hardware import detect

    bf16 = detect().has_fast_bf16
    steps, warmup, runs = (3, 1, 1) if args.quick else (6, 2, args.runs)
    n_items = 32 * steps  # more than either side takes in `steps` steps
    work = Path(tempfile.mkdtemp(prefix="cputrain-kto-bench-"))
    cache_dir = str(work / "cache")
    feedback, pairs = work / "feedback.jsonl", work / "pairs.jsonl"
    write_feedback(feedback, n_items)
    write_pairs(pairs, n_items)
    base = make_base(work / "base", QUICK_ARCH if args.quick else ARCH_100M, "builtin:pydoc", cache_dir,
                     "bfloat16" if bf16 else "float32")
    folder = str(work / "base")
    for objective, data in (("kto", feedback), ("reward", pairs)):
        results: dict[str, list[dict]] = {f"cputrain {objective}": [], f"TRL {objective}, default": []}
        for _ in range(runs):  # alternated: each side once per round
            ours = run_cputrain(objective, folder, data, steps, warmup, cache_dir)
            results[f"cputrain {objective}"].append(ours)
            print(f"cputrain {objective}", json.dumps(ours), flush=True)
            theirs = run_trl(objective, folder, data, steps, warmup, bf16,
                             statistics.median(r["items_per_step"] for r in results[f"cputrain {objective}"]))
            results[f"TRL {objective}, default"].append(theirs)
            print(f"TRL {objective}", json.dumps(theirs), flush=True)
        block = "\n".join(render(objective, results, base["parameters"], bf16, steps, runs, n_items))
        print(block)
        if not args.quick:
            write_block("kto" if objective == "kto" else "reward_model", block)


def render(objective: str, results: dict[str, list[dict]], parameters: int, bf16: bool, steps: int, runs: int,
           n_items: int) -> list[str]:
    """The docs block: medians over the runs of each side, the ratio against TRL's default."""
    def med(name, key):
        return statistics.median(r[key] for r in results[name] if key in r)

    item = ITEM[objective]
    what = (f"{n_items} feedback examples (answers 40–1,500 characters, half with a thumbs-up), β {BETA}"
            if objective == "kto" else f"{n_items} preference pairs (answers 40–1,500 characters)")
    tokens = "trained tokens/s" if objective == "kto" else "tokens/s (all positions)"
    trl = f"TRL {objective}, default"
    lines = [machine_line(), "",
             f"{parameters / 1e6:.1f}M Llama ({'bf16' if bf16 else 'fp32'}) with LoRA (rank {RANK}), {what}, "
             f"seq_len {SEQ_LEN}, {steps} steps, median of {runs} alternated runs (`python benchmarks/sft_and_dpo/kto.py`).", "",
             f"| run | {item} per step | {tokens} | {item}/s | vs TRL default | setup (s) | step peak RSS (GiB) | "
             "first-step loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in results:
        rate = med(name, "tokens_per_s")
        lines.append(f"| {name} | {med(name, 'items_per_step'):.1f} | {rate:,.0f} | {med(name, 'items_per_s'):.2f} | "
                     f"{med(name, 'items_per_s') / med(trl, 'items_per_s'):.2f}× | {med(name, 'setup_s'):.1f} | "
                     f"{med(name, 'step_peak_rss_gib'):.2f} | {results[name][0]['first_loss']:.4f} |")
    lines += ["", f"TRL's padding share (positions that were padding): {med(trl, 'padding_share'):.0%}; cputrain packs "
              f"the {item} into rows (no padding between them, only at a row's end)."]
    return lines


if __name__ == "__main__":
    main()
