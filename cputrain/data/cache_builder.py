"""Build a cache entry for a corpus of any size: in parallel, in bounded memory, resumable.

    corpus (Arrow, memory-mapped) ─► chunks of rows ─► N tokenizing processes ─► in-order append
        to packed/<key>.partial/<streams> ─► progress.json every few seconds ─► stats.json,
        then the folder is renamed to packed/<key>/ (complete)

One path for every kind of data (cputrain.data.kind): the kind names the record fields, the
tokenizing worker, the stream files, the counters and stats.json; this module only moves rows
to workers and arrays to files, in order.
Memory: each worker holds one chunk (~1 MB of text and its encodings); the parent holds at
most 2 chunks per worker of arrays in flight. Neither grows with the corpus.
Resume: progress.json records the rows and items that reached the disk (after an fsync); a
killed preparation truncates the stream files back to that point and goes on from the next row.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cputrain.config import DataConfig
from cputrain.data import sources
from cputrain.data.kind import BuildFacts, DataKind, Worker
from cputrain.data.stop_on_signal import start_tokenizing_worker
from cputrain.data.tree_memory import TreeMemory
from cputrain.data.validation_split import validation_mask
from cputrain.errors import DataError, Stopped

log = logging.getLogger("cputrain")

CHUNK_CHARS = 1_000_000  # text per task: large enough to amortise a task, small enough to bound memory
COMMIT_EVERY_S = 2.0  # how much work a kill can cost: progress.json is rewritten this often
LOG_EVERY_S = 30.0  # progress lines where no terminal shows a bar (CI, pod logs)


def token_dtype(vocab_size: int) -> str:
    """The item type of every entry's token ids: uint16 where the vocabulary fits, else uint32."""
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"


def _rows_per_chunk(corpus: sources.Corpus) -> int:
    sample = list(sources.iter_texts(corpus, rows=range(min(corpus.rows, 1000))))
    mean_chars = max(1.0, sum(map(len, sample)) / max(1, len(sample)))
    return int(min(100_000, max(1, CHUNK_CHARS // mean_chars)))


class _Progress:
    """progress.json of a partial entry: what is safely on disk (items per stream file, counters)."""

    def __init__(self, folder: Path, records: int, streams: list[str], counters: tuple[str, ...]):
        self.path = folder / "progress.json"
        saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        fresh = saved.get("records") != records or set(saved.get("items", {})) != set(streams)
        self.values = {k: 0 if fresh else saved.get(k, 0) for k in ("rows_done", *counters)}
        self.items = {name: 0 if fresh else saved["items"][name] for name in streams}
        self.records = records

    def __getitem__(self, key):
        return self.values[key]

    def add(self, chunk) -> None:
        self.values["rows_done"] = chunk.stop
        for name, array in chunk.parts.items():
            self.items[name] += len(array)
        for key, n in chunk.counts.items():
            self.values[key] += n

    def commit(self, files) -> None:
        for f in files:  # the tokens first, durably; only then the record that they are there
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.values, "items": self.items, "records": self.records}))
        os.replace(tmp, self.path)


def _open_stream(path: Path, tokens: int, itemsize: int):
    f = open(path, "r+b" if path.exists() else "w+b")
    f.truncate(tokens * itemsize)  # anything past the last commit is from a killed writer
    f.seek(0, os.SEEK_END)
    return f


def _chunks(corpus, worker: Worker, rows_done: int, held_out: np.ndarray, num_proc: int):
    """Tokenized chunks from row `rows_done` on, in row order."""
    step = _rows_per_chunk(corpus)
    bounds = [(s, min(s + step, corpus.rows)) for s in range(rows_done, corpus.rows, step)]
    files = [f["filename"] for f in corpus.dataset.cache_files]
    if num_proc == 1 or len(bounds) <= 2 or not files:
        worker.init(None, corpus.dataset, *worker.init_args)
        for a, b in bounds:
            yield worker.tokenize(a, b, held_out[a:b])
        return
    # spawn, not fork: the parent may already hold gloo and OpenMP threads, which a fork copies
    # half-alive. Workers open the Arrow files themselves; only row numbers travel.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_proc, initializer=start_tokenizing_worker,
                  initargs=(os.getpid(), worker.init, files, None, *worker.init_args)) as pool:  # left by terminate()
        pending: deque = deque()
        todo = iter(bounds)
        while True:
            while len(pending) < 2 * num_proc and (nxt := next(todo, None)) is not None:
                a, b = nxt
                pending.append(pool.apply_async(worker.tokenize, (a, b, held_out[a:b])))
            if not pending:
                return
            yield pending.popleft().get()


