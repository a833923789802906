"""Text: documents joined with EOS into one stream per split and cut into rows of data.seq_len
(pretraining: every token trained, no padding). Tokenized by text.tokenize; opened as
text.rows.PackedData."""

from __future__ import annotations

import logging
from pathlib import Path

from cputrain.config import DataConfig
from cputrain.data import sources
from cputrain.data.kind import BuildFacts, Worker
from cputrain.data.text import rows, tokenize
from cputrain.errors import DataError

log = logging.getLogger("cputrain")


class TextKind:
    what = "packed tokens"
    fields = None
    counters = ("documents", "val_documents", "text_chars", "not_text", "blank")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def streams(self, token_dtype: str) -> dict[str, str]:
        return {"train.bin": token_dtype, "val.bin": token_dtype}

    def worker(self, corpus, token_dtype: str) -> Worker:
        return Worker(tokenize.init_worker,
                      (corpus.field, tokenize.portable_tokenizer(self.tokenizer), token_dtype),
                      tokenize.tokenize_rows)

    def key(self) -> None:
        return None

    def open(self, folder: Path, data_cfg: DataConfig) -> rows.PackedData:
        return rows.open_packed(folder)

    def stats(self, facts: BuildFacts) -> dict:
        data_cfg, progress, corpus = facts.data_cfg, facts.progress, facts.corpus
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
            **facts.common_stats(),
            "documents": progress["documents"],
            "skipped_not_text": progress["not_text"],
            "skipped_blank": progress["blank"],
            "val_documents": progress["val_documents"],
            "train_sequences": train_seqs,
            "val_sequences": val_seqs,
            "dropped_tail_tokens": train_tokens - train_seqs * seq_len + val_tokens - val_seqs * seq_len,
            "padding_tokens": 0,
        }
