"""Writes a benchmark's figures into its own block of a page of docs/benchmarks/.

Each script owns the block between `<!-- bench: NAME -->` and `<!-- /bench: NAME -->` and
replaces only that, so scripts can be rerun one at a time; which page and section a block
belongs to is registered in benchmarks/pages.py.
"""

from __future__ import annotations

import datetime
import os
import re
import statistics
from pathlib import Path

from benchmarks.pages import DOCS, insert_into_section, place_of


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


def write_block(name: str, markdown: str, docs: Path = DOCS) -> None:
    """Block `name` replaced where it stands on its page, or, new there, added at the end of its
    section; a name benchmarks/pages.py does not register is refused before anything is written."""
    page_name, section = place_of(name)
    page = docs / page_name
    start, end = f"<!-- bench: {name} -->", f"<!-- /bench: {name} -->"
    text = page.read_text() if page.exists() else ""
    block = f"{start}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else insert_into_section(text, section, block)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
