"""Preference tuning (DPO): cputrain against TRL's DPOTrainer, side by side, LoRA and full
weights. Writes block dpo of docs/benchmarks/sft-and-dpo.md.

    python benchmarks/sft_and_dpo/dpo.py            # needs the sft-peer extra (trl); ~20 min on 2 cores: run it alone
    python benchmarks/sft_and_dpo/dpo.py --quick    # a tiny model and 3 steps, one run: checks the script only

The model: a ~100M-parameter Llama (benchmarks/sft_and_dpo/sft.py's shape) with random weights, saved as a
Hugging Face folder with a byte-level BPE trained on builtin:pydoc. The pairs: a question on one
of pydoc's help topics, the chosen answer that topic's text and the rejected one another topic's,
each cut to a log-uniform length of 40 to 1,500 characters (so the two answers of a pair differ in
length, as real pairs do), plain strings (TRL's "standard" preference format).

cputrain    `cputrain train`, data.format=preference, train.objective=dpo, β 0.1: the pairs packed
            into rows of 1,024 tokens without cross-talk, 2 rows per step (2 micro-batches of 1).
            The reference log-probs computed once before the first step (train.dpo_reference=
            precompute, the default: with LoRA the base with the adapters off, with full weights
            the starting weights; no second model in memory); `LoRA, live` runs the base with the
            adapters off on every micro-batch instead (train.dpo_reference=live).
TRL         DPOTrainer, the same β, as many pairs per step as cputrain's 2 rows held on average
            (P = 2 × ceil(P/2): 2 micro-batches), max_length 1,024, so both sides take an
            optimizer step per as many pairs:
            `default` is its CPU default (each micro-batch's sequences padded to its longest,
            the reference model run on every step: with LoRA the adapters disabled, with full
            weights a second copy of the model); `precompute` sets precompute_ref_log_probs=True
            (a pass over the pairs before training, then no reference forward in the steps).

Trained tokens/s is the median over the steps after the first --warmup of (answer tokens that
carry loss in the step) ÷ (step time); pairs/s the same for the step's pairs (cputrain's: its
trained tokens/s ÷ the trained tokens of a pair in its token cache, stats.json). Setup is each
side's wall time before its first step (model load, tokenizing, the reference pass where there
is one). Step peak RSS is the high-water mark reset before each step and read after it
(cputrain's memory.json "training step peak"; a Trainer callback on TRL's side). The first-step
loss is ln 2 = 0.6931 on both sides (the policy is its reference before any update).
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
ROWS_PER_STEP = 2  # cputrain's global batch counts packed rows (several pairs each)
ACCUM = 2  # micro-batches per step on both sides
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_pairs(path: Path, n: int, seed: int = SEED) -> None:
    """`n` pairs: chosen = the topic's own text, rejected = the next topic's, each cut to a
    log-uniform length of 40 to 1,500 characters."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = sorted(topics)

    def cut(text: str) -> str:
        return " " + " ".join(text.split())[: int(math.exp(rng.uniform(math.log(40), math.log(1500))))]

    with open(path, "w") as f:
        for i in range(n):
            name, other = names[i % len(names)], names[(i + 7) % len(names)]
            f.write(json.dumps({"prompt": f"Question: what is {name} in Python?\nAnswer:",
                                "chosen": cut(topics[name]), "rejected": cut(topics[other])}) + "\n")


# ------------------------------------------------------------------------------------------
# cputrain


