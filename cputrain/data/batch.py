"""A micro-batch as the model takes it, and the rows of packed text it is cut from.

Every kind of data gives the trainer rows with `len(rows)` and `rows.batch(indices)`: packed text
(TokenRows: every token a label, positions 0…seq_len-1), and chat or prompt/completion examples
(cputrain.data.examples.ExampleRows: labels only on answers, positions restarting per example),
and preference pairs (cputrain.data.pairs.PairRows: as examples, with the sequence of each token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100  # a label the loss skips (transformers' and the chunked loss's rule)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [micro-batch, tokens]
    labels: torch.Tensor  # [micro-batch, tokens]; the model shifts them: token t+1 is t's target
    position_ids: torch.Tensor | None = None  # None: 0 … tokens-1 in every row
    # Preference pairs (cputrain.data.pairs): the micro-batch's sequence each token is in, 2p for
    # pair p's chosen, 2p+1 for its rejected, -1 padding. None for text and examples.
    sequence_ids: torch.Tensor | None = None
    # DPO's reference log-probabilities of those sequences (summed), where they were computed
    # before training (full weights: cputrain.objectives); None: computed live, or not wanted.
    reference_logps: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        """Preference pairs in the micro-batch (0 for text and examples)."""
        return 0 if self.sequence_ids is None else (int(self.sequence_ids.max()) + 1) // 2

    @property
    def trained_targets(self) -> int:
        """Targets that carry loss (the first position of a row is never a target)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def model_inputs(self) -> dict:
        # use_cache=False: training keeps no KV cache, and with one transformers skips building the
        # block-diagonal mask from packed position ids, silently letting examples attend to each
        # other (measured: 0.5 logit error on the second of two packed examples with the cache on).
        inputs = {"input_ids": self.input_ids, "labels": self.labels, "use_cache": False}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs


class TokenRows:
    """Packed text: rows of a [n, seq_len] token array (memory-mapped); every token is a label."""

    def __init__(self, sequences: np.ndarray):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def prompt_ids(self, row: int) -> None:
        return None  # text has no prompts: a text model is sampled from a word of its own

    def batch(self, indices) -> Batch:
        tokens = torch.from_numpy(np.ascontiguousarray(self.sequences[indices], dtype=np.int64))
        return Batch(tokens, tokens)
