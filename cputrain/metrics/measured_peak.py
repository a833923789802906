"""The measured peak: what a large matmul of the run's dtype reaches on this machine's cores.

The theoretical peak (cores × clock × FLOP/cycle, cputrain.hardware) assumes the best clock and
every cycle busy; a matmul never gets there (on a Xeon with AMX, 2 threads: 5.3 TFLOP/s in theory,
1.4–1.7 TFLOP/s measured for a 4096² bf16 product). MFU against both tells apart "the step wastes the machine" from "the
machine is slower than its data sheet". The matmul is timed once per machine, dtype and thread
count and cached, so runs and `cputrain doctor` do not pay for it again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

MAX_N = 4096  # large enough to leave the matrix units, not memory, as the limit
TARGET_S = 0.2  # time one timed product should take: small sizes where bf16 is emulated


def cache_file() -> Path:
    root = os.environ.get("CPUTRAIN_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "cputrain")
    return Path(root) / "measured_peak.json"


def _key(cpu_model: str, flags: dict[str, bool], threads: int, dtype: torch.dtype) -> str:
    on = ",".join(sorted(k for k, v in flags.items() if v))
    return f"{cpu_model}|{on}|threads={threads}|torch={torch.__version__}|{str(dtype).removeprefix('torch.')}"


def time_matmul(n: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """FLOP/s of an n×n×n product: the best of `repeats` after one untimed call."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure(dtype: torch.dtype) -> tuple[float, int]:
    """(FLOP/s, n): grow n from 512 until a product takes TARGET_S or n reaches MAX_N."""
    n = 512
    while True:
        rate = time_matmul(n, dtype, repeats=1 if n < MAX_N else 3)
        seconds = 2 * n**3 / rate
        if n >= MAX_N or seconds >= TARGET_S:
            return (time_matmul(n, dtype) if n < MAX_N else rate), n
        n = min(MAX_N, n * 2)


def measure_apart(dtype: torch.dtype, threads: int) -> tuple[float, int]:
    """measure(dtype) in a child interpreter on this process's cores and `threads` threads.

    A training rank times the product this way: timed in the rank itself, its 4096² operands and
    oneDNN's buffers stay in the rank's heap (78 MiB of RSS through every step on a 64M LoRA run in
    bf16, 1 thread), so a run's memory would depend on whether this machine had timed that dtype
    before. Where the child cannot run, it is timed here after all."""
    name = str(dtype).removeprefix("torch.")
    try:
        done = subprocess.run([sys.executable, "-m", __name__, name, str(threads)], capture_output=True, text=True,
                              timeout=600, check=True)
        flops, n = json.loads(done.stdout.strip().splitlines()[-1])
        return float(flops), int(n)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return measure(dtype)


def measured_peak_flops(cpu_model: str, flags: dict[str, bool], threads: int, dtype: torch.dtype,
                        remeasure: bool = False, apart: bool = False) -> tuple[float, str]:
    """(FLOP/s, how it was measured), from the cache or timed now with the current torch threads
    (`apart`: in a child interpreter with `threads` threads, leaving this process's memory as it was).

    With `remeasure`, timed again and the cache keeps the higher figure: a product timed while
    other work shared the cores reads low, never high.
    """
    path, key = cache_file(), _key(cpu_model, flags, threads, dtype)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached and not remeasure:
        entry = cached[key]
        return entry["flops"], entry["how"]
    flops, n = measure_apart(dtype, threads) if apart else measure(dtype)
    how = f"torch.mm {n}×{n}×{n} {str(dtype).removeprefix('torch.')}, {threads} thread(s), best of 3"
    if key in cached and cached[key]["flops"] >= flops:
        return cached[key]["flops"], cached[key]["how"]
    cached[key] = {"flops": flops, "how": how}
    try:  # atomic: ranks measuring side by side never read a torn file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
    return flops, how


def machine_peaks(hw, threads: int, remeasure: bool = True) -> dict[str, tuple[float, str]]:
    """{precision: (measured FLOP/s, how)} for every precision `hw` has a theoretical peak for
    (`cputrain doctor` times them again each time; the cache keeps the best)."""
    import torch

    torch.set_num_threads(threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {p: measured_peak_flops(hw.cpu_model, hw.flags, threads, dtypes[p], remeasure) for p in hw.peak_flops}


if __name__ == "__main__":  # measure_apart's child: python -m cputrain.metrics.measured_peak DTYPE THREADS
    torch.set_num_threads(int(sys.argv[2]))
    print(json.dumps(measure(getattr(torch, sys.argv[1]))))