def run_cputrain(base: str, data: Path, lora: bool, steps: int, warmup: int, cache_dir: str,
                 reference: str = "precompute") -> dict:
    overrides = [f"model.name_or_path={base}",
                 f"data.source={data}", "data.format=preference", f"data.seq_len={SEQ_LEN}", "data.val_fraction=0",
                 f"data.cache_dir={cache_dir}", "train.objective=dpo", f"train.dpo_beta={BETA}",
                 f"train.dpo_reference={reference}", f"train.max_steps={steps}",
                 f"train.global_batch_size={ROWS_PER_STEP}", f"train.micro_batch_size={ROWS_PER_STEP // ACCUM}",
                 f"train.lr={LR}", "train.warmup_steps=0", "train.log_every=1",
                 "train.eval_every=100000", "train.checkpoint_every=100000", "train.sample_tokens=0", f"seed={SEED}"]
    if lora:
        overrides += ["model.lora.enabled=true", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
                      "model.lora.dropout=0.0", f"model.lora.target_modules=[{','.join(TARGETS)}]"]
    run = train_measured(overrides)
    rows = [r for r in run.metrics_rows if "step_time_s" in r]
    wall_s, step_peak, process_peak = run.wall_s, run.step_peak["rss_gib"], run.process_peak_rss_gib
    stats = json.loads(next(Path(cache_dir).glob("packed/*/stats.json")).read_text())
    trained_per_pair = stats["trained_tokens"] / stats["train_pairs"]
    step_s = sum(r["step_time_s"] for r in rows)
    rate = steady_median([r["trained_tokens_per_s"] for r in rows], warmup)
    return {"trained_tokens_per_s": rate, "pairs_per_s": rate / trained_per_pair,
            "pairs_per_step": statistics.mean(r["trained_tokens_per_s"] * r["step_time_s"] for r in rows)
            / trained_per_pair,
            "setup_s": wall_s - step_s, "step_peak_rss_gib": step_peak, "process_peak_rss_gib": process_peak,
            "first_loss": rows[0]["loss"]}


# ------------------------------------------------------------------------------------------
# TRL (in its own process; prints one JSON line)


def trl_child(opts: dict) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    t_start = time.perf_counter()
    torch.set_num_threads(physical_cores())  # the threads cputrain's `auto` gives one rank
    tok = AutoTokenizer.from_pretrained(opts["base"])
    dtype = torch.bfloat16 if opts["bf16"] and opts["lora"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(opts["base"], dtype=dtype, attn_implementation="sdpa")
    peft_config = None
    if opts["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                                 task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            output_dir=out, max_steps=opts["steps"], per_device_train_batch_size=opts["micro_pairs"],
            gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, seed=SEED, use_cpu=True, bf16=opts["bf16"], report_to="none",
            save_strategy="no", eval_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
            dataloader_num_workers=0, beta=BETA, max_length=SEQ_LEN, precompute_ref_log_probs=opts["precompute"],
        )
        trainer = DPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft_config,
                             train_dataset=datasets.load_dataset("json", data_files=opts["data"], split="train"))

        def count(batch) -> dict[str, int]:
            return {"trained": int(batch["completion_mask"].sum()), "positions": batch["input_ids"].numel(),
                    "padding": int((batch["attention_mask"] == 0).sum())}

        clock, per_step, losses = count_trainer_steps(trainer, count)
        # the reference pass (precompute) runs inside train(), before the first step's clock starts
        t0 = time.perf_counter()
        trainer.train()
    marks = clock.marks  # each step's end; the first step runs from t0
    times = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    first_step_s = times[0]
    # TRL's precompute pass runs at the start of train(): counted as setup, not as the first step
    if opts["precompute"] and len(times) > 1:
        first_step_s = statistics.median(times[1:])
    setup_s = (t0 - t_start) + times[0] - first_step_s
    return {"trained_tokens_per_s": steady_median([s["trained"] / t for s, t in zip(per_step, times)], opts["warmup"]),
            "pairs_per_s": steady_median([opts["micro_pairs"] * ACCUM / t for t in times], opts["warmup"]),
            "pairs_per_step": opts["micro_pairs"] * ACCUM,
            "padding_share": sum(s["padding"] for s in per_step) / max(1, sum(s["positions"] for s in per_step)),
            "setup_s": setup_s, "step_peak_rss_gib": max(clock.peaks),
            "first_loss": losses[0] if losses else float("nan")}


def run_trl(base: str, data: Path, lora: bool, precompute: bool, steps: int, warmup: int, bf16: bool,
            pairs_per_step: float) -> dict:
    opts = {"base": base, "data": str(data), "lora": lora, "precompute": precompute, "steps": steps,
            "warmup": warmup, "bf16": bf16, "micro_pairs": max(1, math.ceil(pairs_per_step / ACCUM))}
    return run_measured_child("TRL", __file__, json.dumps(opts))[0]


# ------------------------------------------------------------------------------------------