def _tokens(progress: _Progress) -> int:
    return progress.items["train.bin"] + progress.items["val.bin"]


def _report(bar, progress: _Progress, records: int, t0: float, rows0: int, tokens0: int, last: list) -> None:
    now = time.perf_counter()
    rows, tokens = progress["rows_done"], _tokens(progress)
    rate_tokens = (tokens - tokens0) / max(now - t0, 1e-9)
    bar.set_postfix_str(f"{rate_tokens:,.0f} tokens/s", refresh=False)
    bar.update(rows - bar.n)
    if bar.disable and now - last[0] >= LOG_EVERY_S:
        rate_rows = (rows - rows0) / max(now - t0, 1e-9)
        eta_s = (records - rows) / rate_rows if rate_rows else float("inf")
        log.info("data: %.1f%% of %d records, %s docs/s, %s tokens/s, ETA %.0f s", 100 * rows / records, records,
                 f"{rate_rows:,.0f}", f"{rate_tokens:,.0f}", eta_s)
        last[0] = now


def build(data_cfg: DataConfig, seed: int, kind: DataKind, vocab_size: int, num_proc: int, partial: Path,
          final: Path) -> None:
    """Tokenize the corpus into `partial` as `kind` says, then rename it to `final` (complete)."""
    t0 = time.perf_counter()
    memory = TreeMemory()  # this process and its tokenizing workers, reported in stats.json
    corpus = sources.open_corpus(data_cfg, fields=kind.fields)
    held_out, n_val_records = validation_mask(corpus.rows, data_cfg.val_fraction, seed)
    dtype = token_dtype(vocab_size)
    streams, worker = kind.streams(dtype), kind.worker(corpus, dtype)
    where = f"data.cache_dir '{data_cfg.cache_dir}'"
    try:
        with contextlib.ExitStack() as files:
            partial.mkdir(parents=True, exist_ok=True)
            progress = _Progress(partial, corpus.rows, list(streams), kind.counters)
            rows0, tokens0 = progress["rows_done"], _tokens(progress)
            if rows0:
                log.info("data: resuming an interrupted preparation at record %d of %d", rows0, corpus.rows)
            outs = {name: files.enter_context(_open_stream(partial / name, progress.items[name],
                                                           np.dtype(item_dtype).itemsize))
                    for name, item_dtype in streams.items()}
            bar = files.enter_context(tqdm(total=corpus.rows, initial=rows0, unit="doc", desc="tokenize",
                                           disable=not sys.stderr.isatty(), dynamic_ncols=True, mininterval=1.0))
            log.info("data: tokenizing %d records of %s with %d process(es) into %s", corpus.rows, data_cfg.source,
                     num_proc, partial)
            last_commit, last_log = time.perf_counter(), [time.perf_counter()]
            # closed (its pool terminated) before the files, however the loop ends
            chunks = files.enter_context(contextlib.closing(_chunks(corpus, worker, rows0, held_out, num_proc)))
            try:
                for chunk in chunks:
                    for name, array in chunk.parts.items():
                        outs[name].write(array.tobytes())
                    progress.add(chunk)
                    _report(bar, progress, corpus.rows, t0, rows0, tokens0, last_log)
                    if time.perf_counter() - last_commit >= COMMIT_EVERY_S:
                        progress.commit(outs.values())
                        last_commit = time.perf_counter()
            except Stopped:
                # Every chunk counted is whole in the files (bytes past it are cut off on resume).
                progress.commit(outs.values())
                raise
            progress.commit(outs.values())
        stats = kind.stats(BuildFacts(data_cfg, seed, corpus, progress, n_val_records, dtype, num_proc,
                                      time.perf_counter() - t0, rows0, tokens0))
        stats["peak_memory_gib"] = round(memory.stop(), 3)
        (partial / "stats.json").write_text(json.dumps(stats, indent=1))  # written last: marks it complete
        os.rename(partial, final)
        (final / "progress.json").unlink()  # after the rename: a kill before it resumes at the end, not at 0
    except DataError:
        # A record refused: the same records are refused at the same place next time, so what was
        # written holds nothing worth resuming (and an empty folder would be announced as an
        # interrupted preparation). A stop or a full disk keeps its partial entry to resume from.
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as exc:
        if exc.errno in sources.DISK_FULL:
            raise sources.disk_full_error(exc, where) from None
        raise
    finally:
        memory.stop()
