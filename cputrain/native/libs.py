"""Which native runtime libraries this machine has for a training process: a malloc
(tcmalloc or jemalloc) and Intel's OpenMP runtime (libiomp5, PyPI's `intel-openmp`).

torch's CPU wheel runs its thread pool on the GNU OpenMP runtime it ships (libgomp). Intel's
runtime can be preloaded instead (with KMP_AFFINITY/KMP_BLOCKTIME), and a malloc with per-thread
caches can replace glibc's. `cputrain doctor` says what is installed; the launcher preloads the
malloc into ranks it starts (hardware.allocator). Whether libiomp5 pays has not been measured, so
it is reported, not preloaded.
"""

from __future__ import annotations

import glob
import os
import sys


def find_intel_openmp() -> str | None:
    """libiomp5.so from the `intel-openmp` wheel (installed under the environment's lib/), if any."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.environ.get("CONDA_PREFIX") or "")):
        if prefix:
            hits = sorted(glob.glob(os.path.join(prefix, "lib", "libiomp5.so*")))
            if hits:
                return hits[0]
    return None


def report_lines() -> list[str]:
    from cputrain.native.allocator import find_allocator
    from cputrain.native.openmp_waits import WAITS_TEXT

    malloc = find_allocator()
    iomp = find_intel_openmp()
    return [
        "malloc         " + (f"{malloc} (preloaded into every rank cputrain starts, also a one-process run; "
                             "hardware.allocator=system turns it off)"
                             if malloc else "glibc (tcmalloc not installed: apt install libtcmalloc-minimal4, or make "
                                            "install; measured 1.00–1.17× glibc's tokens/s in fp32 on one unsharded "
                                            "rank, 1.54× on an fsdp rank and 1.59× on a zero3 rank fetching module by module, in bf16)"),
        "OpenMP         " + (f"torch's libgomp; Intel's libiomp5 is installed at {iomp} (not preloaded: "
                             "its effect is not measured yet)" if iomp else
                             "torch's libgomp (Intel's libiomp5 not installed: pip install intel-openmp)"),
        f"               `cputrain train` sets {WAITS_TEXT} where neither is set (cputrain/native/openmp_waits.py)",
    ]