def main() -> None:
    args = comparison_args(2, trl_child)
    if args is None:  # this process was TRL's side
        return
    from cputrain.hardware import detect

    bf16 = detect().has_fast_bf16
    steps, warmup, runs = (3, 1, 1) if args.quick else (6, 2, args.runs)
    n_pairs = 16 * steps  # more than either side takes in `steps` steps
    work = Path(tempfile.mkdtemp(prefix="cputrain-dpo-bench-"))
    cache_dir = str(work / "cache")
    data = work / "pairs.jsonl"
    write_pairs(data, n_pairs)
    base = make_base(work / "base", QUICK_ARCH if args.quick else ARCH_100M, "builtin:pydoc", cache_dir,
                     "bfloat16" if bf16 else "float32")
    folder = str(work / "base")
    results: dict[str, list[dict]] = {}

    def pairs_per_step() -> float:  # what cputrain's rows held: TRL's steps take as many pairs
        return statistics.median(r["pairs_per_step"] for r in results["cputrain LoRA"])

    sides = {
        "cputrain LoRA": lambda: run_cputrain(folder, data, True, steps, warmup, cache_dir),
        "cputrain LoRA, live": lambda: run_cputrain(folder, data, True, steps, warmup, cache_dir, "live"),
        "TRL LoRA, default": lambda: run_trl(folder, data, True, False, steps, warmup, bf16, pairs_per_step()),
        "TRL LoRA, precompute": lambda: run_trl(folder, data, True, True, steps, warmup, bf16, pairs_per_step()),
        "cputrain full": lambda: run_cputrain(folder, data, False, steps, warmup, cache_dir),
        "TRL full, default": lambda: run_trl(folder, data, False, False, steps, warmup, bf16, pairs_per_step()),
        "TRL full, precompute": lambda: run_trl(folder, data, False, True, steps, warmup, bf16, pairs_per_step()),
    }
    results.update({name: [] for name in sides})
    for _ in range(runs):  # alternated: every configuration once per round
        for name, run in sides.items():
            results[name].append(run())
            print(name, json.dumps(results[name][-1]), flush=True)

    block = "\n".join(render(results, base["parameters"], bf16, steps, runs, n_pairs))
    print(block)
    if not args.quick:
        write_block("dpo", block)


def render(results: dict[str, list[dict]], parameters: int, bf16: bool, steps: int, runs: int,
           n_pairs: int) -> list[str]:
    """The docs block: medians over the runs of each configuration, ratios against each TRL way."""
    def med(name, key):
        return statistics.median(r[key] for r in results[name] if key in r)

    lines = [machine_line(), "",
             f"{parameters / 1e6:.1f}M Llama ({'bf16' if bf16 else 'fp32'}), {n_pairs} preference pairs (answers "
             f"40–1,500 characters), β {BETA}, seq_len {SEQ_LEN}, {steps} steps, "
             f"median of {runs} alternated runs (`python benchmarks/sft_and_dpo/dpo.py`).", "",
             "| run | pairs per step | trained tokens/s | pairs/s | vs TRL default | vs TRL precompute | setup (s) | "
             "step peak RSS (GiB) | first-step loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in results:
        kind = "LoRA" if "LoRA" in name else "full"
        rate = med(name, "trained_tokens_per_s")
        ratios = [rate / med(f"TRL {kind}, {way}", "trained_tokens_per_s") for way in ("default", "precompute")]
        lines.append(f"| {name} | {med(name, 'pairs_per_step'):.1f} | {rate:,.0f} | {med(name, 'pairs_per_s'):.2f} | {ratios[0]:.2f}× | "
                     f"{ratios[1]:.2f}× | {med(name, 'setup_s'):.1f} | {med(name, 'step_peak_rss_gib'):.2f} | "
                     f"{results[name][0]['first_loss']:.4f} |")
    padding = [med(n, "padding_share") for n in results if n.startswith("TRL")]
    lines += ["", f"TRL's padding share (positions that were padding): {min(padding):.0%}–{max(padding):.0%}; "
              "cputrain packs pairs into rows (no padding between them, only at a row's end)."]
    return lines


if __name__ == "__main__":
    main()
