"""Strategies side by side: useful tokens/s and peak RSS per rank for ddp, fsdp and DeepSpeed
ZeRO-3 without offload, with optimizer offload, and with optimizer + parameter offload (the
recipe's DeepSpeed file, configs/deepspeed/zero3-offload.json, unchanged).

Same model (a ~34M-parameter Llama, like the reference recipe's), same data, same global batch,
in bf16 (where the CPU has bf16 units) and fp32, 2 ranks each (one per physical core). Writes its
table into docs/benchmarks/network.md (block `strategies`).

    python benchmarks/network/strategies.py            # the figures (run on a quiet machine)
    python benchmarks/network/strategies.py --quick    # tiny model, 3 steps: checks the script only
"""

from __future__ import annotations

import argparse
import importlib.util
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
from benchmarks.network.model_sizes import MODEL_34M, MODEL_TINY  # noqa: E402

USER_DS_FILE = REPO / "configs" / "deepspeed" / "zero3-offload.json"
# The corpus: Shakespeare's speeches (one record each) where ../shared has them, else the
# built-in pydoc paragraphs. Both are short records, as in the recipes that pad each to 512.
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
MAX_DOCUMENTS = 4000


# (label, overrides): the five the comparison asks for
CASES = [
    ("ddp", ["parallel.strategy=ddp"]),
    ("fsdp", ["parallel.strategy=fsdp"]),
    ("zero3", ["parallel.strategy=zero3"]),
    ("zero3 + optimizer offload", ["parallel.strategy=zero3", "parallel.offload_optimizer=true"]),
    ("zero3 + optimizer + parameter offload (recipe file)",
     ["parallel.strategy=zero3", f"parallel.deepspeed_config={USER_DS_FILE}"]),
]

# The unchanged recipe (HF Trainer + the DeepSpeed file above, records padded to 512) on the
# same 2-core machine and a 34M-parameter Llama, in padded tokens/s (figures of the issue that
# asked for this comparison). Its useful tokens/s is that rate × the share of real tokens in
# records padded to 512, measured below on this benchmark's own corpus and tokenizer.
PAD_TO = 512
REFERENCE = [("HF Trainer + DeepSpeed ZeRO-3 offload, bf16 (the unchanged recipe)", 30),
             ("HF Trainer + DeepSpeed ZeRO-3 offload, fp32", 277),
             ("HF Trainer + DDP, no DeepSpeed, fp32", 434)]


