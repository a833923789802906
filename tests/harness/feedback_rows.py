"""Unpaired feedback records tokenized in the test's own process, as a tokenizing worker does
(cputrain.data.feedback.tokenize), and opened as the rows KTO trains on."""

from __future__ import annotations

import numpy as np

# five questions, answers of different lengths, labels alternating
FEEDBACK_RECORDS = [{"prompt": f"Question {i}: what is {w}? ", "completion": f"It is {w}, {'x' * i}.",
                     "label": i % 2 == 0}
                    for i, w in enumerate(["a list", "a dict", "a set", "a tuple", "an int"])]


class Records:
    """What a worker reads of a datasets.Dataset: rows sliced into columns."""

    def __init__(self, records: list[dict]):
        self.records = records

    def __getitem__(self, rows: slice) -> dict:
        names = dict.fromkeys(name for record in self.records for name in record)
        return {name: [record.get(name) for record in self.records[rows]] for name in names}


def tokenize_feedback(tok, records: list[dict], seq_len: int = 256, truncation: str = "drop"):
    """The chunk a worker makes of `records` (every record in the train split)."""
    from cputrain.data import chat_template, sequences
    from cputrain.data.feedback import tokenize
    from cputrain.data.feedback.tokenize import FeedbackSpec

    template = chat_template.template_of(tok, None)
    spec = FeedbackSpec("prompt", "completion", "label", template, chat_template.template_variables(tok), seq_len,
                        truncation)
    sequences.init_worker(None, Records(records), spec, tok.backend_tokenizer.to_str(), tok.eos_token_id, "uint16")
    return tokenize.tokenize_rows(0, len(records), np.zeros(len(records), bool))


def chunk_sequences(chunk) -> list[tuple[list[int], list[int]]]:
    """The (ids, mask) of each sequence of a chunk's train split."""
    ids, mask, lengths = chunk.parts["train.bin"], chunk.parts["train.mask.bin"], chunk.parts["train.lengths.bin"]
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(bounds, bounds[1:])]


def feedback_rows(tok, records: list[dict], packing: bool, seq_len: int = 256):
    """(FeedbackRows of `records`, their sequences as chunk_sequences gives them)."""
    from cputrain.data.feedback.rows import FeedbackRows

    chunk = tokenize_feedback(tok, records, seq_len)
    rows = FeedbackRows(chunk.parts["train.bin"], chunk.parts["train.mask.bin"], chunk.parts["train.lengths.bin"],
                        seq_len, packing, tok.pad_token_id)
    rows.labels = chunk.parts["train.labels.bin"]
    return rows, chunk_sequences(chunk)
