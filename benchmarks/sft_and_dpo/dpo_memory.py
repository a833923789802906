"""Memory of full-weight DPO against supervised fine-tuning of the same model on rows of the same
size: DPO's step peak should be SFT's plus the stored reference log-probabilities, no second model
(the reference is computed once from the starting weights before training). Writes block
dpo_memory of docs/benchmarks/sft-and-dpo.md. Memory only: nothing here is timed, so a busy machine changes
no figure.

    python benchmarks/sft_and_dpo/dpo_memory.py            # ~88M Llama, bf16, 3 runs × --runs, a few minutes each
    python benchmarks/sft_and_dpo/dpo_memory.py --quick    # a tiny model, one run each: prints the block only

The model: benchmarks/sft_and_dpo/sft.py's ~100M Llama shape with random weights, saved with a byte-level BPE
trained on builtin:pydoc (benchmarks/runner/base_model.py). The data: benchmarks/sft_and_dpo/dpo.py's pairs (a
question on a pydoc topic, chosen its text, rejected another topic's, answers of 40 to 1,500
characters); SFT trains on the same questions with the chosen answer as the completion
(data.format=prompt_completion). Every run: full weights, rows of 1,024 tokens packed, 1 row a
micro-batch, 2 a step, AdamW, the same lr, the kernel (sdpa) and activation checkpointing (off)
and compile (off) pinned so that no `auto` decides differently for the two objectives. DPO runs
with the prompt laid out once per pair (data.shared_prompt=true, its auto) and twice (false).

Step peak RSS: memory.json's "training step peak" (the high-water mark reset before each step
and read after it, the largest over the steps); process peak: the child's whole life (wait4),
which for DPO includes the reference pass. Reference: the bytes of the reference table file beside
the token cache (reference-<key>.safetensors) and in memory (4 bytes a sequence, 2 a pair).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.sft_and_dpo.dpo import BETA, SEED, SEQ_LEN, write_pairs  # noqa: E402
from benchmarks.runner.base_model import make_base  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from benchmarks.sft_and_dpo.sft import ARCH_100M, QUICK_ARCH  # noqa: E402

LR = 5e-5
ROWS_PER_STEP, MICRO = 2, 1  # the same tokens per micro-batch on both sides: one packed row
GIB = 2**30


def write_completions(pairs: Path, path: Path) -> None:
    """SFT's records: each pair's prompt with its chosen answer as the completion."""
    with open(pairs) as src, open(path, "w") as out:
        for line in src:
            pair = json.loads(line)
            out.write(json.dumps({"prompt": pair["prompt"], "completion": pair["chosen"]}) + "\n")


def run(base: str, data: Path, cache_dir: Path, steps: int, precision: str, objective: str,
        shared_prompt: bool | None = None) -> dict:
    """One `cputrain train` in a fresh process: its step peak, process peak and, for DPO, the
    stored reference's bytes (the cache folder is the run's own, so the one file is its)."""
    settings = [f"model.name_or_path={base}", f"data.source={data}", f"data.seq_len={SEQ_LEN}",
                "data.val_fraction=0", f"data.cache_dir={cache_dir}", f"train.max_steps={steps}",
                f"train.global_batch_size={ROWS_PER_STEP}", f"train.micro_batch_size={MICRO}", f"train.lr={LR}",
                "train.warmup_steps=0", "train.log_every=1", "train.eval_every=100000",
                "train.checkpoint_every=100000", "train.sample_tokens=0", f"hardware.precision={precision}",
                "model.attn_implementation=sdpa", "model.activation_checkpointing=false", "model.compile=false",
                f"seed={SEED}"]
    if objective == "dpo":
        settings += ["data.format=preference", "train.objective=dpo", f"train.dpo_beta={BETA}",
                     f"data.shared_prompt={str(shared_prompt).lower()}"]
    else:
        settings += ["data.format=prompt_completion"]
    run = train_measured(settings, f"cputrain {objective}", prefix="cputrain-dpo-memory-")
    peak, process_peak = run.step_peak, run.process_peak_rss_gib
    stats = json.loads(next(cache_dir.glob("packed/*/stats.json")).read_text())
    files = list(cache_dir.glob("packed/*/reference-*.safetensors"))
    pairs = stats.get("train_pairs", 0) + stats.get("val_pairs", 0)
    return {"step_peak_rss_gib": peak["rss_gib"], "process_peak_rss_gib": process_peak,
            "state_gib": (peak["param_bytes"] + peak["grad_bytes"] + peak["optimizer_bytes"]) / GIB,
            "param_gib": peak["param_bytes"] / GIB,
            "reference_file_bytes": sum(f.stat().st_size for f in files),
            "reference_memory_bytes": 8 * pairs if objective == "dpo" else 0,
            "pairs": pairs, "trained_tokens": stats["trained_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    from cputrain.hardware import detect

    bf16 = detect().has_fast_bf16
    precision = "bf16" if bf16 else "fp32"
    steps, runs = (2, 1) if args.quick else (4, args.runs)
    work = Path(tempfile.mkdtemp(prefix="cputrain-dpo-memory-"))
    pairs, completions = work / "pairs.jsonl", work / "completions.jsonl"
    write_pairs(pairs, 64)  # more than 4 steps of 2 rows take
    write_completions(pairs, completions)
    base = make_base(work / "base", QUICK_ARCH if args.quick else ARCH_100M, "builtin:pydoc", str(work / "tok"),
                     "bfloat16" if bf16 else "float32")
    folder = str(work / "base")
    sides = {
        "SFT (prompt/completion)": lambda n: run(folder, completions, work / f"sft-{n}", steps, precision, "sft"),
        "DPO, shared prompt": lambda n: run(folder, pairs, work / f"dpo-shared-{n}", steps, precision, "dpo", True),
        "DPO, two whole sequences": lambda n: run(folder, pairs, work / f"dpo-whole-{n}", steps, precision, "dpo",
                                                  False),
    }
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for n in range(runs):  # alternated: every configuration once per round
        for name, side in sides.items():
            results[name].append(side(n))
            print(name, json.dumps(results[name][-1]), flush=True)
    block = "\n".join(render(results, base["parameters"], precision, steps, runs))
    print(block)
    if not args.quick:
        write_block("dpo_memory", block)


def render(results: dict[str, list[dict]], parameters: int, precision: str, steps: int, runs: int) -> list[str]:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    sft = med("SFT (prompt/completion)", "step_peak_rss_gib")
    # RSS of one configuration moves between fresh processes (the allocator's pages, the OS): an
    # excess smaller than that spread is not told apart from none, and the table says so
    spread = max(max(r["step_peak_rss_gib"] for r in rs) - min(r["step_peak_rss_gib"] for r in rs)
                 for rs in results.values())
    lines = [machine_line(), "",
             f"{parameters / 1e6:.1f}M Llama, full weights, {precision}, rows of {SEQ_LEN} tokens packed, "
             f"{MICRO} row a micro-batch and {ROWS_PER_STEP} a step, {steps} steps, sdpa, no activation "
             f"checkpointing, no compile; median of {runs} alternated runs, each in a fresh process "
             "(`python benchmarks/sft_and_dpo/dpo_memory.py`).", "",
             "| run | step peak RSS (GiB) | vs SFT (MiB) | parameters + gradients + AdamW (GiB) | "
             "process peak RSS (GiB) | reference stored (bytes, file / in memory) | target |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in results:
        peak = med(name, "step_peak_rss_gib")
        reference = (f"{med(name, 'reference_file_bytes'):,.0f} / {med(name, 'reference_memory_bytes'):,.0f} "
                     f"({med(name, 'pairs'):.0f} pairs)" if name.startswith("DPO") else "—")
        if name.startswith("DPO"):  # DPO's step peak ≤ SFT's + the stored reference (no second model)
            allowed = sft + med(name, "reference_memory_bytes") / GIB
            excess_mib = (peak - allowed) * 1024
            target = ("met" if excess_mib <= 0 else
                      f"within the spread (+{excess_mib:.1f} MiB)" if excess_mib <= spread * 1024 else
                      f"not met (+{excess_mib:.1f} MiB)")
        else:
            target = "—"
        lines.append(f"| {name} | {peak:.3f} | {(peak - sft) * 1024:+.1f} | {med(name, 'state_gib'):.3f} | "
                     f"{med(name, 'process_peak_rss_gib'):.3f} | {reference} | {target} |")
    lines += ["", "Target: full-weight DPO's step peak ≤ SFT's step peak + the stored reference log-probabilities "
              f"(no second model in memory). The largest spread of one configuration's step peak over its {runs} "
              f"runs: {spread * 1024:.1f} MiB. A second copy of the weights as training holds them (a reference model "
              f"in memory) would add {med('SFT (prompt/completion)', 'param_gib') * 1024:,.0f} MiB."]
    return lines


if __name__ == "__main__":
    main()
