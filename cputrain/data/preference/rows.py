"""Preference pairs in the token cache, and the rows the trainer takes from them.

An entry is a sequence kind's (cputrain.data.sequences: ids, mask and lengths), where
sequences 2k and 2k+1 are pair k's prompt + chosen and prompt + rejected. Packing puts whole PAIRS
into rows of data.seq_len (next-fit, in order), so both sequences of a pair are always in the same
row and the same micro-batch. A batch carries, for each token, the sequence it belongs to within
the micro-batch (`sequence_ids`: 2p for pair p's chosen, 2p+1 for its rejected, -1 for padding),
from which the objective sums each sequence's log-probabilities. Without packing a row is one pair.

Two layouts of a pair in a row:

- unshared (data.shared_prompt=false): the two sequences one after the other, positions
  restarting at each; the block-diagonal causal mask is built from the position ids
  (cputrain.data.batch.packed_mask), so no token attends to another sequence. The prompt is computed twice.
- shared prompt (data.shared_prompt=true, preference data's auto): the chosen sequence whole
  (prompt + chosen answer), then `p_last` + the rejected answer, where p_last is a copy of the
  prompt's last shared token (index P-1) at its position P-1. The copy's hidden state is the
  prompt's last position's (same token, position and context), so the usual label shift predicts
  the rejected answer's first token from it. The batch carries a 4D mask
  [micro-batch, 1, tokens, tokens] (True: attend): causal, each sequence's own tokens, and the
  rejected ones also the prompt's tokens 0…P-2 of their pair; padding sees itself only. The pair
  then takes len(chosen) + len(rejected) - (P-1) tokens.

P, the pair's shared prefix, is the longest common prefix of its two sequences' ids capped at the
first trained token of either (a trained token is never shared): a string pair is tokenized whole
then prompt alone, so its two sequences may part a token before the answer. A pair with P < 2 has
nothing to share (P-1 ≤ 0) and is laid out as two sequences, inside the same mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cputrain.data.batch import IGNORE_INDEX, Batch, padded, shared_prompt_mask
from cputrain.data.sequences import SequenceData, SequenceRows, open_rows, pack_bounds
from cputrain.errors import ConfigError

_CHUNK_PAIRS = 1 << 16  # pairs compared at a time: bounded memory however many pairs
_FIRST_WINDOW = 32  # tokens first compared per pair; a pair still matching doubles it


def shared_prefixes(ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """P of every pair: the longest common prefix of sequences 2k and 2k+1's ids, capped at the
    first trained token of either. Vectorized over chunks of pairs, comparing a window of tokens
    at a time (32, then 64, …) and only the pairs still matching, so the work is about the shared
    prompts' tokens, not the answers'."""
    pairs = len(lengths) // 2
    out = np.zeros(pairs, dtype=np.int64)
    for c0 in range(0, pairs, _CHUNK_PAIRS):
        pair = np.arange(c0, min(pairs, c0 + _CHUNK_PAIRS))
        chosen, rejected = offsets[2 * pair], offsets[2 * pair + 1]
        room = np.minimum(lengths[2 * pair], lengths[2 * pair + 1])  # tokens both sequences have
        start, window = 0, _FIRST_WINDOW
        while len(pair):
            n = np.clip(room - start, 0, window)
            owner = np.repeat(np.arange(len(pair)), n)
            j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # index within the window
            at_c, at_r = chosen[owner] + start + j, rejected[owner] + start + j
            stop = (ids[at_c] != ids[at_r]) | (mask[at_c] > 0) | (mask[at_r] > 0)
            stopped, first = np.unique(owner[stop], return_index=True)
            done = np.zeros(len(pair), dtype=bool)
            done[stopped] = True
            out[pair[stopped]] = start + j[stop][first]
            ended = ~done & (n < window)  # a sequence ended inside the window: the whole of it is shared
            out[pair[ended]] = start + n[ended]
            go_on = ~done & ~ended
            pair, chosen, rejected, room = pair[go_on], chosen[go_on], rejected[go_on], room[go_on]
            start, window = start + window, 2 * window
    return out


def shared_prompt_choice(setting, data_format: str) -> tuple[bool, str]:
    """data.shared_prompt for a resolved data.format, and why ("" when the config fixed it); true
    on data that holds no pairs is refused in one line."""
    if setting is True and data_format != "preference":
        raise ConfigError(f"data.shared_prompt=true lays out preference pairs (chosen and rejected after one "
                          f"prompt), but data.format is {data_format}; set data.shared_prompt=auto or false")
    if setting != "auto":
        return setting, ""
    if data_format == "preference":
        return True, ("preference pairs: the prompt is computed once per pair instead of twice (one copied token "
                      "per pair); LoRA DPO pairs/s measured 1.09×, 1.28×, 1.28× at ~10, 30, 50% prompt shares "
                      "(bf16, AVX512-BF16 EPYC, benchmarks/sft_and_dpo/shared_prompt.py)")
    return False, f"{data_format}: no pairs, no prompt to share"


class PairRows(SequenceRows):
    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, seq_len: int, packing: bool,
                 pad_id: int, shared_prompt: bool = False):
        super().__init__(ids, mask, lengths, seq_len, packing, pad_id)
        self.shared_prompt = shared_prompt
        pairs = len(self.lengths) // 2
        # tokens of each pair's rejected sequence not laid out again (its prompt's 0…P-2): none unshared
        self.shared = np.maximum(shared_prefixes(ids, mask, self.offsets, self.lengths) - 1, 0) if shared_prompt \
            else np.zeros(pairs, dtype=np.int64)
        pair_lengths = self.lengths[0::2] + self.lengths[1::2] - self.shared
        # row r holds pairs [bounds[r], bounds[r+1])
        self.bounds = pack_bounds(pair_lengths, seq_len) if packing else np.arange(pairs + 1, dtype=np.int64)
        self._tokens = int(pair_lengths.sum())
        # DPO's reference log-probabilities of every sequence (2k, 2k+1: pair k), where they were
        # computed once before training (full weights); each batch then carries its own.
        self.reference_logps: torch.Tensor | None = None
        self.margins: np.ndarray | None = None  # each pair's margin (data.margin_field), set by open_pairs

    @property
    def tokens(self) -> int:
        """Tokens the rows hold (padding aside): with a shared prompt, fewer than the cache's."""
        return self._tokens

    @property
    def saved_tokens(self) -> int:
        """Tokens the shared prompt leaves out of the rows (0 unshared)."""
        return int(self.offsets[-1]) - self._tokens

    @property
    def pairs(self) -> int:
        return len(self.lengths) // 2

    @property
    def reference_sequences(self) -> int:
        """Sequences DPO's reference is computed for: both of each pair."""
        return len(self.lengths)

    def _row(self, r: int):
        p0, p1 = self.bounds[r], self.bounds[r + 1]
        a, b = 2 * p0, 2 * p1  # the row's sequences
        skip = np.zeros(b - a, dtype=np.int64)
        skip[1::2] = self.shared[p0:p1]  # a rejected sequence starts at its prompt's last shared token
        starts, lengths = self.offsets[a:b] + skip, self.lengths[a:b] - skip
        index = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # within segment
        t0, t1 = self.offsets[a], self.offsets[b]  # one contiguous read of the stream, then the segments
        at = np.repeat(starts - t0, lengths) + index
        ids = np.asarray(self.ids[t0:t1], dtype=np.int64)[at]
        labels = np.where(np.asarray(self.mask[t0:t1])[at] > 0, ids, IGNORE_INDEX)
        labels[np.cumsum(lengths) - lengths] = IGNORE_INDEX  # a segment's first token is predicted from the one before
        positions = index + np.repeat(skip, lengths)
        sequence = np.repeat(np.arange(b - a), lengths)  # 2k, 2k+1: the row's k-th pair
        # the chosen tokens a rejected one may attend to: its pair's prompt 0…P-2
        visible = (sequence % 2 == 0) & (index < np.repeat(self.shared[p0:p1], 2)[sequence])
        return ids, labels, positions, sequence, visible

    def prompt_ids(self, row: int) -> list[int]:
        """The prompt of the row's first pair (its chosen sequence's tokens before the first trained one)."""
        return self.prompt_of(2 * int(self.bounds[row]))

    def batch(self, indices) -> Batch:
        rows = [self._row(int(r)) for r in indices]
        width = self.width(rows)
        input_ids, labels, positions = padded(rows, width, self.pad_id)
        sequence_ids = torch.full((len(rows), width), -1, dtype=torch.long)
        visible = torch.zeros((len(rows), width), dtype=torch.bool)
        sequences_before = 0
        for i, (ids, _, _, seq, vis) in enumerate(rows):
            n = len(ids)
            sequence_ids[i, :n] = torch.from_numpy(seq) + sequences_before
            visible[i, :n] = torch.from_numpy(vis)
            sequences_before += int(seq[-1]) + 1 if n else 0
        reference = None
        if self.reference_logps is not None:  # the sequences of these rows, in the batch's order
            reference = torch.cat([self.reference_logps[2 * self.bounds[int(r)]: 2 * self.bounds[int(r) + 1]]
                                   for r in indices])
        # Positions are always given: a row holds two sequences at least, whose positions restart.
        # Unshared, the mask is built from them (Batch.model_inputs); shared, the batch carries it.
        mask = shared_prompt_mask(sequence_ids, visible) if self.shared_prompt else None
        margins = None
        if self.margins is not None:
            margins = torch.from_numpy(np.concatenate([self.margins[self.bounds[int(r)]: self.bounds[int(r) + 1]]
                                                       for r in indices]))
        return Batch(input_ids, labels, positions, sequence_ids, reference, mask, margins)


