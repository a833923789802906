"""Writes a benchmark's figures into its own block of docs/benchmarks.md.

Each script owns the block between `<!-- bench: NAME -->` and `<!-- /bench: NAME -->` and
replaces only that, so scripts can be rerun one at a time.
"""

from __future__ import annotations

import datetime
import os
import re
import statistics
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def machine_line() -> str:
    """One line naming the machine, from cputrain's own hardware detection."""
    import torch

    from cputrain.hardware import detect

    hw = detect()
    flags = ", ".join(k for k, v in hw.flags.items() if v) or "none of interest"
    # The flags say what the CPU has; with ATEN_CPU_CAPABILITY torch's own kernels use less of it
    # (not the matmuls: MKL and oneDNN choose their instructions themselves).
    limited = os.environ.get("ATEN_CPU_CAPABILITY")
    kernels = (f"ATEN_CPU_CAPABILITY={limited} (torch's own kernels limited to {limited.upper()}, not MKL's or "
               f"oneDNN's matmuls; "
               f"torch.backends.cpu.get_cpu_capability() reports {torch.backends.cpu.get_cpu_capability()}); "
               if limited else "")
    return (
        f"Machine: {hw.cpu_model}, {hw.physical_cores} physical cores, {hw.memory_gib:.0f} GiB, "
        f"flags {flags}; torch {torch.__version__}; {kernels}measured {datetime.date.today().isoformat()}."
    )


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_block(name: str, markdown: str, doc: Path = DOC) -> None:
    start, end = f"<!-- bench: {name} -->", f"<!-- /bench: {name} -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
