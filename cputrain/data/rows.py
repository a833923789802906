"""The rows protocol: what the trainer and evaluation take micro-batches from, for every kind of data."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cputrain.data.batch import Batch


@runtime_checkable
class Rows(Protocol):
    def __len__(self) -> int:
        """Rows in this split."""

    def batch(self, indices) -> Batch:
        """The micro-batch of these rows."""

    def prompt_ids(self, row: int) -> list[int] | None:
        """The prompt of a row's first example (what sample.txt answers), or None for text."""
