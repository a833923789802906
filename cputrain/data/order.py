"""Which sequences each optimizer step uses, from the seed and the global step alone.

The stream is a chain of seeded permutations of the training sequences (one per epoch).
Step s takes positions [s·G, (s+1)·G) of that stream, G = global batch; rank r takes the
r-th contiguous share of those and cuts it into micro-batches. Nothing depends on the world
size except the cut, so a run resumed on 1, 2 or 4 ranks continues the very same stream,
without repeating or skipping a sequence.

A step takes each training row at most once: a global batch larger than the training set would
take rows twice or more inside one step (8 pairs packed into 1 row, a batch of 8: the same row 8
times a step, epoch 8.0 after step 1), the same gradient at that many times the compute. It is
refused before the model is built (`check_batch_fits`), saying how many rows, and pairs, the data
made and what batch fits: trained "once per step" instead, the run would train another batch than
the one set, and its learning rate and step count were chosen for that one.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from cputrain.config.sections import TrainConfig, batch_key
from cputrain.errors import ConfigError


def check_batch_fits(train: TrainConfig, rows: int, world_size: int, pairs: int | None = None,
                     rows_per_step: int | None = None) -> None:
    """Refuse a global batch of more rows than the training set holds, in one line that says what
    the data made (`pairs`: the preference pairs in those rows) and the largest batch that fits.
    `rows_per_step`: the rows a step takes where it is not the global batch (online RL's prompts)."""
    batch = train.global_batch_size if rows_per_step is None else rows_per_step
    if batch <= rows:
        return
    key, micro = batch_key(train), train.micro_batch_size
    held = f" holding {pairs} preference pair{'s' * (pairs != 1)}" if pairs is not None else ""
    if rows < world_size:
        fix = f"train on at most {rows} rank(s), or on more data"
    else:
        micro = min(micro, rows // world_size)
        fits = rows // (micro * world_size) * micro * world_size
        fix = f"set {key}={fits}" + (f" and train.micro_batch_size={micro}" if micro != train.micro_batch_size else "")
    if pairs is not None and train.global_batch_pairs is None and pairs != rows:  # unpacked, the pairs are rows
        fix += (f", or set the batch in pairs, one a row, as TRL counts it: train.global_batch_pairs="
                f"{min(batch, pairs)} with data.packing=false")
    raise ConfigError(f"{key} ({batch}) is more than the training set: {rows} row{'s' * (rows != 1)}{held}; a step "
                      f"would train the same rows several times over; {fix}")


def pairs_per_step(train: TrainConfig, rows: int, pairs: int) -> str:
    """What a step holds in preference pairs, the unit TRL counts its batch in."""
    batch = train.global_batch_size
    if pairs == rows:
        return f"{batch} preference pairs a step, one a row"
    per_row = pairs / rows
    return (f"{batch} rows a step, about {batch * per_row:.0f} preference pairs ({per_row:.2g} a packed row; each "
            "step logs its own count); TRL counts its batch in pairs: train.global_batch_pairs with "
            "data.packing=false sets it so")


class BatchOrder:
    def __init__(self, n_sequences: int, global_batch: int, seed: int):
        if global_batch > n_sequences:  # check_batch_fits says so to the user first
            raise ValueError(f"a global batch of {global_batch} takes rows twice in a step of {n_sequences} rows")
        self.n = n_sequences
        self.global_batch = global_batch
        self.seed = seed

    @lru_cache(maxsize=4)
    def _epoch_perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def step_indices(self, step: int) -> np.ndarray:
        """The G sequence indices of global step `step` (0-based)."""
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        out = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(positions // self.n):
            mask = positions // self.n == epoch
            out[mask] = self._epoch_perm(int(epoch))[positions[mask] % self.n]
        return out

    def rank_micro_batches(self, step: int, rank: int, world_size: int, micro_batch: int) -> list[np.ndarray]:
        share = self.global_batch // world_size
        mine = self.step_indices(step)[rank * share : (rank + 1) * share]
        return [mine[i : i + micro_batch] for i in range(0, share, micro_batch)]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.n
