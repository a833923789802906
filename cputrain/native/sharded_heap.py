"""glibc's heap under a sharding strategy: a block's gathered tensors mapped, the rest kept, all of
it trimmed once a step.

A sharded rank frees large tensors all the time: each micro-batch gathers every block's parameters
and frees them, and makes each block's unsharded gradients and frees them. glibc as is (its mmap
threshold pinned at 128 KiB, so those frees leave the process: pin_mmap_threshold) also maps every
activation of 128 KiB or more on allocation and unmaps it when freed, so the kernel zeroes each of
their pages again every micro-batch. glibc told to keep everything (hardware.allocator=glibc-tuned)
takes that cost away but keeps what a step freed in the process.

In between, measured on one 2-core AVX512-BF16 EPYC (~100M Llama, bf16, 2 FSDP ranks, seq 512,
4 micro-batches of 2; one run each, docs/benchmarks/network.md block sharded_rank has the
alternated figures): glibc as is 14.40 s a step at a 1.57 GiB step peak; kept 9.60 s at 2.33 GiB;
kept and trimmed each step 10.42 s at 2.10 GiB; mapped from half a block's parameters up, the rest
kept and trimmed each step 11.13 s at 1.71 GiB (DDP: 10.76 s at 2.90 GiB). So from the end of the
first step (the whole-model init replica freed by then, at the 128 KiB pin) a rank maps only
tensors of half its block's gathered parameters or more, keeps the smaller (activations) in the
heap, and hands the heap's free pages back at each step's end (malloc_trim).
"""

from __future__ import annotations

import ctypes

from cputrain.native.allocator import INT_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES

# glibc refuses a larger mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): tensors above it are
# mapped whatever is asked; at that size the pages' zeroing is small beside their compute.
MAX_MMAP_THRESHOLD_BYTES = 32 * 2**20


def mmap_threshold_bytes(block_param_bytes: int) -> int:
    """Half of one block's gathered parameters, within glibc's bounds: the gathered parameters and
    unsharded gradients (a block or more) are mapped, the activations (smaller, at the shapes
    cputrain plans) stay in the heap."""
    return max(MMAP_THRESHOLD_BYTES, min(MAX_MMAP_THRESHOLD_BYTES, block_param_bytes // 2))


class ShardedHeap:
    """Call after_step() at the end of every optimizer step of a sharded rank."""

    def __init__(self, block_param_bytes: int):
        self.threshold_bytes = mmap_threshold_bytes(block_param_bytes)
        self.set = False
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc: nothing to tune
            self._libc = None

    def after_step(self) -> None:
        if self._libc is None:
            return
        try:
            if not self.set:  # the heap's free pages are handed back by the trim below, not on each free
                self._libc.mallopt(M_MMAP_THRESHOLD, self.threshold_bytes)
                self._libc.mallopt(M_TRIM_THRESHOLD, INT_MAX)
                self.set = True
            self._libc.malloc_trim(0)
        except AttributeError:  # a libc without mallopt/malloc_trim (a preloaded tcmalloc does not matter)
            self._libc = None


def block_param_bytes(blocks, compute_itemsize: int) -> int:
    """The largest decoder block's parameters at the compute dtype's element size (what one gather makes)."""
    return max((sum(p.numel() for p in block.parameters()) for block in blocks), default=0) * compute_itemsize
