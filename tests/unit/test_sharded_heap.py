"""The sharded heap (cputrain.native.sharded_heap): its threshold from a block's size, and glibc
really mapping only blocks at or above it after a step. The heap is set in a child interpreter:
mallopt changes the whole process, and a test's process must not keep what another test set."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cputrain.native.allocator import MMAP_THRESHOLD_BYTES
from cputrain.native.sharded_heap import MAX_MMAP_THRESHOLD_BYTES, mmap_threshold_bytes


def test_threshold_is_half_a_block_within_glibcs_bounds():
    assert mmap_threshold_bytes(14_000_000) == 7_000_000  # ~100M Llama's block in bf16
    assert mmap_threshold_bytes(436 * 2**20) == MAX_MMAP_THRESHOLD_BYTES  # an 8B block: glibc's ceiling
    assert mmap_threshold_bytes(10_000) == MMAP_THRESHOLD_BYTES  # a toy block: glibc's own floor


CHILD = textwrap.dedent("""
    import ctypes
    from cputrain.native.allocator import pin_mmap_threshold
    from cputrain.native.sharded_heap import ShardedHeap

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    class Info(ctypes.Structure):  # glibc's struct mallinfo2, whole: it is returned by value
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                         "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = Info

    def mapped_after_malloc(size):
        p = libc.malloc(size)
        mapped = libc.mallinfo2().hblks
        libc.free(p)
        return mapped

    pin_mmap_threshold()  # what the strategy does before the model is built
    base = libc.mallinfo2().hblks
    before = mapped_after_malloc(4 << 20) - base  # 4 MiB: mapped at the 128 KiB pin
    heap = ShardedHeap(16 << 20)  # a block of 16 MiB: threshold 8 MiB
    heap.after_step()
    small = mapped_after_malloc(4 << 20) - base  # now from the heap
    large = mapped_after_malloc(12 << 20) - base  # still mapped
    print(before, small, large)
""")


def test_after_a_step_activations_come_from_the_heap_and_blocks_are_mapped():
    try:
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    except subprocess.CalledProcessError as exc:
        if "mallinfo2" in exc.stderr:
            pytest.skip("this libc has no mallinfo2 (glibc ≥ 2.33)")
        raise
    assert out.stdout.split() == ["1", "0", "1"], out.stdout
