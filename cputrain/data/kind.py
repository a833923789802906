"""A kind of data: what a record is, and everything in the token cache that follows from it.

The cache builder (cputrain.data.cache_builder) and the front door (cputrain.data.prepare) take a
kind and never ask which one it is. A kind says which record fields the corpus must have, which
tokenizing worker turns rows into arrays, the stream files and counters of its cache entry, its
stats.json, its part of the cache key, and how a complete entry opens as the rows the trainer
batches from. The kinds are text (cputrain.data.text), examples (cputrain.data.examples: chat,
prompt/completion, Alpaca), preference pairs (cputrain.data.preference) and unpaired feedback
(cputrain.data.feedback), each a package of the same files; how another is added: cputrain.data's
docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cputrain.data.validation_split import VALIDATION_RULE

if TYPE_CHECKING:  # annotations only: tokenizing workers import this module (Worker), and need no config
    from cputrain.config import DataConfig


@dataclass
class Worker:
    """What a tokenizing process runs: init(arrow_files, dataset, *init_args), then tokenize(start, stop, held_out)."""

    init: Callable
    init_args: tuple
    tokenize: Callable


@dataclass
class BuildFacts:
    """What a finished tokenizing pass knows, from which a kind writes its stats.json."""

    data_cfg: DataConfig
    seed: int
    corpus: Any  # sources.Corpus
    progress: Any  # the builder's counters and stream lengths (progress["x"], progress.items["train.bin"])
    val_records: int
    token_dtype: str
    num_proc: int
    wall_s: float
    resumed_at_record: int
    tokens_before: int  # tokens already on disk when this pass started (a resumed preparation)

    def common_stats(self) -> dict:
        """What every kind's stats.json says: the source, how validation was chosen, the tokens, the pass."""
        items, cfg = self.progress.items, self.data_cfg
        tokens = items["train.bin"] + items["val.bin"]
        return {
            "source": cfg.source,
            "records": self.corpus.rows,
            "skipped_records": self.corpus.skipped_records,
            "validation_rule": VALIDATION_RULE,
            "val_records": self.val_records,
            "val_fraction": cfg.val_fraction,
            "seed": self.seed,
            "tokens": tokens,
            "text_chars": self.progress["text_chars"],
            "seq_len": cfg.seq_len,
            "token_dtype": self.token_dtype,
            "num_proc": self.num_proc,
            "resumed_at_record": self.resumed_at_record,
            "prepare_time_s": round(self.wall_s, 3),
            "tokens_per_s": round((tokens - self.tokens_before) / max(self.wall_s, 1e-9), 1),
        }


class DataKind(Protocol):
    what: str  # how logs name its cache entries: "packed tokens", "examples"
    fields: tuple[str, ...] | None  # the record fields every record must have; None: text's one field
    counters: tuple[str, ...]  # what a tokenized chunk counts, summed into progress.json and stats.json
    tokenizer: Any  # what it is tokenized with (its hash is part of the cache key)

    def streams(self, token_dtype: str) -> dict[str, str]:
        """The files of a cache entry (train and val), each with its item dtype."""

    def worker(self, corpus, token_dtype: str) -> Worker: ...

    def stats(self, facts: BuildFacts) -> dict:
        """stats.json of a finished entry; raises a DataError where nothing can be trained."""

    def key(self) -> dict | None:
        """This kind's part of the cache key (None: text's, so text keys never change)."""

    def open(self, folder: Path, data_cfg: DataConfig):
        """A complete entry as the run's data: its stats, describe(), and rows(split)."""
