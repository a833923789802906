"""Scale-out on one node: useful tokens/s and time in communication of 1 rank × 2 threads,
2 ranks × 1 thread with DDP and 2 ranks × 1 thread with FSDP; and the peak RSS per rank while
loading a pretrained model with FSDP sharded loading vs every rank loading it whole (DDP).

Every run goes through the real `cputrain train` command: same model, data and global batch,
in bf16 (where the CPU has bf16 units) and fp32. Throughput is the median over repetitions of each
run's own figure (summary.json: the median of its logged windows after the first); the
communication fraction is computed from the comm_time_s and step_time_s fields of metrics.jsonl
over the same windows. Writes its tables into docs/benchmarks/ (block `scale_out` on network.md,
`sharded_load` on memory.md).

    python benchmarks/network/scale_out.py            # the figures (run on a quiet machine)
    python benchmarks/network/scale_out.py --quick    # tiny models, few steps: checks the script only
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
from benchmarks.runner.timing import median  # noqa: E402
from benchmarks.network.model_sizes import MODEL_34M, MODEL_TINY  # noqa: E402

GIB = 2**30


# (label, ranks, threads per rank, strategy)
CASES = [
    ("1 rank × 2 threads", 1, 2, "single"),
    ("2 ranks × 1 thread, DDP", 2, 1, "ddp"),
    ("2 ranks × 1 thread, FSDP", 2, 1, "fsdp"),
]

# Pretrained folders for the loading comparison: (hidden, intermediate, layers) → ~620 MB / ~13 MB in fp32
LOAD_MODEL = (1024, 2816, 12)
LOAD_MODEL_QUICK = (256, 688, 4)

# An empty rank: python with the code a Llama rank must import before it can hold a weight (torch,
# torch.distributed, transformers' Llama modules: transformers alone imports lazily, ~95 MB less),
# and no weights, data or tokenizer.
EMPTY_PROCESS = ("import torch, torch.distributed, transformers; from transformers import LlamaForCausalLM; "
                 "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("PET_", "OMPI_", "PMI_"))}
    return {**env, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def train(args: list[str], ranks: int, run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "cputrain", "train", *args, f"output_dir={run_dir}", "--nproc-per-node", str(ranks)]
    proc = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def comm_fraction(run_dir: Path) -> float:
    """Time in collectives ÷ step time over the logged windows after the first (as tokens/s)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_time_s" in r]
    steps = [b["step"] - a["step"] for a, b in zip(rows, rows[1:])]  # steps each later window covers
    steady = list(zip(rows[1:], steps)) or [(rows[0], rows[0]["step"])]
    step_time_s = sum(r["step_time_s"] * n for r, n in steady)
    comm_time_s = sum(r.get("comm_time_s", 0.0) for r, _ in steady)
    return comm_time_s / step_time_s if step_time_s else 0.0


def throughput(common: list[str], reps: int, tmp: Path, precisions: list[str]) -> list[dict]:
    rows = []
    for precision in precisions:
        tps = {label: [] for label, *_ in CASES}
        comm = {label: [] for label, *_ in CASES}
        for rep in range(reps):  # alternated: drift in the machine hits every case alike
            for label, ranks, threads, strategy in CASES:
                run_dir = tmp / f"tput-{precision}-{strategy}-{rep}"
                train([*common, f"parallel.strategy={strategy}", f"hardware.threads={threads}",
                       f"hardware.precision={precision}"], ranks, run_dir)
                tps[label].append(json.loads((run_dir / "summary.json").read_text())["tokens_per_s"])
                comm[label].append(comm_fraction(run_dir))
                print(f"{precision} {label} #{rep + 1}: {tps[label][-1]:,.0f} tokens/s, "
                      f"{comm[label][-1]:.1%} in communication", flush=True)
        rows += [{"precision": precision, "label": label, "tokens_per_s": median(tps[label]),
                  "comm_fraction": median(comm[label]), "runs": tps[label]} for label, *_ in CASES]
    return rows


