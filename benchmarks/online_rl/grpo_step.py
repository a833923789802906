"""A GRPO step of cputrain against TRL's GRPOTrainer (plain generate, TRL's defaults otherwise) at
the demo's size and at ~100M, on the same model, prompts, generations and lengths. Writes block
`grpo_step` of docs/benchmarks/online-rl.md.

    python benchmarks/online_rl/grpo_step.py            # needs trl (the sft-peer extra); tens of minutes on 2 cores: run it alone
    python benchmarks/online_rl/grpo_step.py --block grpo_step_fp32   # a CPU without bf16 units: its fp32 rows
    python benchmarks/online_rl/grpo_step.py --quick    # a tiny model, 2 × 4 completions of 8 tokens, 3 steps, one run: prints the block only
    python benchmarks/online_rl/grpo_step.py --quick --doc /tmp/b   # … and writes it into /tmp/b/online-rl.md

The models: Llamas with random weights built from their configs (benchmarks/runner/base_model.py,
its byte-level BPE trained on builtin:pydoc): the demo's shape (configs/demo.yaml) and a ~100M one
(12 layers, hidden 768). The prompts: one plain-string question per pydoc help topic. A step: 8
prompts × 8 generations (64 completions, TRL's per_device_train_batch_size=64, one micro-batch),
up to 48 new tokens each at temperature 1, the reward a format regex (the same function on both
sides), loss dapo (TRL's default), β 0, full weights, one process on every physical core.

Precision: bf16 and fp32, each on both sides. bf16 is the default of both: TRL's GRPOConfig sets
bf16=True (on a CPU with use_cpu=True, autocast over fp32 weights), and cputrain's
hardware.precision=auto takes bf16 on bf16 units. bf16 rows run only where the CPU has them
(AVX512-BF16 or AMX); elsewhere bf16 is emulated and both sides would time the emulation.

cputrain    `cputrain train train.objective=grpo`, the rollout from cputrain.rollouts.sample().
TRL         GRPOTrainer with use_vllm=False (model.generate()), gradient checkpointing off as
            cputrain's run has it (TRL's default turns it on; on a random-weight model the
            recompute is pure cost), everything else TRL's default.

Each side's step time is the median over the steps after the first --warmup; the runs alternate
sides (the order swapped each run) and the figure is the median over --runs runs. Random weights
rarely sample EOS, so both sides decode close to the full 48 tokens a completion; each side's mean
completion length is printed beside its time.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import block_parser, command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.machine import machine_line, physical_cores  # noqa: E402

PROMPTS, GENERATIONS, NEW_TOKENS = 8, 8, 48
ARCH_100M = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 12, "tie_word_embeddings": False}
QUICK_ARCH = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": True}
REGEX = "^ [A-Za-z]"  # the reward: a completion opening with a space and a letter
TARGETS = {"demo": 3.0, "~100M": 2.0, "quick": None}  # the issue's, cputrain's step speed over TRL's


def demo_arch() -> dict:
    import yaml

    model = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["model"]
    return {k: v for k, v in model["arch"].items() if k != "model_type"}


def write_prompts(path: Path) -> None:
    from pydoc_data.topics import topics

    with open(path, "w") as f:
        for name in sorted(topics):
            f.write(json.dumps({"prompt": f"Question: what is {name} in Python?\nAnswer:"}) + "\n")


def run_cputrain(base: Path, prompts: Path, cache: str, steps: int, warmup: int, threads: int, shape: tuple,
                 precision: str) -> dict:
    n_prompts, generations, new_tokens = shape
    run = train_measured([
        f"model.name_or_path={base}", f"data.source={prompts}", "data.format=prompt", f"data.cache_dir={cache}",
        "data.seq_len=128", "data.val_fraction=0", "train.objective=grpo", f'train.rewards=["regex:{REGEX}"]',
        f"train.num_generations={generations}", f"train.max_completion_length={new_tokens}",
        f"train.global_batch_size={n_prompts * generations}", f"train.micro_batch_size={n_prompts * generations}",
        f"train.max_steps={steps}", "train.log_every=1", "train.warmup_steps=0", "train.lr=1e-6",
        "train.checkpoint_every=100000", "train.sample_tokens=0", f"hardware.precision={precision}",
        f"hardware.threads={threads}", "model.compile=false"], "cputrain grpo")
    rows = run.metrics_rows[warmup:]
    return {"step_s": statistics.median(r["step_time_s"] for r in rows),
            "mean_length": statistics.mean(r["completions/mean_length"] for r in rows),
            "rollout_share": statistics.median(r["rollout/time_s"] / r["step_time_s"] for r in rows),
            # groups whose rewards are all equal: advantage 0, left out of cputrain's training rows
            "zero_std": statistics.mean(r["frac_reward_zero_std"] for r in rows)}


def _trl_reward(prompts, completions, **kwargs):
    import re

    return [float(re.match(REGEX, c) is not None) for c in completions]


def run_trl(base: Path, prompts: Path, steps: int, warmup: int, threads: int, shape: tuple, precision: str) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.runner.hf_trainer_clock import trainer_step_clock

    n_prompts, generations, new_tokens = shape
    torch.set_num_threads(threads)
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(base)
    lengths = []

    def reward(prompts, completions, completion_ids, **kwargs):
        lengths.append(statistics.mean(len(c) for c in completion_ids))
        return _trl_reward(prompts, completions)

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, report_to=[], use_cpu=True, max_steps=steps, logging_steps=1,
                          per_device_train_batch_size=n_prompts * generations, num_generations=generations,
                          max_completion_length=new_tokens, learning_rate=1e-6, save_strategy="no",
                          gradient_checkpointing=False, bf16=precision == "bf16", use_vllm=False)
        clock = trainer_step_clock()
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                              reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(records), callbacks=[clock])
        start = time.perf_counter()
        trainer.train()
        zero_std = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    marks = [start, *clock.marks]
    steps_s = [b - a for a, b in zip(marks[:-1], marks[1:])][warmup:]
    return {"step_s": statistics.median(steps_s), "mean_length": statistics.mean(lengths[warmup:] or lengths),
            "zero_std": statistics.mean(zero_std[warmup:] or zero_std or [float("nan")])}


def main() -> None:
    parser = block_parser("online-rl.md", 3, quick="tiny model, 3 steps, one run: checks the script only")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--block", default="grpo_step", choices=("grpo_step", "grpo_step_fp32"),
                        help="the block written: grpo_step_fp32 holds a machine without bf16 units (fp32 only)")
    args = parser.parse_args()
    from benchmarks.runner.base_model import make_base
    from cputrain.hardware import detect

    threads = physical_cores()
    precisions = ["bf16", "fp32"] if detect().has_fast_bf16 or args.quick else ["fp32"]
    sizes = {"quick": QUICK_ARCH} if args.quick else {"demo": demo_arch(), "~100M": ARCH_100M}
    steps, warmup, runs = (3, 1, 1) if args.quick else (args.steps, args.warmup, args.runs)
    shape = (2, 4, 8) if args.quick else (PROMPTS, GENERATIONS, NEW_TOKENS)
    cells = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = str(tmp / "cache")
        prompts = tmp / "prompts.jsonl"
        write_prompts(prompts)
        for size, arch in sizes.items():
            base = tmp / size.strip("~")
            info = make_base(base, arch, "builtin:pydoc", cache, "float32")
            for precision in precisions:
                ours, theirs = [], []
                for r in range(runs):  # alternated, the order swapped each run
                    for side in (("cputrain", "trl") if r % 2 == 0 else ("trl", "cputrain")):
                        if side == "cputrain":
                            ours.append(run_cputrain(base, prompts, cache, steps, warmup, threads, shape, precision))
                        else:
                            theirs.append(run_trl(base, prompts, steps, warmup, threads, shape, precision))
                cells[size, precision] = {"parameters": info["parameters"], **{
                    f"{name}_{key}": statistics.median(run[key] for run in side)
                    for name, side in (("ours", ours), ("trl", theirs)) for key in side[0]}}
                print(size, precision, cells[size, precision], flush=True)
    block = "\n".join(render(cells, threads, runs, steps, warmup, shape))
    print_and_write_block(args.block, block, args.doc, args.quick)


def render(cells: dict, threads: int, runs: int, steps: int, warmup: int, shape: tuple) -> list[str]:
    n_prompts, generations, new_tokens = shape
    lines = [machine_line(), "",
             f"{n_prompts} prompts × {generations} generations, up to {new_tokens} new tokens, full weights, "
             f"dapo, β 0, {threads} thread(s), the same precision on both sides (bf16: autocast over fp32 weights, "
             f"TRL's default bf16=True and cputrain's auto choice on bf16 units); each side's median step time over steps {warmup + 1}–{steps}, the "
             f"median of {runs} alternated runs (`{command_as_run()}`).", "",
             "| model | precision | cputrain s/step | rollout share | TRL GRPOTrainer s/step | × | target | "
             "mean length (ours, TRL) | groups of equal rewards (ours, TRL) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (size, precision), c in cells.items():
        target = TARGETS.get(size)
        lines.append(f"| {size} ({c['parameters'] / 1e6:.1f}M) | {precision} | {c['ours_step_s']:.2f} | {c['ours_rollout_share']:.0%} | "
                     f"{c['trl_step_s']:.2f} | {c['trl_step_s'] / c['ours_step_s']:.2f}× | "
                     f"{f'≥ {target:g}×' if target else '—'} | {c['ours_mean_length']:.1f}, {c['trl_mean_length']:.1f} | "
                     f"{c['ours_zero_std']:.0%}, {c['trl_zero_std']:.0%} |")
    return lines


if __name__ == "__main__":
    main()
