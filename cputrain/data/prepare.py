"""The front door of the data: (tokenizer, data) for a run's config, whatever kind of data it is.

Every command that reads data (train, eval, prepare) comes here. It decides the data's kind
from data.format (cputrain.data.kind), trains or loads the tokenizer, and opens the cache entry,
built first where it is missing: once, by one writer (cache_lock), in a spawned builder process
(cache_builder) that a signal stops cleanly (stop_on_signal).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
from pathlib import Path

from cputrain.config import DataConfig
from cputrain.data import cache_builder, cache_lock, sources
from cputrain.data.cache_key import cache_key
from cputrain.data.examples.kind import ExampleKind
from cputrain.data.feedback.kind import FeedbackKind
from cputrain.data.kind import DataKind
from cputrain.data.preference.kind import PreferenceKind
from cputrain.data.prompts.kind import PromptKind
from cputrain.data.stop_on_signal import PreparationStopped, die_with_parent, stop_on_signal
from cputrain.data.text.kind import TextKind
from cputrain.errors import DataError

log = logging.getLogger("cputrain")


def kind_of(data_cfg: DataConfig, data_format: str, tokenizer) -> DataKind:
    """The kind of data a resolved data.format names, for this tokenizer."""
    if data_format == "text":
        return TextKind(tokenizer)
    if data_format == "preference":
        return PreferenceKind(data_cfg, tokenizer)
    if data_format == "feedback":
        return FeedbackKind(data_cfg, tokenizer)
    if data_format == "prompt":
        return PromptKind(data_cfg, tokenizer)
    return ExampleKind(data_cfg, data_format, tokenizer)


def _partial_progress(partial: Path) -> str:
    try:
        p = json.loads((partial / "progress.json").read_text())
        return f" ({100 * p['rows_done'] / max(1, p['records']):.1f}% done)"
    except (OSError, ValueError, KeyError):
        return ""


class _NotBuilt(cache_lock.HandOver):
    """A cache entry (tokenizer or tokens) that the looking-up pass of prepare() would have to build:
    its lock stays taken for the spawned builder."""


def _not_built():
    raise _NotBuilt


def cached_data(data_cfg: DataConfig, data_fingerprint: str, seed: int, kind: DataKind, num_proc: int,
                may_build: bool = True):
    """The cache entry for this data, kind, tokenizer and cut: built once by one writer, then
    opened. Without `may_build`, a missing entry raises _NotBuilt."""
    key = cache_key(data_fingerprint, data_cfg, seed, kind.tokenizer, kind.key())
    final = Path(data_cfg.cache_dir) / "packed" / key
    partial = final.with_name(f"{key}.partial")

    def make() -> None:
        if not may_build:
            raise _NotBuilt
        cache_builder.build(data_cfg, seed, kind, len(kind.tokenizer), num_proc, partial, final)

    built = cache_lock.build_once(
        final.with_name(f"{key}.lock"), lambda: (final / "stats.json").exists(), make,
        f"tokenizing {data_cfg.source}", data_cfg.lock_stale_s, lambda: _partial_progress(partial))
    if not built:
        log.info("data: cached %s %s", kind.what, final)
    return kind.open(final, data_cfg)


class _BuilderTraceback(Exception):
    """The traceback of an unexpected error in the builder process, chained to it in this one."""


def _build_caches(cfg, tokenizer, send, parent_pid: int, held_lock: Path) -> None:
    """The builder process: builds what is missing, then sends None or the error that stopped it.
    `held_lock` is the lock of the first missing entry, which the parent holds for this process."""
    die_with_parent(parent_pid)
    from cputrain.log import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        with stop_on_signal(ignore_after_first=True), cache_lock.built_for_parent(held_lock):
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


def _build_in_a_child(cfg, tokenizer, held_lock: Path) -> None:
    # A plain spawned Process, not a pool's: pool processes are daemons, which may not start the
    # tokenizing pool; and this one must be stopped (and waited for) when a signal comes.
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    builder = ctx.Process(target=_build_caches, args=(cfg, tokenizer, send, os.getpid(), held_lock),
                          name="cputrain-prepare")
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
    packed text (PackedData), examples (ExampleData), preference pairs (PreferenceData) or unpaired
    feedback (FeedbackData): whatever the kind, data.rows(split) gives the rows the trainer batches from.

    `cfg` is resolved (data.num_proc is a number). A tokenizer is trained, once, only for a model
    built from scratch; the corpus is opened only by the process that builds something. With
    `isolate`, whatever must be built is built in a spawned process, so the corpus reader
    (datasets, pyarrow) and what it allocated never stay in a training rank's memory; where the
    caches are already there (a resumed run, a second rank, a prepared job), nothing is spawned:
    starting a process that imports the data stack costs seconds and finds nothing to do.

    The looking-up pass takes the first missing entry's lock and holds it while its builder runs,
    so the node's other ranks, arriving at once, wait for it in their own process: one builder a
    node (one a shared cache), not one a rank.
    """
    if isolate:
        try:
            return _open(cfg, tokenizer, may_build=False)
        except _NotBuilt as missing:
            try:
                _build_in_a_child(cfg, tokenizer, missing.lock.path)
            finally:
                missing.lock.release()
    return _open(cfg, tokenizer, may_build=True)


def _open(cfg, tokenizer, may_build: bool):
    from cputrain.data import tokenizer as tokenizers

    fp = sources.fingerprint(cfg.data)
    data_format = sources.record_format(cfg.data)
    if tokenizer is None:
        corpus_fn = (lambda: sources.open_corpus(cfg.data)) if may_build else _not_built
        tokenizer = tokenizers.get_tokenizer(cfg.model, cfg.data, fp, corpus_fn)
    num_proc = cfg.data.num_proc if isinstance(cfg.data.num_proc, int) else 1
    kind = kind_of(cfg.data, data_format, tokenizer)
    return tokenizer, cached_data(cfg.data, fp, cfg.seed, kind, num_proc, may_build)


def rows_of(data, split: str):
    """The rows of `split` ("train" or "val") the trainer and evaluation take batches from."""
    return data.rows(split)
