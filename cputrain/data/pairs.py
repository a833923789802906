"""Preference pairs in the token cache, and the rows the trainer takes from them.

The entry's streams are the examples' (cputrain.data.examples): ids, mask and lengths, where
sequences 2k and 2k+1 are pair k's prompt + chosen and prompt + rejected. Packing puts whole PAIRS
into rows of data.seq_len (next-fit, in order), so both sequences of a pair are always in the same
row and the same micro-batch; positions restart at each sequence, so no token attends to another
sequence. A batch carries, for each token, the sequence it belongs to within the micro-batch
(`sequence_ids`: 2p for pair p's chosen, 2p+1 for its rejected, -1 for padding), from which the
objective sums each sequence's log-probabilities. Without packing a row is one pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cputrain.data.batch import IGNORE_INDEX, Batch
from cputrain.data.examples import open_rows, pack_bounds


class PairRows:
    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, seq_len: int, packing: bool,
                 pad_id: int):
        self.ids, self.mask, self.lengths = ids, mask, lengths.astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id
        pairs = len(self.lengths) // 2
        pair_lengths = self.lengths[0::2] + self.lengths[1::2]
        # row r holds pairs [bounds[r], bounds[r+1])
        self.bounds = pack_bounds(pair_lengths, seq_len) if packing else np.arange(pairs + 1, dtype=np.int64)
        # DPO's reference log-probabilities of every sequence (2k, 2k+1: pair k), where they were
        # computed once before training (full weights); each batch then carries its own.
        self.reference_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return max(0, len(self.bounds) - 1)

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def pairs(self) -> int:
        return len(self.lengths) // 2

    def _row(self, r: int):
        a, b = 2 * self.bounds[r], 2 * self.bounds[r + 1]  # the row's sequences
        t0, t1 = self.offsets[a], self.offsets[b]
        ids = np.asarray(self.ids[t0:t1], dtype=np.int64)
        labels = np.where(np.asarray(self.mask[t0:t1]) > 0, ids, IGNORE_INDEX)
        starts = self.offsets[a:b] - t0
        labels[starts] = IGNORE_INDEX  # a sequence's first token would be predicted from the one before
        positions = np.arange(t1 - t0) - np.repeat(starts, self.lengths[a:b])
        sequence = np.repeat(np.arange(b - a), self.lengths[a:b])  # 2k, 2k+1: the row's k-th pair
        return ids, labels, positions, sequence

    def prompt_ids(self, row: int) -> list[int]:
        """The prompt of the row's first pair (its chosen sequence's tokens before the first trained one)."""
        s = 2 * int(self.bounds[row])
        t0, t1 = self.offsets[s], self.offsets[s + 1]
        trained = np.flatnonzero(np.asarray(self.mask[t0:t1]))
        end = t0 + (int(trained[0]) if len(trained) else t1 - t0)
        return np.asarray(self.ids[t0:end], dtype=np.int64).tolist()

    def batch(self, indices) -> Batch:
        rows = [self._row(int(r)) for r in indices]
        width = self.seq_len if self.packing else max(len(ids) for ids, *_ in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        sequence_ids = torch.full((len(rows), width), -1, dtype=torch.long)
        sequences_before = 0
        for i, (ids, lab, pos, seq) in enumerate(rows):
            n = len(ids)
            input_ids[i, :n] = torch.from_numpy(ids)
            labels[i, :n] = torch.from_numpy(lab)
            positions[i, :n] = torch.from_numpy(pos)
            positions[i, n:] = torch.arange(width - n)  # the padding is a block of its own
            sequence_ids[i, :n] = torch.from_numpy(seq) + sequences_before
            sequences_before += int(seq[-1]) + 1 if n else 0
        reference = None
        if self.reference_logps is not None:  # the sequences of these rows, in the batch's order
            reference = torch.cat([self.reference_logps[2 * self.bounds[int(r)]: 2 * self.bounds[int(r) + 1]]
                                   for r in indices])
        # Positions are always given: a row holds two sequences at least, whose positions restart.
        return Batch(input_ids, labels, positions, sequence_ids, reference)


@dataclass
class PreferenceData:
    train: PairRows
    val: PairRows
    stats: dict
    folder: Path | None = None

    def rows(self, split: str) -> PairRows:
        return getattr(self, split)

    def describe(self) -> str:
        s = self.stats
        how = (f"packed into {s['train_sequences']} train rows of {s['seq_len']} tokens "
               f"({s['packing_efficiency']:.1%} filled)" if s["packing"] else
               "one pair per row, each micro-batch padded to its longest (data.packing=false)")
        return (f"preference: {s['train_pairs']} train + {s['val_pairs']} validation pairs, {s['train_tokens']} train "
                f"tokens of which {s['trained_token_share']:.1%} trained; {how}; skipped {s['skipped_identical']} "
                f"with identical answers and {s['skipped_empty']} with an empty one, dropped {s['dropped_long']} "
                f"whose two sequences exceed data.seq_len")


def open_pairs(folder: Path, packing: bool) -> PreferenceData:
    # two sequences a pair: its chosen, then its rejected
    train, val, stats = open_rows(folder, packing, PairRows, lambda stats, split: 2 * stats[f"{split}_pairs"])
    return PreferenceData(train, val, stats, folder)
