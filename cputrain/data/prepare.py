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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cputrain.config import DataConfig
from cputrain.data import cache_lock, packing, sources, tokenize_chunk, tokenize_examples
from cputrain.data.tokenize_chunk import portable_tokenizer, tokenize_rows
from cputrain.data.examples import ExampleData, open_examples
from cputrain.data.stop_on_signal import PreparationStopped, die_with_parent, start_tokenizing_worker, stop_on_signal
from cputrain.data.tokenize_examples import ExampleSpec
from cputrain.errors import DataError, Stopped
from cputrain.data.tree_memory import TreeMemory

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


@dataclass
class _Worker:
    """What a tokenizing process runs: init(arrow_files, dataset, *init_args), then tokenize(start, stop, held_out)."""

    init: Callable
    init_args: tuple
    tokenize: Callable


def _chunks(corpus, worker: _Worker, rows_done: int, held_out: np.ndarray, num_proc: int):
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


def build(data_cfg: DataConfig, seed: int, tokenizer, num_proc: int, partial: Path, final: Path,
          spec: ExampleSpec | None = None) -> None:
    """Tokenize the corpus into `partial`, then rename it to `final` (complete). Text is one stream
    per split; examples (`spec`) add the trained-token mask and the example lengths."""
    t0 = time.perf_counter()
    memory = TreeMemory()  # this process and its tokenizing workers, reported in stats.json
    corpus = sources.open_corpus(data_cfg, fields=None if spec is None else spec_fields(spec))
    held_out, n_val_records = validation_mask(corpus.rows, data_cfg.val_fraction, seed)
    dtype = packing.token_dtype(len(tokenizer))
    if spec is None:
        streams = {"train.bin": dtype, "val.bin": dtype}
        counters = ("documents", "val_documents", "text_chars", "not_text", "blank")
        worker = _Worker(tokenize_chunk.init_worker, (corpus.field, portable_tokenizer(tokenizer), dtype), tokenize_rows)
    else:
        streams = {f"{split}{suffix}": kind for split in ("train", "val")
                   for suffix, kind in ((".bin", dtype), (".mask.bin", "uint8"), (".lengths.bin", "uint32"))}
        counters = tokenize_examples.COUNTERS
        worker = _Worker(tokenize_examples.init_worker,
                         (spec, tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, dtype),
                         tokenize_examples.tokenize_rows)
    where = f"data.cache_dir '{data_cfg.cache_dir}'"
    try:
        with contextlib.ExitStack() as files:
            partial.mkdir(parents=True, exist_ok=True)
            progress = _Progress(partial, corpus.rows, list(streams), counters)
            rows0, tokens0 = progress["rows_done"], _tokens(progress)
            if rows0:
                log.info("data: resuming an interrupted preparation at record %d of %d", rows0, corpus.rows)
            outs = {name: files.enter_context(_open_stream(partial / name, progress.items[name],
                                                           np.dtype(kind).itemsize))
                    for name, kind in streams.items()}
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
        make_stats = _stats if spec is None else _example_stats
        stats = make_stats(data_cfg, seed, corpus, progress, n_val_records, dtype, num_proc, time.perf_counter() - t0,
                           rows0, tokens0)
        if spec is not None:
            stats["format"], stats["train_on"] = spec.format, spec.train_on  # as resolved from auto
            stats["pad_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
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
    train_tokens, val_tokens = progress.items["train.bin"], progress.items["val.bin"]
    if progress["documents"] == 0:
        raise sources.no_text_error(data_cfg.source)
    if train_tokens < seq_len:
        raise DataError(
            f"the training split has {train_tokens} tokens, fewer than one sequence of data.seq_len={seq_len}; "
            "use more text or a shorter data.seq_len"
        )
    train_seqs, val_seqs = train_tokens // seq_len, val_tokens // seq_len
    if progress["not_text"]:
        log.warning("data: %d record(s) of %s have a '%s' that is not text (a number, a list, null or missing); "
                    "they were left out (stats.json: skipped_not_text)", progress["not_text"], data_cfg.source,
                    corpus.field)
    return {
        "source": data_cfg.source,
        "records": corpus.rows,
        "skipped_records": corpus.skipped_records,
        "documents": progress["documents"],
        "skipped_not_text": progress["not_text"],
        "skipped_blank": progress["blank"],
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


def _example_stats(data_cfg, seed, corpus, progress, n_val_records, dtype, num_proc, wall_s, rows0, tokens0) -> dict:
    train_tokens, val_tokens = progress.items["train.bin"], progress.items["val.bin"]
    if progress["non_text_parts"]:
        log.warning("data: %d conversation(s) of %s have content parts that are not text (images, audio) and were "
                    "left out (stats.json: skipped_non_text_parts)", progress["non_text_parts"], data_cfg.source)
    if progress["tools_unsupported"]:
        log.warning("data: %d conversation(s) of %s have tool calls or tool results, which the chat template does "
                    "not write; they were left out (stats.json: skipped_tools_unsupported). Set data.chat_template "
                    "to a template that writes `tool_calls` (the built-in one does) to train on them",
                    progress["tools_unsupported"], data_cfg.source)
    if progress["train_examples"] == 0:
        raise DataError(
            f"no training example in '{data_cfg.source}': {progress['no_answer']} record(s) had no assistant turn and "
            f"{progress['dropped_long']} were longer than data.seq_len={data_cfg.seq_len} (data.truncation=drop); "
            "check data.format and its fields, or raise data.seq_len"
        )
    return {
        "source": data_cfg.source,
        "format": data_cfg.format,
        "records": corpus.rows,
        "skipped_records": corpus.skipped_records,
        "train_examples": progress["train_examples"],
        "val_examples": progress["val_examples"],
        "skipped_no_answer": progress["no_answer"],  # conversations with no assistant turn: nothing to learn
        "skipped_non_text_parts": progress["non_text_parts"],  # content with an image or audio part
        "skipped_tools_unsupported": progress["tools_unsupported"],  # tool calls the template cannot write
        "dropped_long": progress["dropped_long"],
        "truncated": progress["truncated"],
        "validation_rule": VALIDATION_RULE,
        "val_records": n_val_records,
        "val_fraction": data_cfg.val_fraction,
        "seed": seed,
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
        "tokens": train_tokens + val_tokens,
        "trained_tokens": progress["trained_tokens"],
        "val_trained_tokens": progress["val_trained_tokens"],
        "trained_token_share": round(progress["trained_tokens"] / max(1, train_tokens), 4),
        "text_chars": progress["text_chars"],
        "seq_len": data_cfg.seq_len,
        "token_dtype": dtype,
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


def spec_fields(spec: ExampleSpec) -> tuple[str, ...]:
    """The fields every record must have (an Alpaca record's `input` may be missing)."""
    if spec.format == "chat":
        return (spec.messages_field,)
    return tokenize_examples.ALPACA_FIELDS if spec.format == "alpaca" else (spec.prompt_field, spec.completion_field)


def example_spec(data_cfg: DataConfig, data_format: str, tokenizer) -> ExampleSpec:
    """How chat or prompt/completion records become examples for this tokenizer. A chat run's
    tokenizer takes the template it renders with, so the exported model/ carries it."""
    from cputrain.data import chat_template

    template = None
    if data_format == "chat":
        template = chat_template.template_of(tokenizer, data_cfg.chat_template)
        tokenizer.chat_template = template
    train_on = data_cfg.train_on if data_cfg.train_on != "auto" else (
        "assistant" if data_format == "chat" else "completion")
    return ExampleSpec(data_format, data_cfg.messages_field, data_cfg.prompt_field, data_cfg.completion_field,
                       train_on, template, chat_template.template_variables(tokenizer) if template else {},
                       data_cfg.seq_len, data_cfg.truncation)


class _NotBuilt(Exception):
    """A cache entry (tokenizer or tokens) that the looking-up pass of prepare() would have to build."""


def _not_built():
    raise _NotBuilt


def packed_data(data_cfg: DataConfig, data_fingerprint: str, seed: int, tokenizer, num_proc: int,
                spec: ExampleSpec | None = None, may_build: bool = True):
    """The cache entry for this data, tokenizer and cut: built once by one writer, then opened
    (packed text, or examples with their masks). Without `may_build`, a missing entry raises _NotBuilt."""
    key = packing.cache_key(data_fingerprint, data_cfg, seed, tokenizer, spec.key() if spec else None)
    final = Path(data_cfg.cache_dir) / "packed" / key
    partial = final.with_name(f"{key}.partial")
    make = (lambda: build(data_cfg, seed, tokenizer, num_proc, partial, final, spec)) if may_build else _not_built
    built = cache_lock.build_once(
        final.with_name(f"{key}.lock"), lambda: (final / "stats.json").exists(), make,
        f"tokenizing {data_cfg.source}", data_cfg.lock_stale_s, lambda: _partial_progress(partial))
    if not built:
        log.info("data: cached %s %s", "packed tokens" if spec is None else "examples", final)
    if spec is None:
        return packing.open_packed(final)
    return open_examples(final, data_cfg.packing)


class _BuilderTraceback(Exception):
    """The traceback of an unexpected error in the builder process, chained to it in this one."""


def _build_caches(cfg, tokenizer, send, parent_pid: int) -> None:
    """The builder process: builds what is missing, then sends None or the error that stopped it."""
    die_with_parent(parent_pid)
    from cputrain.log import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        with stop_on_signal(ignore_after_first=True):
            prepare(cfg, tokenizer, isolate=False)
    except PreparationStopped as stop:  # read only if the signal reached this process alone
        send.send((PreparationStopped(stop.signal_name, _stopped_line(cfg, stop.signal_name)), ""))
        return
    except BaseException as exc:  # a UserError for its line, or a bug for its traceback
        import pickle
        import traceback

        text = "".join(traceback.format_exception(exc))
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        send.send((exc, text))
        return
    send.send(None)


STOP_WAIT_S = 60.0  # for the builder to commit, end its pool and release the lock before it is killed


def _stop_builder(builder) -> None:
    """SIGTERM to the builder; wait while it cleans up; then no process under it is left alive."""
    import psutil

    try:
        under = psutil.Process(builder.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        under = []
    builder.terminate()
    builder.join(STOP_WAIT_S)
    if builder.is_alive():
        builder.kill()
        builder.join()
    for proc in under:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(under, timeout=10)


def _build_in_a_child(cfg, tokenizer) -> None:
    # A plain spawned Process, not a pool's: pool processes are daemons, which may not start the
    # tokenizing pool; and this one must be stopped (and waited for) when a signal comes.
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    builder = ctx.Process(target=_build_caches, args=(cfg, tokenizer, send, os.getpid()), name="cputrain-prepare")
    builder.start()
    send.close()
    try:
        with stop_on_signal():
            outcome = receive.recv()
            builder.join()
    except PreparationStopped as stop:
        _stop_builder(builder)  # a second signal here acts at once; the builder dies with this process
        raise PreparationStopped(stop.signal_name, _stopped_line(cfg, stop.signal_name)) from None
    except EOFError:  # ended without a word: killed (the OOM killer?) or crashed
        builder.join()
        raise DataError(f"the data preparation process ended with exit code {builder.exitcode} before it "
                        "finished (killed from outside, or out of memory?); what reached the disk is kept: "
                        "run the same command again to resume") from None
    if outcome is not None:
        error, text = outcome
        raise error from _BuilderTraceback(text)


def _stopped_line(cfg, signal_name: str) -> str:
    return (f"stopped by {signal_name} while preparing the data of {cfg.data.source}; what was tokenized is kept "
            f"in data.cache_dir '{cfg.data.cache_dir}': run the same command again to resume")


def prepare(cfg, tokenizer=None, isolate: bool = True):
    """(tokenizer, data) for a config: what `train`, `eval` and `prepare` all use. The data is
    packed text (PackedData) or examples (ExampleData); both give rows through rows_of().

    `cfg` is resolved (data.num_proc is a number). A tokenizer is trained, once, only for a model
    built from scratch; the corpus is opened only by the process that builds something. With
    `isolate`, whatever must be built is built in a spawned process, so the corpus reader
    (datasets, pyarrow) and what it allocated never stay in a training rank's memory; where the
    caches are already there (a resumed run, a second rank, a prepared job), nothing is spawned:
    starting a process that imports the data stack costs seconds and finds nothing to do.
    """
    if isolate:
        try:
            return _open(cfg, tokenizer, may_build=False)
        except _NotBuilt:
            _build_in_a_child(cfg, tokenizer)
    return _open(cfg, tokenizer, may_build=True)


def _open(cfg, tokenizer, may_build: bool):
    from cputrain.data import tokenizer as tokenizers

    fp = sources.fingerprint(cfg.data)
    data_format = sources.record_format(cfg.data)
    if tokenizer is None:
        corpus_fn = (lambda: sources.open_corpus(cfg.data)) if may_build else _not_built
        tokenizer = tokenizers.get_tokenizer(cfg.model, cfg.data, fp, corpus_fn)
    num_proc = cfg.data.num_proc if isinstance(cfg.data.num_proc, int) else 1
    spec = None if data_format == "text" else example_spec(cfg.data, data_format, tokenizer)
    return tokenizer, packed_data(cfg.data, fp, cfg.seed, tokenizer, num_proc, spec, may_build)


def rows_of(data, split: str):
    """The rows of `split` ("train" or "val") the trainer and evaluation take batches from."""
    from cputrain.data.batch import TokenRows

    rows = getattr(data, split)
    return rows if isinstance(data, ExampleData) else TokenRows(rows)
