"""How far do gradients reduced in bf16 move a run from gradients reduced in fp32?

    python benchmarks/network/reduce_dtype_drift.py [--steps 200] [--ranks 2,8]

FSDP runs of the demo's model shape (bf16 compute, fp32 weights and optimizer) for `--steps`
steps at each rank count, with parallel.reduce_dtype=fp32 and =bf16, on this machine (ranks of
one thread each; several ranks share a core where there are more ranks than cores: the losses do
not depend on it). Each pair shares everything else: data, seed, global batch.

The yardstick is the drift a run has anyway: the same fp32-reduced run on 2 ranks and on 8 sums
its gradients in another order, and bf16 compute rounds differently with them. bf16 reduction is
safe where its drift from the fp32-reduced run stays within that. Reported per rank count: the
largest |Δloss| over the steps, the mean |Δloss| over the last 50 steps, the final validation loss
of each. Writes block `reduce_dtype_drift` of docs/benchmarks/network.md; parallel.reduce_dtype=auto
follows it (docs/reference/auto.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

DEMO_SHAPE = ["model.arch.model_type=llama", "model.arch.hidden_size=256", "model.arch.intermediate_size=688",
              "model.arch.num_hidden_layers=4", "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=4",
              "model.arch.max_position_embeddings=1024", "model.arch.tie_word_embeddings=true",
              "model.tokenizer_vocab_size=4096"]


def settings(steps: int, cache: Path) -> list[str]:
    return [*DEMO_SHAPE, "data.seq_len=128", f"data.cache_dir={cache}", f"train.max_steps={steps}",
            "train.global_batch_size=16", "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=20",
            "train.log_every=1", f"train.eval_every={steps}", "train.eval_batches=8", f"train.checkpoint_every={steps}",
            "train.sample_tokens=0", "hardware.precision=bf16", "hardware.threads=1", "hardware.allocator=system",
            "model.attn_implementation=sdpa", "model.compile=false", "parallel.strategy=fsdp",
            "parallel.layout=full_shard"]


def train(ranks: int, reduce_dtype: str, steps: int, cache: Path, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    cmd = [sys.executable, "-m", "cputrain", "train", *settings(steps, cache), f"parallel.reduce_dtype={reduce_dtype}",
           f"output_dir={out}", "--nproc-per-node", str(ranks)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"loss": {r["step"]: r["loss"] for r in rows if "loss" in r},
            "val_loss": next(r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None)}


def drift(a: dict, b: dict, last: int = 50) -> tuple[float, float]:
    steps = sorted(set(a["loss"]) & set(b["loss"]))
    deltas = [abs(a["loss"][s] - b["loss"][s]) for s in steps]
    return max(deltas), sum(deltas[-last:]) / len(deltas[-last:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", default="2,8")
    args = parser.parse_args()
    rank_counts = [int(n) for n in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="cputrain-drift-") as tmp:
        tmp = Path(tmp)
        runs = {(n, dtype): train(n, dtype, args.steps, tmp / "cache", tmp / f"{n}-{dtype}")
                for n in rank_counts for dtype in ("fp32", "bf16")}
    lines = [f"{machine_line()}", "",
             f"`python benchmarks/network/reduce_dtype_drift.py --steps {args.steps} --ranks {args.ranks}`: FSDP, the demo's "
             "model shape (~4.5M parameters) in bf16 compute with fp32 weights and AdamW, seq 128, 16 sequences a "
             "step, the same data and seed in every run.", "",
             "| runs compared | largest \\|Δloss\\| | mean \\|Δloss\\|, last 50 steps | final val loss |",
             "| --- | ---: | ---: | --- |"]
    for n in rank_counts:
        worst, late = drift(runs[(n, "fp32")], runs[(n, "bf16")])
        lines.append(f"| {n} ranks: bf16 reduce vs fp32 reduce | {worst:.4f} | {late:.4f} | "
                     f"{runs[(n, 'bf16')]['val_loss']:.4f} vs {runs[(n, 'fp32')]['val_loss']:.4f} |")
    if len(rank_counts) > 1:
        a, b = rank_counts[0], rank_counts[-1]
        worst, late = drift(runs[(a, "fp32")], runs[(b, "fp32")])
        lines.append(f"| fp32 reduce: {a} ranks vs {b} (the drift a run has anyway) | {worst:.4f} | {late:.4f} | "
                     f"{runs[(a, 'fp32')]['val_loss']:.4f} vs {runs[(b, 'fp32')]['val_loss']:.4f} |")
    write_block("reduce_dtype_drift", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
