"""Which sequences each optimizer step uses, from the seed and the global step alone.

The stream is a chain of seeded permutations of the training sequences (one per epoch).
Step s takes positions [s·G, (s+1)·G) of that stream, G = global batch; rank r takes the
r-th contiguous share of those and cuts it into micro-batches. Nothing depends on the world
size except the cut, so a run resumed on 1, 2 or 4 ranks continues the very same stream,
without repeating or skipping a sequence.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


class BatchOrder:
    def __init__(self, n_sequences: int, global_batch: int, seed: int):
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
