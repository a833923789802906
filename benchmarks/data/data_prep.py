"""Data preparation at growing corpus sizes: cputrain's streaming token cache vs the peer recipe.

The peer is what transformers' `run_clm` example does: `datasets.load_dataset("json")`, then
`map(tokenize, batched=True, num_proc=N)`, then `map(group_texts, batched=True, num_proc=N)`
(concatenate and cut into blocks). cputrain is `cputrain prepare` on the same .jsonl file, with
the same tokenizer (trained once beforehand, so neither side pays for training one) and the
same N processes and block length. Both start from an empty cache every repetition.

For each size: wall time, tokens/s per core, and the peak memory of the whole process tree (the
sum of PSS over the parent and its workers, sampled every 0.2 s, so pages shared by forked
workers count once). After cputrain's preparation, a short `cputrain train` on that cache gives
the RSS during training, next to the same run on a 1 MB corpus.

Corpora are built from text every machine has: the tiny-Shakespeare file of ../shared/data
(where present) and Python's own standard-library sources, one document per speech or block.

    python benchmarks/data/data_prep.py                 # 100 MB ×3, 400 MB, 1.6 GB (about 40 min on 2 cores)
    python benchmarks/data/data_prep.py --quick         # 5 MB and 10 MB: checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from itertools import chain
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from benchmarks.runner.timing import median  # noqa: E402
from cputrain.data.tree_memory import TreeMemory  # noqa: E402

GIB = 2**30
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
SEQ_LEN = 512
VOCAB = 16384
TINY_MODEL = ["model.arch.hidden_size=64", "model.arch.intermediate_size=128", "model.arch.num_hidden_layers=2",
              "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=2"]


# ------------------------------------------------------------------------------------------
# Corpora


def _documents():
    """Speeches of Shakespeare and blocks of Python's stdlib sources, as documents, forever."""
    docs = []
    if SHAKESPEARE.exists():
        docs += [p.strip() for p in SHAKESPEARE.read_text().split("\n\n") if p.strip()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:400]:
        docs += [b.strip() for b in path.read_text(errors="replace").split("\n\n\n") if len(b.strip()) > 80]
    return chain.from_iterable(docs for _ in iter(int, 1))


def write_corpus(path: Path, size_bytes: int) -> Path:
    if path.exists() and path.stat().st_size >= size_bytes:
        return path
    written = 0
    with open(path, "w") as f:
        for doc in _documents():
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            written += len(line.encode())
            if written >= size_bytes:
                break
    return path


# ------------------------------------------------------------------------------------------
# Measuring a command


def measure(cmd: list[str], env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    mem = TreeMemory(proc.pid)
    out, err = proc.communicate()
    wall_s = time.perf_counter() - t0
    peak = mem.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} … failed:\n{err[-3000:]}")
    return {"wall_s": wall_s, "peak_gib": peak, "stdout": out}


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# ------------------------------------------------------------------------------------------
# The two sides