def run(label: str, overrides: list[str], model: list[str], common: list[str], run_dir: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "cputrain", "train", *model, *common, *overrides, f"output_dir={run_dir}",
           f"data.cache_dir={cache}", "--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run(cmd, env={**env, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    memory = json.loads((run_dir / "memory.json").read_text())
    peaks = [max(row["peak_rss_gib"] for row in r["phases"]) for r in memory["ranks"]]
    return {"label": label, "tokens_per_s": summary["tokens_per_s"], "mfu": summary["mfu"],
            "peak_rss_gib": peaks, "final_loss": summary["final_loss"]}


def padded_useful_share(source: str, cache_dir: Path, vocab_size: int) -> tuple[float, int]:
    """Share of real (non-padding) tokens when every record is padded/truncated to 512, as the
    recipe's `tokenizer(text, padding="max_length", truncation=True, max_length=512)` does, with
    the tokenizer cputrain trains on the same corpus. Returns (share, records)."""
    from cputrain.config import DataConfig, ModelConfig
    from cputrain.data import sources, tokenizer

    data_cfg = DataConfig(source=source, cache_dir=str(cache_dir), max_documents=MAX_DOCUMENTS)
    tok = tokenizer.get_tokenizer(ModelConfig(tokenizer_vocab_size=vocab_size), data_cfg, sources.fingerprint(data_cfg),
                                  lambda: sources.open_corpus(data_cfg))
    docs = sources.read_documents(data_cfg)
    real = sum(min(len(ids), PAD_TO) for ids in tok(docs)["input_ids"])
    return real / (len(docs) * PAD_TO), len(docs)


def offload_verdict(rows: list[dict]) -> str:
    """When offload pays on a CPU-only host, read off these runs' own numbers."""
    parts = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        by = {r["label"].split(" (")[0]: r for r in rows if r["precision"] == precision}
        base = by["zero3"]
        for label in ("zero3 + optimizer offload", "zero3 + optimizer + parameter offload"):
            r = by[label]
            speed = r["tokens_per_s"] / base["tokens_per_s"]
            rss = max(r["peak_rss_gib"]) - max(base["peak_rss_gib"])
            parts.append(f"{precision}, {label}: {speed:.2f}× the tokens/s of plain zero3, peak RSS {rss:+.2f} GiB "
                         "per rank")
    return ("**When offload pays here.** On a CPU-only host the \"device\" and the offload target are the same "
            "DRAM, so offload cannot free memory for the model; it only changes who steps the optimizer "
            "(DeepSpeed's vectorised CPU Adam instead of torch AdamW) and adds copies between buffers. Measured: "
            + "; ".join(parts) + ". Offload pays only where it is faster in these rows, or where a "
            "recipe must also run on GPU hosts unchanged; to fit a larger model on CPU hosts, shard across more "
            "ranks or nodes (fsdp or zero3) instead.")


def markdown(rows: list[dict], setup: str, share: float, records: int) -> str:
    best = max(rows, key=lambda r: r["tokens_per_s"])
    lines = [machine_line(), "", setup, "",
             "| precision | strategy (2 ranks) | useful tokens/s | × ddp | MFU | peak RSS per rank (GiB) | final loss |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        rss = " / ".join(f"{g:.2f}" for g in r["peak_rss_gib"])
        ddp = next(d for d in rows if d["precision"] == r["precision"] and d["label"] == "ddp")
        lines.append(f"| {r['precision']} | {r['label']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / ddp['tokens_per_s']:.2f}× | {r['mfu']:.1%} | {rss} | {r['final_loss']:.4f} |")
    lines += ["", "Reference, the recipe as users ran it on the same machine and a 34M-parameter Llama (padded "
              f"tokens/s, records padded to {PAD_TO}; figures given with the request for this comparison, not rerun "
              f"here). Its useful tokens/s = padded tokens/s × the share of real tokens in padded records, measured "
              f"on this corpus with this tokenizer: {share:.1%} over {records:,} records.", "",
              "| run | padded tokens/s | useful tokens/s |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {tps} | {tps * share:,.1f} |" for name, tps in REFERENCE]
    lines += ["", offload_verdict(rows)]
    recipe_padded = REFERENCE[0][1]
    factor = best["tokens_per_s"] / (recipe_padded * share)
    lines += ["", f"Best here: **{best['label']}** ({best['precision']}), {best['tokens_per_s']:,.0f} useful tokens/s = "
              f"**{factor:.0f}×** the unchanged recipe's {recipe_padded * share:,.1f} useful tokens/s (target: ≥ 50×); "
              f"{best['tokens_per_s'] / recipe_padded:.0f}× even against its {recipe_padded} padded tokens/s, "
              "counting padding as work."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 steps (checks the script, not the figures)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--precisions", default="bf16,fp32", help="the precisions run, each its own rows")
    ap.add_argument("--no-write", action="store_true", help="print the table; leave docs/benchmarks/network.md alone")
    args = ap.parse_args()
    if importlib.util.find_spec("deepspeed") is None:
        raise SystemExit("the zero3 rows need DeepSpeed: scripts/install.sh dev,deepspeed")
    model, steps = (MODEL_TINY, 3) if args.quick else (MODEL_34M, args.steps)
    seq_len, global_batch, micro = (32, 8, 2) if args.quick else (512, 16, 4)
    # log every 5 steps: the first window (allocation, warm-up) is left out of the median
    source = str(SHAKESPEARE) if SHAKESPEARE.is_file() else "builtin:pydoc"
    common = [f"data.source={source}", f"data.seq_len={seq_len}", f"data.max_documents={MAX_DOCUMENTS}",
              f"train.max_steps={steps}",
              f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro}",
              f"train.log_every={1 if args.quick else 5}", "train.eval_every=100000", "train.eval_batches=1",
              "train.checkpoint_every=100000", "train.sample_tokens=0", "train.warmup_steps=2"]
    precisions = ["fp32"] if args.quick else args.precisions.split(",")
    setup = (f"`python benchmarks/network/strategies.py --steps {steps} --precisions {','.join(precisions)}`: "
             f"{'tiny smoke model' if args.quick else '~34M-parameter Llama'}, corpus `{Path(source).name}` "
             f"({MAX_DOCUMENTS:,} records), seq_len {seq_len} packed (every token useful), global batch {global_batch} sequences "
             f"(micro-batch {micro} × 2 ranks × accumulation {global_batch // (2 * micro)}), {steps} steps, "
             "1 thread per rank, every setting not named `auto`'s (the FSDP layout included); tokens/s is the median of the logged windows after the first.")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cputrain-strategies-") as tmp:
        tmp = Path(tmp)
        vocab = int(next(o for o in model if o.startswith("model.tokenizer_vocab_size=")).split("=")[1])
        share, records = padded_useful_share(source, tmp / "cache", vocab)  # also caches the runs' tokenizer
        print(f"records padded to {PAD_TO}: {share:.1%} real tokens over {records:,} records", flush=True)
        for precision in precisions:
            for i, (label, overrides) in enumerate(CASES):
                row = run(label, [*overrides, f"hardware.precision={precision}"], model, common,
                          tmp / f"case-{precision}-{i}", tmp / "cache")
                rows.append({"precision": precision, **row})
                print(f"{precision} {label}: {row['tokens_per_s']:,.0f} tokens/s, peak RSS {row['peak_rss_gib']}",
                      flush=True)
    text = markdown(rows, setup, share, records)
    print(text)
    if not args.no_write and not args.quick:
        write_block("strategies", text)


if __name__ == "__main__":
    main()
