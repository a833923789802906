"""Chat and prompt/completion examples in the token cache, and the rows the trainer takes from them.

An entry is a sequence kind's (cputrain.data.sequences: the streams, how they are opened), one
sequence an example. Packing (data.packing) puts whole examples into rows of data.seq_len in
corpus order: the next example goes into the current row if it fits, else it opens a new row
(next-fit), so a row is one contiguous run of the ids and no example is ever split. Position ids
restart at each example; a block-diagonal causal mask is built from them (cputrain.data.batch.packed_mask
under sdpa, transformers under eager), so no token attends to another example. The tail of a row is padding: never a target, positions of its own.
Without packing a row is one example, and a micro-batch is padded to its longest example (right
padding under a causal mask changes nothing before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cputrain.data.batch import IGNORE_INDEX, Batch, padded
from cputrain.data.sequences import SequenceData, SequenceRows, open_rows, pack_bounds


class ExampleRows(SequenceRows):
    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, seq_len: int, packing: bool,
                 pad_id: int):
        super().__init__(ids, mask, lengths, seq_len, packing, pad_id)
        self.bounds = pack_bounds(self.lengths, seq_len) if packing else np.arange(len(lengths) + 1, dtype=np.int64)

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.bounds[r], self.bounds[r + 1]
        t0, t1 = self.offsets[a], self.offsets[b]
        ids = np.asarray(self.ids[t0:t1], dtype=np.int64)
        labels = np.where(np.asarray(self.mask[t0:t1]) > 0, ids, IGNORE_INDEX)
        # An example's first token would be predicted from the example before it: never a target.
        labels[self.offsets[a:b] - t0] = IGNORE_INDEX
        # position within its own example: restart at every example of the row
        positions = np.arange(t1 - t0) - np.repeat(self.offsets[a:b] - t0, self.lengths[a:b])
        return ids, labels, positions

    def prompt_ids(self, example: int) -> list[int]:
        """An example's tokens before its first trained one: the prompt a model is asked to answer
        (for a chat, through the assistant's header)."""
        return self.prompt_of(example)

    def batch(self, indices) -> Batch:
        rows = [self._row(int(r)) for r in indices]
        input_ids, labels, positions = padded(rows, self.width(rows), self.pad_id)
        # One example per row starts at position 0 and runs on: the default positions say the same.
        return Batch(input_ids, labels, positions if self.packing else None)


@dataclass
class ExampleData(SequenceData):
    def describe(self) -> str:
        s = self.stats
        return self.described(f"{s['format']}: {s['train_examples']} train + {s['val_examples']} validation examples",
                              "one", f"skipped {s['skipped_no_answer']} without an answer{self._other_skips()}, "
                              f"dropped {s['dropped_long']} longer than data.seq_len, truncated {s['truncated']}")

    def _other_skips(self) -> str:
        """The conversations left out for their content, where there were any (caches before these
        counts have none)."""
        s = self.stats
        parts = [(s.get("skipped_non_text_parts", 0), "with a part that is not text"),
                 (s.get("skipped_tools_unsupported", 0), "with tool calls the chat template cannot write")]
        return "".join(f", {n} {what}" for n, what in parts if n)


def open_examples(folder: Path, packing: bool) -> ExampleData:
    train, val, stats = open_rows(folder, packing, ExampleRows, lambda stats, split: stats[f"{split}_examples"])
    return ExampleData(train, val, stats, folder)
