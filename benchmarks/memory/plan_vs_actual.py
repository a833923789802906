"""Plan against measurement: `cputrain plan`'s per-rank figures vs memory.json of real runs.

Trains two model sizes (a tiny Llama and one of about 100M parameters) for 2 steps with 1 and
2 ranks under every strategy available here (single, ddp, fsdp; zero3 with and without
optimizer offload when DeepSpeed is installed), then writes a table of planned vs measured
parameter, gradient and optimizer bytes and peak RSS into docs/benchmarks/memory.md (block
`plan-vs-actual`).

    python benchmarks/memory/plan_vs_actual.py            # both sizes (a few minutes on 2 cores)
    python benchmarks/memory/plan_vs_actual.py --quick    # the tiny model only, to check the script
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from cputrain.plan.memory.compare import compare_run, markdown_table  # noqa: E402

SIZES = {
    "tiny": ["model.arch.hidden_size=64", "model.arch.intermediate_size=128", "model.arch.num_hidden_layers=2",
             "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=2", "model.tokenizer_vocab_size=512"],
    # about 100M parameters: 12 blocks of hidden 768 (85M) and a tied 16k × 768 embedding
    "100m": ["model.arch.hidden_size=768", "model.arch.intermediate_size=2048", "model.arch.num_hidden_layers=12",
             "model.arch.num_attention_heads=12", "model.arch.num_key_value_heads=12",
             "model.tokenizer_vocab_size=16384"],
}
COMMON = ["data.seq_len=32", "data.max_documents=600", "train.max_steps=2", "train.global_batch_size=4",
          "train.micro_batch_size=2", "train.eval_every=100", "train.eval_batches=1", "train.sample_tokens=0",
          "train.checkpoint_every=100", "hardware.precision=fp32", "hardware.threads=1"]


def strategies() -> list[tuple[str, int, bool]]:
    """(strategy, ranks, optimizer offload)"""
    cases = [("single", 1, False), ("ddp", 2, False), ("fsdp", 1, False), ("fsdp", 2, False)]
    if importlib.util.find_spec("deepspeed") is not None:
        cases += [("zero3", 1, False), ("zero3", 2, False), ("zero3", 2, True)]
    return cases


def run(size: str, strategy: str, ranks: int, offload: bool, out: Path, cache: Path) -> Path:
    run_dir = out / f"{size}-{strategy}-{ranks}{'-offload' if offload else ''}"
    cmd = [sys.executable, "-m", "cputrain", "train", *SIZES[size], *COMMON, f"parallel.strategy={strategy}",
           f"parallel.offload_optimizer={offload}", f"output_dir={run_dir}", f"data.cache_dir={cache}"]
    if ranks > 1:
        cmd += ["--nproc-per-node", str(ranks)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run(cmd, env={**env, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only (checks the script, not the figures)")
    ap.add_argument("--no-write", action="store_true", help="print the table; leave docs/benchmarks/memory.md alone")
    args = ap.parse_args()
    sizes = ["tiny"] if args.quick else ["tiny", "100m"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cputrain-plan-") as tmp:
        tmp = Path(tmp)
        for size in sizes:
            for strategy, ranks, offload in strategies():
                rows += compare_run(run(size, strategy, ranks, offload, tmp, tmp / "cache"))
                print(markdown_table(rows[-ranks:]).splitlines()[-1], flush=True)
    table = markdown_table(rows)
    worst = max(abs(r["rss_error"]) for r in rows)
    exact = all(r[f"plan_{k}"] == r[f"measured_{k}"] for r in rows for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    text = (f"{machine_line()}\n\n`python benchmarks/memory/plan_vs_actual.py`: 2 training steps, seq_len 32, micro-batch 2, "
            f"fp32. Parameter, gradient and optimizer bytes {'all match exactly' if exact else 'DIFFER (see table)'}; "
            f"largest peak-RSS error {worst:.1%} (tolerance ±15%). The loading peak is the high-water mark "
            f"up to the weights being in place (a from-scratch FSDP init computes the whole model once).\n\n{table}\n")
    print(text)
    if not args.no_write and not args.quick:
        write_block("plan-vs-actual", text)


if __name__ == "__main__":
    main()
