"""Build the packed token cache of a corpus of any size: in parallel, in bounded memory, resumable.

    corpus (Arrow, memory-mapped) ─► chunks of rows ─► N tokenizing processes ─► in-order append
        to packed/<key>.partial/{train,val}.bin ─► progress.json every few seconds ─► stats.json,
        then the folder is renamed to packed/<key>/ (complete)

Memory: each worker holds one chunk (~1 MB of text and its encodings); the parent holds at
most 2 chunks per worker of token arrays in flight. Neither grows with the corpus.
Resume: progress.json records the rows and tokens that reached the disk (after an fsync); a
killed preparation truncates the .bin files back to that point and goes on from the next row.
One writer: see cache_lock; the other ranks and nodes poll for stats.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cputrain.config import DataConfig
from cputrain.data import cache_lock, packing, sources
from cputrain.data.tokenize_chunk import ChunkTokens, init_worker, portable_tokenizer, tokenize_rows
from cputrain.errors import DataError
from cputrain.metrics.tree_memory import TreeMemory

log = logging.getLogger("cputrain")

CHUNK_CHARS = 1_000_000  # text per task: large enough to amortise a task, small enough to bound memory
COMMIT_EVERY_S = 2.0  # how much work a kill can cost: progress.json is rewritten this often
LOG_EVERY_S = 30.0  # progress lines where no terminal shows a bar (CI, pod logs)
VALIDATION_RULE = ("record i of the first `records` records is held out (whole) when i is among the first "
                   "`val_records` entries of numpy.random.default_rng(seed).permutation(records); "
                   "val_records = round(records × val_fraction), at least 1 when val_fraction > 0")


def validation_mask(records: int, val_fraction: float, seed: int) -> tuple[np.ndarray, int]:
    """Which records are validation documents: a seeded choice of whole records, as VALIDATION_RULE says."""
    n_val = int(round(records * val_fraction))
    if val_fraction > 0 and records > 1:
        n_val = max(1, n_val)
    mask = np.zeros(records, dtype=bool)
    mask[np.random.default_rng(seed).permutation(records)[:n_val]] = True
    return mask, n_val


def _rows_per_chunk(corpus: sources.Corpus) -> int:
    sample = list(sources.iter_texts(corpus, rows=range(min(corpus.rows, 1000))))
    mean_chars = max(1.0, sum(map(len, sample)) / max(1, len(sample)))
    return int(min(100_000, max(1, CHUNK_CHARS // mean_chars)))


class _Progress:
    """progress.json of a partial entry: what is safely on disk."""

    FIELDS = ("rows_done", "train_tokens", "val_tokens", "documents", "val_documents", "text_chars")

    def __init__(self, folder: Path, records: int):
        self.path = folder / "progress.json"
        saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        fresh = saved.get("records") != records
        self.values = {k: 0 if fresh else saved.get(k, 0) for k in self.FIELDS}
        self.records = records

    def __getitem__(self, key):
        return self.values[key]

    def add(self, chunk: ChunkTokens) -> None:
        v = self.values
        v["rows_done"] = chunk.stop
        v["train_tokens"] += len(chunk.train)
        v["val_tokens"] += len(chunk.val)
        v["documents"] += chunk.documents
        v["val_documents"] += chunk.val_documents
        v["text_chars"] += chunk.text_chars

    def commit(self, files) -> None:
        for f in files:  # the tokens first, durably; only then the record that they are there
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.values, "records": self.records}))
        os.replace(tmp, self.path)


def _open_stream(path: Path, tokens: int, itemsize: int):
    f = open(path, "r+b" if path.exists() else "w+b")
    f.truncate(tokens * itemsize)  # anything past the last commit is from a killed writer
    f.seek(0, os.SEEK_END)
    return f


def _chunks(corpus, tokenizer, rows_done: int, held_out: np.ndarray, num_proc: int, dtype: str):
    """Tokenized chunks from row `rows_done` on, in row order."""
    step = _rows_per_chunk(corpus)
    bounds = [(s, min(s + step, corpus.rows)) for s in range(rows_done, corpus.rows, step)]
    files = [f["filename"] for f in corpus.dataset.cache_files]
    if num_proc == 1 or len(bounds) <= 2 or not files:
        init_worker(None, corpus.dataset, corpus.field, portable_tokenizer(tokenizer), dtype)
        for a, b in bounds:
            yield tokenize_rows(a, b, held_out[a:b])
        return
    # spawn, not fork: the parent may already hold gloo and OpenMP threads, which a fork copies
    # half-alive. Workers open the Arrow files themselves; only row numbers travel.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_proc, initializer=init_worker,
                  initargs=(files, None, corpus.field, portable_tokenizer(tokenizer), dtype)) as pool:
        pending: deque = deque()
        todo = iter(bounds)
        while True:
            while len(pending) < 2 * num_proc and (nxt := next(todo, None)) is not None:
                a, b = nxt
                pending.append(pool.apply_async(tokenize_rows, (a, b, held_out[a:b])))
            if not pending:
                return
            yield pending.popleft().get()


def _report(bar, progress: _Progress, records: int, t0: float, rows0: int, tokens0: int, last: list) -> None:
    now = time.perf_counter()
    rows, tokens = progress["rows_done"], progress["train_tokens"] + progress["val_tokens"]
    rate_tokens = (tokens - tokens0) / max(now - t0, 1e-9)
    bar.set_postfix_str(f"{rate_tokens:,.0f} tokens/s", refresh=False)
    bar.update(rows - bar.n)
    if bar.disable and now - last[0] >= LOG_EVERY_S:
        rate_rows = (rows - rows0) / max(now - t0, 1e-9)
        eta_s = (records - rows) / rate_rows if rate_rows else float("inf")
        log.info("data: %.1f%% of %d records, %s docs/s, %s tokens/s, ETA %.0f s", 100 * rows / records, records,
                 f"{rate_rows:,.0f}", f"{rate_tokens:,.0f}", eta_s)
        last[0] = now


def build(data_cfg: DataConfig, seed: int, tokenizer, num_proc: int, partial: Path, final: Path) -> None:
    """Tokenize and pack the corpus into `partial`, then rename it to `final` (complete)."""
    t0 = time.perf_counter()
    memory = TreeMemory()  # this process and its tokenizing workers, reported in stats.json
    corpus = sources.open_corpus(data_cfg)
    held_out, n_val_records = validation_mask(corpus.rows, data_cfg.val_fraction, seed)
    dtype = packing.token_dtype(len(tokenizer))
    itemsize = np.dtype(dtype).itemsize
    where = f"data.cache_dir '{data_cfg.cache_dir}'"
    try:
        with contextlib.ExitStack() as files:
            partial.mkdir(parents=True, exist_ok=True)
            progress = _Progress(partial, corpus.rows)
            rows0, tokens0 = progress["rows_done"], progress["train_tokens"] + progress["val_tokens"]
            if rows0:
                log.info("data: resuming an interrupted preparation at record %d of %d", rows0, corpus.rows)
            streams = [files.enter_context(_open_stream(partial / "train.bin", progress["train_tokens"], itemsize)),
                       files.enter_context(_open_stream(partial / "val.bin", progress["val_tokens"], itemsize))]
            bar = files.enter_context(tqdm(total=corpus.rows, initial=rows0, unit="doc", desc="tokenize",
                                           disable=not sys.stderr.isatty(), dynamic_ncols=True, mininterval=1.0))
            log.info("data: tokenizing %d records of %s with %d process(es) into %s", corpus.rows, data_cfg.source,
                     num_proc, partial)
            last_commit, last_log = time.perf_counter(), [time.perf_counter()]
            for chunk in _chunks(corpus, tokenizer, rows0, held_out, num_proc, dtype):
                streams[0].write(chunk.train.tobytes())
                streams[1].write(chunk.val.tobytes())
                progress.add(chunk)
                _report(bar, progress, corpus.rows, t0, rows0, tokens0, last_log)
                if time.perf_counter() - last_commit >= COMMIT_EVERY_S:
                    progress.commit(streams)
                    last_commit = time.perf_counter()
            progress.commit(streams)
        stats = _stats(data_cfg, seed, corpus, progress, n_val_records, dtype, num_proc, time.perf_counter() - t0,
                       rows0, tokens0)
        stats["peak_memory_gib"] = round(memory.stop(), 3)
        (partial / "stats.json").write_text(json.dumps(stats, indent=1))  # written last: marks it complete
        os.rename(partial, final)
        (final / "progress.json").unlink()  # after the rename: a kill before it resumes at the end, not at 0
    except OSError as exc:
        if exc.errno in sources.DISK_FULL:
            raise sources.disk_full_error(exc, where) from None
        raise
    finally:
        memory.stop()


def _stats(data_cfg, seed, corpus, progress, n_val_records, dtype, num_proc, wall_s, rows0, tokens0) -> dict:
    seq_len = data_cfg.seq_len
    train_tokens, val_tokens = progress["train_tokens"], progress["val_tokens"]
    if progress["documents"] == 0:
        raise sources.no_text_error(data_cfg.source)
    if train_tokens < seq_len:
        raise DataError(
            f"the training split has {train_tokens} tokens, fewer than one sequence of data.seq_len={seq_len}; "
            "use more text or a shorter data.seq_len"
        )
    train_seqs, val_seqs = train_tokens // seq_len, val_tokens // seq_len
    return {
        "source": data_cfg.source,
        "records": corpus.rows,
        "skipped_records": corpus.skipped_records,
        "documents": progress["documents"],
        "val_documents": progress["val_documents"],
        "validation_rule": VALIDATION_RULE,
        "val_records": n_val_records,
        "val_fraction": data_cfg.val_fraction,
        "seed": seed,
        "tokens": train_tokens + val_tokens,
        "text_chars": progress["text_chars"],
        "train_sequences": train_seqs,
        "val_sequences": val_seqs,
        "seq_len": seq_len,
        "token_dtype": dtype,
        "dropped_tail_tokens": train_tokens - train_seqs * seq_len + val_tokens - val_seqs * seq_len,
        "padding_tokens": 0,
        "num_proc": num_proc,
        "resumed_at_record": rows0,
        "prepare_time_s": round(wall_s, 3),
        "tokens_per_s": round((train_tokens + val_tokens - tokens0) / max(wall_s, 1e-9), 1),
    }


def _partial_progress(partial: Path) -> str:
    try:
        p = json.loads((partial / "progress.json").read_text())
        return f" ({100 * p['rows_done'] / max(1, p['records']):.1f}% done)"
    except (OSError, ValueError, KeyError):
        return ""


def packed_data(data_cfg: DataConfig, data_fingerprint: str, seed: int, tokenizer, num_proc: int) -> packing.PackedData:
    """The packed cache entry for this data, tokenizer and cut: built once by one writer, then opened."""
    key = packing.cache_key(data_fingerprint, data_cfg, seed, tokenizer)
    final = Path(data_cfg.cache_dir) / "packed" / key
    partial = final.with_name(f"{key}.partial")
    built = cache_lock.build_once(
        final.with_name(f"{key}.lock"), lambda: (final / "stats.json").exists(),
        lambda: build(data_cfg, seed, tokenizer, num_proc, partial, final),
        f"tokenizing {data_cfg.source}", data_cfg.lock_stale_s, lambda: _partial_progress(partial))
    if not built:
        log.info("data: cached packed tokens %s", final)
    return packing.open_packed(final)


def _build_caches(cfg, tokenizer) -> None:
    from cputrain.log import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    prepare(cfg, tokenizer, isolate=False)


def prepare(cfg, tokenizer=None, isolate: bool = True):
    """(tokenizer, packed data) for a config: what `train`, `eval` and `prepare` all use.

    `cfg` is resolved (data.num_proc is a number). A tokenizer is trained, once, only for a model
    built from scratch; the corpus is opened only by the process that builds something. With
    `isolate`, whatever must be built is built in a spawned process, so the corpus reader
    (datasets, pyarrow) and what it allocated never stay in a training rank's memory.
    """
    from cputrain.data import tokenizer as tokenizers

    if isolate:
        from concurrent.futures import ProcessPoolExecutor

        # Not a multiprocessing.Pool: its workers are daemons, which may not start the tokenizing pool.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as builder:
            builder.submit(_build_caches, cfg, tokenizer).result()
    fp = sources.fingerprint(cfg.data)
    if tokenizer is None:
        tokenizer = tokenizers.get_tokenizer(cfg.model, cfg.data, fp, lambda: sources.open_corpus(cfg.data))
    num_proc = cfg.data.num_proc if isinstance(cfg.data.num_proc, int) else 1
    return tokenizer, packed_data(cfg.data, fp, cfg.seed, tokenizer, num_proc)
