"""The machine a benchmark's figures were measured on: the line each block opens with, and its
physical cores (what the scripts size threads and ranks by)."""

from __future__ import annotations

import datetime
import os


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


def physical_cores() -> int:
    from cputrain.hardware import detect

    return detect().physical_cores