def peer(corpus: str, tokenizer_dir: str, cache: str, num_proc: int, block_size: int) -> None:
    """run_clm's data path: tokenize with map(num_proc), then group_texts with map(num_proc)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    raw = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)

    def tokenize_function(examples):
        return tok(examples["text"])

    tokenized = raw.map(tokenize_function, batched=True, num_proc=num_proc, remove_columns=raw.column_names)

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    grouped = tokenized.map(group_texts, batched=True, num_proc=num_proc)
    tokens = sum(len(ids) for batch in tokenized.iter(batch_size=10_000) for ids in batch["input_ids"])
    print(json.dumps({"tokens": tokens, "blocks": len(grouped)}))


def run_peer(corpus: Path, tokenizer_dir: Path, work: Path, num_proc: int) -> dict:
    cache = tempfile.mkdtemp(dir=work, prefix="peer-")
    r = measure([sys.executable, __file__, "--peer", str(corpus), str(tokenizer_dir), cache, str(num_proc)], _env())
    r["tokens"] = json.loads(r.pop("stdout").strip().splitlines()[-1])["tokens"]
    subprocess.run(["rm", "-rf", cache])
    return r


def cputrain_overrides(corpus: Path, tokenizer_dir: Path, cache: str, num_proc: int) -> list[str]:
    return [f"data.source={corpus}", f"model.tokenizer={tokenizer_dir}", f"data.cache_dir={cache}",
            f"data.seq_len={SEQ_LEN}", f"data.num_proc={num_proc}"]


def run_cputrain(corpus: Path, tokenizer_dir: Path, work: Path, num_proc: int, keep: bool = False) -> dict:
    cache = tempfile.mkdtemp(dir=work, prefix="cputrain-")
    r = measure([sys.executable, "-m", "cputrain", "prepare", *cputrain_overrides(corpus, tokenizer_dir, cache, num_proc)],
                _env())
    r.pop("stdout")
    stats = json.loads(next((Path(cache) / "packed").glob("*/stats.json")).read_text())
    r["tokens"] = stats["tokens"]
    r["cache"] = cache
    if not keep:
        subprocess.run(["rm", "-rf", cache])
    return r


def training_rss_gib(corpus: Path, tokenizer_dir: Path, cache: str, work: Path) -> float:
    """RSS of a short training run on a prepared cache: the median of its logged steps."""
    out = tempfile.mkdtemp(dir=work, prefix="run-")
    cmd = [sys.executable, "-m", "cputrain", "train", *cputrain_overrides(corpus, tokenizer_dir, cache, 1), *TINY_MODEL,
           f"output_dir={out}", "train.max_steps=6", "train.log_every=1", "train.eval_every=100",
           "train.checkpoint_every=100", "train.global_batch_size=4", "train.micro_batch_size=4",
           "train.sample_tokens=0", "hardware.precision=fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise SystemExit(f"training on {corpus} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return median([r["rss_gib"] for r in rows if "rss_gib" in r])


def train_tokenizer(corpus: Path, work: Path) -> Path:
    """One tokenizer for both sides: cputrain's BPE trained on the smallest corpus, copied out of its cache."""
    from cputrain.config import DataConfig, ModelConfig
    from cputrain.data import sources, tokenizer

    data_cfg = DataConfig(source=str(corpus), cache_dir=str(work / "tok-cache"), tokenizer_sample_mb=64)
    tokenizer.get_tokenizer(ModelConfig(tokenizer_vocab_size=VOCAB), data_cfg, sources.fingerprint(data_cfg),
                            lambda: sources.open_corpus(data_cfg))
    return next((work / "tok-cache" / "tokenizers").glob("bpe-*"))


