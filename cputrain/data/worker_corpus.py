"""The corpus as a tokenizing worker reads it, whatever the kind of data.

Each worker opens the corpus's Arrow files itself (memory-mapped: nothing is sent to it but row
numbers), and maps them afresh after reading REMAP_EVERY_CHARS of text: pages of a mapped file
that were read stay in the process's RSS until unmapped, and would grow with the corpus.
Imports stay light: a spawned worker needs no torch.
"""

from __future__ import annotations

# A worker re-opens its memory map after reading this much text.
REMAP_EVERY_CHARS = 64_000_000


def open_arrow(arrow_files: list[str]):
    import datasets

    datasets.disable_progress_bars()
    return datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in arrow_files])


class WorkerCorpus:
    """A worker's records: its own mapping of `arrow_files`, or `dataset` as given where there are
    none (a worker in the builder's own process, or a test's records)."""

    def __init__(self, arrow_files: list[str] | None, dataset):
        self.files = arrow_files
        self.dataset = dataset if arrow_files is None else open_arrow(arrow_files)
        self.chars_since_open = 0

    def __getitem__(self, rows: slice) -> dict:
        """Records `rows` as columns (field → values)."""
        return self.dataset[rows]

    def read(self, chars: int) -> None:
        """Count `chars` of text read; past REMAP_EVERY_CHARS, map the files afresh."""
        self.chars_since_open += chars
        if self.files is not None and self.chars_since_open > REMAP_EVERY_CHARS:
            self.dataset = None  # drop the old mapping before the new one exists
            self.dataset, self.chars_since_open = open_arrow(self.files), 0
