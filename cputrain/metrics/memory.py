"""Resident memory of this process: now, and the high-water mark since the last reset.

Linux keeps the high-water mark (VmHWM) per process; writing 5 to /proc/self/clear_refs resets
it, which lets us measure the peak of one phase (loading, a training step) on its own.
"""

from __future__ import annotations

import resource

import psutil

GIB = 2**30


def rss_gib() -> float:
    return psutil.Process().memory_info().rss / GIB


def peak_rss_gib() -> float:
    """Highest RSS since the last `reset_peak()` (or process start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