# ------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 MB and 10 MB corpora: checks the script, no figures")
    ap.add_argument("--work", default=None, help="folder for corpora and caches (default: a temporary one)")
    ap.add_argument("--num-proc", type=int, default=None, help="processes on both sides (default: physical cores)")
    ap.add_argument("--peer", nargs=4, metavar=("CORPUS", "TOKENIZER", "CACHE", "NUM_PROC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        corpus, tok, cache, num_proc = args.peer
        peer(corpus, tok, cache, int(num_proc), SEQ_LEN)
        return

    from cputrain.hardware import detect

    cores = detect().physical_cores
    num_proc = args.num_proc or cores
    sizes = [(5, 1), (10, 1)] if args.quick else [(100, 3), (400, 1), (1600, 1)]  # (MB, repetitions)
    work = Path(args.work or tempfile.mkdtemp(prefix="data-prep-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    small = write_corpus(work / "corpus-1mb.jsonl", 10**6)
    tokenizer_dir = train_tokenizer(write_corpus(work / f"corpus-{sizes[0][0]}mb.jsonl", sizes[0][0] * 10**6), work)
    small_run = run_cputrain(small, tokenizer_dir, work, num_proc, keep=True)
    baseline_rss = training_rss_gib(small, tokenizer_dir, small_run["cache"], work)

    rows = []
    for mb, reps in sizes:
        corpus = write_corpus(work / f"corpus-{mb}mb.jsonl", mb * 10**6)
        ours, theirs = [], []
        for rep in range(reps):  # alternated, so drift of the machine hits both sides alike
            ours.append(run_cputrain(corpus, tokenizer_dir, work, num_proc, keep=rep == reps - 1))
            theirs.append(run_peer(corpus, tokenizer_dir, work, num_proc))
            print(f"{mb} MB rep {rep + 1}: cputrain {ours[-1]['wall_s']:.1f} s / {ours[-1]['peak_gib']:.2f} GiB, "
                  f"peer {theirs[-1]['wall_s']:.1f} s / {theirs[-1]['peak_gib']:.2f} GiB", flush=True)
        train_rss = training_rss_gib(corpus, tokenizer_dir, ours[-1]["cache"], work)
        subprocess.run(["rm", "-rf", ours[-1]["cache"]])
        rows.append({"mb": mb, "reps": reps, "tokens": ours[0]["tokens"], "peer_tokens": theirs[0]["tokens"],
                     "wall_s": median([r["wall_s"] for r in ours]), "peer_wall_s": median([r["wall_s"] for r in theirs]),
                     "peak_gib": max(r["peak_gib"] for r in ours), "peer_peak_gib": max(r["peak_gib"] for r in theirs),
                     "train_rss_gib": train_rss})
        print(json.dumps(rows[-1]), flush=True)
    if args.quick:
        return
    write_block("data_prep", render(rows, baseline_rss, num_proc, cores))


def render(rows: list[dict], baseline_rss: float, num_proc: int, cores: int) -> str:
    lines = [
        "### Data preparation: streaming token cache vs run_clm's map + group_texts",
        "",
        machine_line(),
        "",
        f"`benchmarks/data/data_prep.py`: the same .jsonl corpus, the same 16,384-token BPE (trained once beforehand), "
        f"{num_proc} processes on both sides, blocks of {SEQ_LEN}, empty caches every repetition; wall time is the "
        "median of the repetitions, memory the highest peak of the process tree's summed PSS (parent + workers). "
        "The peer is transformers' `run_clm` recipe: `load_dataset('json')`, `map(tokenize, batched=True, "
        "num_proc)`, `map(group_texts, batched=True, num_proc)`.",
        "",
        "| corpus | reps | tokens | cputrain wall | peer wall | cputrain tokens/s per core | peer tokens/s per core "
        "| speed ratio | cputrain peak | peer peak | RSS training afterwards |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours_tps = r["tokens"] / r["wall_s"] / cores
        peer_tps = r["peer_tokens"] / r["peer_wall_s"] / cores
        lines.append(
            f"| {r['mb']:,} MB | {r['reps']} | {r['tokens'] / 1e6:,.0f} M | {r['wall_s']:.1f} s | {r['peer_wall_s']:.1f} s "
            f"| {ours_tps:,.0f} | {peer_tps:,.0f} | {ours_tps / peer_tps:.2f}× | {r['peak_gib']:.2f} GiB "
            f"| {r['peer_peak_gib']:.2f} GiB | {r['train_rss_gib']:.2f} GiB |")
    worst_peak = max(r["peak_gib"] for r in rows)
    worst_train = max(r["train_rss_gib"] for r in rows)
    slowest = min(r["tokens"] / r["wall_s"] / (r["peer_tokens"] / r["peer_wall_s"]) for r in rows)
    lines += [
        "",
        f"RSS while training the same tiny model on a 1 MB corpus: {baseline_rss:.2f} GiB.",
        "",
        "Targets: peak while preparing ≤ 2 GiB at every size, flat with size — "
        f"{'met' if worst_peak <= 2 else 'NOT met'} (highest {worst_peak:.2f} GiB); RSS while training ≤ the 1 MB "
        f"run + 0.2 GiB — {'met' if worst_train <= baseline_rss + 0.2 else 'NOT met'} (highest {worst_train:.2f} "
        f"vs {baseline_rss:.2f} GiB); tokens/s ≥ the peer's at every size — {'met' if slowest >= 1 else 'NOT met'} "
        f"(lowest ratio {slowest:.2f}×). The peer's token count has no EOS between documents (run_clm adds none); "
        "cputrain's includes one per document.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