def make_pretrained(folder: Path, shape: tuple[int, int, int]) -> int:
    """A Llama saved with save_pretrained (and its tokenizer); returns the weight bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.data.sources import _pydoc_documents
    from cputrain.data.tokenizer import train_bpe

    hidden, intermediate, layers = shape
    tok = train_bpe(_pydoc_documents()[:400], 512, folder / "_tok")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def loading(shape: tuple[int, int, int], tmp: Path) -> dict:
    folder = tmp / "pretrained"
    model_bytes = make_pretrained(folder, shape)
    empty_gib = int(subprocess.run([sys.executable, "-c", EMPTY_PROCESS], env=_env(), capture_output=True,
                                   text=True, check=True).stdout) * 1024 / GIB
    # one step of a small batch: only the loading phase is read
    args = [f"model.name_or_path={folder}", f"data.cache_dir={tmp / 'cache'}", "data.seq_len=32",
            "data.max_documents=200", "train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=1",
            "train.eval_every=100000", "train.checkpoint_every=100000", "train.sample_tokens=0",
            "hardware.precision=fp32", "hardware.threads=1"]
    result = {"model_bytes": model_bytes, "empty_gib": empty_gib, "rows": []}
    for label, strategy in (("FSDP sharded loading", "fsdp"), ("every rank loads the whole model (DDP)", "ddp")):
        run_dir = tmp / f"load-{strategy}"
        train([*args, f"parallel.strategy={strategy}"], 2, run_dir)
        memory = json.loads((run_dir / "memory.json").read_text())
        peaks, before = [], []
        for rank in memory["ranks"]:
            phases = {row["phase"]: row for row in rank["phases"]}
            peaks.append(phases["sharded weights"]["peak_rss_gib"])
            before.append(phases["model skeleton"]["rss_gib"])
        result["rows"].append({"label": label, "peak_gib": peaks, "before_gib": before})
        print(f"{label}: peak RSS while loading {peaks} GiB", flush=True)
    return result


def throughput_markdown(rows: list[dict], setup: str, reps: int) -> str:
    lines = [machine_line(), "", setup, "",
             f"| precision | ranks × threads | useful tokens/s (median of {reps}) | vs 1 rank | time in communication "
             "| runs |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    verdicts = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        of = [r for r in rows if r["precision"] == precision]
        base = of[0]["tokens_per_s"]  # CASES[0]: one rank
        for r in of:
            runs = ", ".join(f"{t:,.0f}" for t in r["runs"])
            lines.append(f"| {precision} | {r['label']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.0%} | "
                         f"{r['comm_fraction']:.1%} | {runs} |")
        ddp = of[1]["tokens_per_s"] / base
        verdicts.append(f"{precision} **{ddp:.0%}** ({'met' if ddp >= 0.9 else 'not met on this machine'})")
    lines += ["", "2-rank DDP against the 1-rank throughput (target: ≥ 90%): " + "; ".join(verdicts) + "."]
    return "\n".join(lines)


def loading_markdown(load: dict) -> str:
    mb, empty = load["model_bytes"], load["empty_gib"]
    bound = mb / 2 * 1.3 / GIB + empty
    lines = [machine_line(), "", "`python benchmarks/network/scale_out.py --only loading`: one step of a 2-rank run from a "
             "pretrained folder (save_pretrained, safetensors); the peak is the high-water mark up to the "
             "\"sharded weights\" phase of memory.json.",
             "", f"**Peak RSS per rank while loading** a {mb / GIB:.2f} GiB (fp32) pretrained Llama folder on 2 ranks. "
              f"Bound of the issue: model ÷ 2 × 1.3 + an empty process (python with torch, torch.distributed and "
              f"transformers' Llama model imported, no weights: "
              f"{empty:.2f} GiB) = **{bound:.2f} GiB**. A rank also holds the tokenizer, the packed data and the "
              "process group before any weight exists (\"before weights\"); the last column uses that as the overhead.",
              "", "| loading | peak RSS per rank (GiB) | ≤ bound | before weights (GiB) | ≤ model ÷ 2 × 1.3 + before weights |",
              "| --- | --- | :---: | --- | :---: |"]
    for r in load["rows"]:
        peaks = " / ".join(f"{g:.2f}" for g in r["peak_gib"])
        before = " / ".join(f"{g:.2f}" for g in r["before_gib"])
        own = all(p <= mb / 2 * 1.3 / GIB + b for p, b in zip(r["peak_gib"], r["before_gib"]))
        lines.append(f"| {r['label']} | {peaks} | {'yes' if max(r['peak_gib']) <= bound else 'no'} | {before} | "
                     f"{'yes' if own else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, 3 steps, 1 repetition (checks the script only)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each throughput run (default: %(default)s)")
    ap.add_argument("--no-write", action="store_true", help="print the tables; leave docs/benchmarks/ alone")
    ap.add_argument("--precisions", default="bf16,fp32", help="the precisions run, each its own rows (bf16 where "
                    "the CPU has no bf16 units is emulated and very slow)")
    ap.add_argument("--only", choices=("throughput", "loading"), help="run one of the two measurements (each writes "
                    "its own block: scale_out, sharded_load)")
    args = ap.parse_args()
    model, steps, reps = (MODEL_TINY, 3, 1) if args.quick else (MODEL_34M, args.steps, args.reps)
    seq_len, global_batch, micro = (32, 8, 2) if args.quick else (512, 16, 4)
    common = [*model, f"data.seq_len={seq_len}", "data.max_documents=2000", f"train.max_steps={steps}",
              f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro}",
              f"train.log_every={1 if args.quick else 5}", "train.eval_every=100000", "train.eval_batches=1",
              "train.checkpoint_every=100000", "train.sample_tokens=0", "train.warmup_steps=2"]
    precisions = ["fp32"] if args.quick else args.precisions.split(",")
    setup = (f"`python benchmarks/network/scale_out.py --only throughput --steps {steps} --reps {reps} --precisions "
             f"{','.join(precisions)}`: {'tiny smoke model' if args.quick else '~34M-parameter Llama'}, "
             f"seq_len {seq_len} packed (every token useful), global batch {global_batch} sequences (micro-batch "
             f"{micro}), {steps} steps, the cases alternated repetition by repetition, every other setting (the FSDP "
             "layout included) `auto`'s, each through `cputrain train --nproc-per-node N`; tokens/s and the "
             "communication fraction are over the logged windows after the first (warm-up left out).")
    blocks = {}
    with tempfile.TemporaryDirectory(prefix="cputrain-scale-out-") as tmp:
        tmp = Path(tmp)
        common.append(f"data.cache_dir={tmp / 'cache'}")
        if args.only in (None, "throughput"):
            blocks["scale_out"] = throughput_markdown(throughput(common, reps, tmp, precisions), setup, reps)
        if args.only in (None, "loading"):
            blocks["sharded_load"] = loading_markdown(loading(LOAD_MODEL_QUICK if args.quick else LOAD_MODEL, tmp))
    for name, text in blocks.items():
        print(text + "\n")
        if not args.no_write and not args.quick:
            write_block(name, text)


if __name__ == "__main__":
    main()