@dataclass
class PreferenceData(SequenceData):
    def describe(self) -> str:
        s = self.stats
        shared = (f"the shared prompt (data.shared_prompt) saved {s['shared_prompt_saved_tokens']} tokens, "
                  f"{s['shared_prompt_saved_share']:.1%} of the pairs' two sequences" if s.get("shared_prompt") else
                  "each pair's prompt laid out twice (data.shared_prompt=false)")
        return self.described(f"preference: {s['train_pairs']} train + {s['val_pairs']} validation pairs", "one pair",
                              f"{shared}; skipped {s['skipped_identical']} with identical answers and "
                              f"{s['skipped_empty']} with an empty one, dropped {s['dropped_long']} longer than "
                              "data.seq_len as laid out in a row")


def open_pairs(folder: Path, packing: bool, shared_prompt: bool = False) -> PreferenceData:
    # two sequences a pair: its chosen, then its rejected
    rows_class = functools.partial(PairRows, shared_prompt=shared_prompt)
    train, val, stats = open_rows(folder, packing, rows_class, lambda stats, split: 2 * stats[f"{split}_pairs"])
    saved = train.saved_tokens
    stats = {**stats, "shared_prompt": shared_prompt, "shared_prompt_saved_tokens": saved,
             "shared_prompt_saved_share": round(saved / max(1, train.tokens + saved), 4)}
    if stats.get("margin_field"):
        for split, rows in (("train", train), ("val", val)):
            rows.margins = np.fromfile(folder / f"{split}.margins.bin", dtype=np.float32, count=rows.pairs)
    return PreferenceData(train, val, stats, folder)
