"""Unpaired feedback in the token cache, and the rows the trainer takes from them.

An entry is a sequence kind's (cputrain.data.sequences: ids, mask and lengths), one sequence a
record, with one more stream: each sequence's label (`<split>.labels.bin`, 1 desirable, 0
undesirable). Rows are laid out as the examples' are (packed whole, positions restarting at each
sequence, or one per row), and a batch carries each token's sequence within the micro-batch
(`sequence_ids`), each sequence's label and the batch of its KL sequences.

KTO estimates the KL term of its loss from mismatched prompt/completion pairs: example e's KL
sequence is its own prompt followed by the answer of its neighbour in the data, e-1 (the first
example's is the last one's), cut at data.seq_len, its answer's tokens trained. TRL pairs each
example with the one before it in the same way, inside each batch of its fixed, sequential order
(KTOTrainer's KL_completion_ids); here batches are shuffled, so the neighbour is taken in the data
and stays fixed: the reference can then be computed once for every KL sequence too (full weights
keep no second model), and a batch of the whole data pairs exactly as TRL's one batch does. The KL
sequences of a micro-batch are laid out as its examples are (packed into rows of data.seq_len, or
one per row), with the reference's log-probabilities of both where they were computed before
training (table: 2e for example e, 2e+1 for its KL sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cputrain.data.batch import IGNORE_INDEX, Batch, padded
from cputrain.data.sequences import SequenceData, SequenceRows, open_rows, pack_bounds


@dataclass
class FeedbackBatch(Batch):
    """A micro-batch of labelled sequences (sequence_ids: each token's example within it)."""

    desirable: torch.Tensor | None = None  # [examples] bool, in sequence-id order
    kl: Batch | None = None  # the examples' KL sequences (sequence i: example i's), reference_logps theirs

    @property
    def examples(self) -> int:
        return len(self.desirable)

    @property
    def pairs(self) -> int:
        return 0  # no pairs: KTO counts examples


def lay_out(sequences: list[tuple[np.ndarray, np.ndarray]], packing: bool, seq_len: int,
            pad_id: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels, positions, sequence_ids) of `sequences` (ids, mask) in rows: packed
    whole and in order into rows of seq_len (next-fit), or one per row padded to the longest;
    positions restart at each sequence, whose first token is never a target."""
    lengths = np.asarray([len(ids) for ids, _ in sequences], dtype=np.int64)
    bounds = pack_bounds(lengths, seq_len) if packing else np.arange(len(sequences) + 1)
    rows = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        ids = np.concatenate([sequences[i][0] for i in range(a, b)]).astype(np.int64)
        mask = np.concatenate([sequences[i][1] for i in range(a, b)])
        starts = np.cumsum(lengths[a:b]) - lengths[a:b]
        labels = np.where(mask > 0, ids, IGNORE_INDEX)
        labels[starts] = IGNORE_INDEX
        positions = np.arange(len(ids)) - np.repeat(starts, lengths[a:b])
        rows.append((ids, labels, positions, np.repeat(np.arange(a, b), lengths[a:b])))
    width = seq_len if packing else int(lengths.max(initial=1))
    input_ids, labels, positions = padded(rows, width, pad_id)
    sequence_ids = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, (ids, _, _, owner) in enumerate(rows):
        sequence_ids[r, : len(ids)] = torch.from_numpy(owner)
    return input_ids, labels, positions, sequence_ids


class FeedbackRows(SequenceRows):
    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, seq_len: int, packing: bool,
                 pad_id: int):
        super().__init__(ids, mask, lengths, seq_len, packing, pad_id)
        self.bounds = pack_bounds(self.lengths, seq_len) if packing else np.arange(len(lengths) + 1, dtype=np.int64)
        self.labels = np.zeros(len(lengths), dtype=np.uint8)  # set by open_feedback from the labels stream
        # The reference's log-probabilities (2e: example e, 2e+1: its KL sequence), where they were
        # computed once before training; each batch then carries its own.
        self.reference_logps: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def examples(self) -> int:
        return len(self.lengths)

    @property
    def reference_sequences(self) -> int:
        """Sequences the reference is computed for: each example and its KL sequence."""
        return 2 * self.examples

    def kl_partner(self, example: int) -> int:
        """The example whose answer follows `example`'s prompt in its KL sequence."""
        return (example - 1) % self.examples

    def _sequence(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        t0, t1 = self.offsets[example], self.offsets[example + 1]
        return np.asarray(self.ids[t0:t1], dtype=np.int64), np.asarray(self.mask[t0:t1], dtype=np.uint8)

    @staticmethod
    def _answer_start(mask: np.ndarray) -> int:
        trained = np.flatnonzero(mask)
        return int(trained[0]) if len(trained) else len(mask)

    def kl_sequence(self, example: int) -> tuple[np.ndarray, np.ndarray]:
        """`example`'s prompt, then its partner's answer (the tokens from its first trained one),
        cut at data.seq_len."""
        ids, mask = self._sequence(example)
        p_ids, p_mask = self._sequence(self.kl_partner(example))
        own, theirs = self._answer_start(mask), self._answer_start(p_mask)
        kl_ids = np.concatenate([ids[:own], p_ids[theirs:]])[: self.seq_len]
        kl_mask = np.concatenate([np.zeros(own, dtype=np.uint8), p_mask[theirs:]])[: self.seq_len]
        return kl_ids, kl_mask

    def prompt_ids(self, row: int) -> list[int]:
        """The prompt of the row's first example."""
        return self.prompt_of(int(self.bounds[row]))

    def batch(self, indices) -> FeedbackBatch:
        examples = np.concatenate([np.arange(self.bounds[int(r)], self.bounds[int(r) + 1]) for r in indices]) \
            if len(indices) else np.zeros(0, dtype=np.int64)
        matched = [self._sequence(int(e)) for e in examples]
        if self.packing:  # the rows as the entry packed them
            input_ids, labels, positions, sequence_ids = self._rows_as_packed(indices, matched)
        else:
            input_ids, labels, positions, sequence_ids = lay_out(matched, False, self.seq_len, self.pad_id)
        kl_ids, kl_labels, kl_positions, kl_sequence_ids = lay_out(
            [self.kl_sequence(int(e)) for e in examples], self.packing, self.seq_len, self.pad_id)
        reference = kl_reference = None
        if self.reference_logps is not None:
            at = torch.from_numpy(2 * examples)
            reference, kl_reference = self.reference_logps[at], self.reference_logps[at + 1]
        kl = Batch(kl_ids, kl_labels, kl_positions, kl_sequence_ids, kl_reference)
        desirable = torch.from_numpy(self.labels[examples] > 0)
        return FeedbackBatch(input_ids, labels, positions, sequence_ids, reference, desirable=desirable, kl=kl)

    def _rows_as_packed(self, indices, matched) -> tuple[torch.Tensor, ...]:
        """The micro-batch's rows as self.bounds packed them (each row its own examples)."""
        parts, at = [], 0
        for r in indices:
            n = int(self.bounds[int(r) + 1] - self.bounds[int(r)])
            parts.append(lay_out(matched[at : at + n], True, self.seq_len, self.pad_id))
            at += n
        offsets = np.cumsum([0] + [int(p[3].max()) + 1 for p in parts[:-1]])
        return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]),
                torch.cat([torch.where(p[3] >= 0, p[3] + int(o), p[3]) for p, o in zip(parts, offsets)]))


@dataclass
class FeedbackData(SequenceData):
    def describe(self) -> str:
        s = self.stats
        return self.described(f"feedback: {s['train_examples']} train examples ({s['desirable']} desirable, "
                              f"{s['undesirable']} undesirable) + {s['val_examples']} validation", "one",
                              f"skipped {s['skipped_empty']} with an empty answer and {s['skipped_no_answer']} "
                              f"without a closing assistant turn, dropped {s['dropped_long']} longer than "
                              f"data.seq_len, truncated {s['truncated']}")


def open_feedback(folder: Path, packing: bool) -> FeedbackData:
    train, val, stats = open_rows(folder, packing, FeedbackRows, lambda stats, split: stats[f"{split}_examples"])
    for split, rows in (("train", train), ("val", val)):
        if rows.examples:
            rows.labels = np.fromfile(folder / f"{split}.labels.bin", dtype=np.uint8, count=rows.examples)
    return FeedbackData(train, val, stats, folder)
