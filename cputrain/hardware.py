"""What this machine is: cores, sockets, NUMA nodes, memory, CPU flags, torch build, peak FLOP/s.

Everything is read from Linux's /proc and /sys (with psutil for memory), so it works inside
containers and VMs, and every derived number carries the formula that produced it.
"""

from __future__ import annotations

import glob
import os
import platform
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import psutil

FLAGS_OF_INTEREST = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")

# FLOPs one core can retire per cycle, for the best instruction the CPU has. Two FMA pipes is
# what every server core of the last decade has (Skylake-SP and later, Zen 2 and later).
FMA_PIPES = 2
FP32_LANES = {"avx512f": 16, "avx2": 8}  # fp32 lanes per vector register
AMX_BF16_FLOP_PER_CYCLE = 1024  # one AMX TMUL: 16x32 bf16 tile-dot per cycle = 1024 FLOP
AVX512_BF16_FLOP_PER_CYCLE = FMA_PIPES * 32 * 2  # vdpbf16ps: 32 bf16 pairs, multiply+add


@dataclass(frozen=True)
class Core:
    """One physical core: the logical CPU we pin to, and where it sits."""

    cpu: int  # first logical CPU of the core (its hyper-thread sibling is left idle)
    socket: int
    numa_node: int


@dataclass
class HardwareFacts:
    cpu_model: str
    logical_cpus: int
    cores: list[Core]
    sockets: int
    numa_nodes: int
    memory_gib: float
    flags: dict[str, bool]
    clock_ghz: float
    clock_source: str
    torch_version: str
    torch_threads_default: int
    backends: dict[str, bool]
    peak_flops: dict[str, float] = field(default_factory=dict)
    peak_formula: dict[str, str] = field(default_factory=dict)
    # This process may run on fewer CPUs than its cgroup's cpuset holds: something bound it
    # (mpirun's binding, taskset, numactl). None where the cpuset cannot be read.
    affinity_narrowed: bool | None = None

    @property
    def physical_cores(self) -> int:
        return len(self.cores)

    @property
    def has_fast_bf16(self) -> bool:
        """bf16 matmuls run in hardware (AMX or AVX512-BF16), not emulated."""
        return self.flags.get("amx_bf16", False) or self.flags.get("avx512_bf16", False)


def read_system_file(path: str) -> str | None:
    """A /proc or /sys file's text, or None where this kernel or container has no such file."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _parse_cpu_list(text: str) -> list[int]:
    cpus = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def _cpuinfo() -> tuple[str, set[str], float | None]:
    text = read_system_file("/proc/cpuinfo") or ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)
    return (
        model.group(1) if model else platform.processor() or "unknown",
        set(flags.group(1).split()) if flags else set(),
        float(mhz.group(1)) / 1000 if mhz else None,
    )


def _clock_ghz(cpuinfo_ghz: float | None, cpu_model: str = "") -> tuple[float, str]:
    # The highest clock there is a record of: peak FLOP/s is about the best the core can do, and
    # a clock below the real one makes MFU exceed 100%. cpufreq's maximum (turbo included) where
    # the kernel shows it; else the rated base clock in the model name ("@ 2.60GHz"); else the
    # clock /proc/cpuinfo read at that moment (a VM often reports only the base clock there).
    max_khz = read_system_file("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if max_khz:
        return int(max_khz) / 1e6, "cpufreq max"
    rated = re.search(r"@\s*([\d.]+)\s*GHz", cpu_model)
    if rated:
        return float(rated.group(1)), "base clock in the CPU model name"
    if cpuinfo_ghz:
        return cpuinfo_ghz, "/proc/cpuinfo cpu MHz: no cpufreq maximum or rated clock is exposed; the real maximum may be higher"
    freq = psutil.cpu_freq()
    if freq and freq.max:
        return freq.max / 1000, "psutil max"
    return 2.0, "unknown, assumed 2.0 GHz"


def _numa_of_cpu() -> dict[int, int]:
    node_of = {}
    for node_dir in glob.glob("/sys/devices/system/node/node[0-9]*"):
        node = int(node_dir.rsplit("node", 1)[1])
        for cpu in _parse_cpu_list(read_system_file(f"{node_dir}/cpulist") or ""):
            node_of[cpu] = node
    return node_of


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cgroup_cpuset() -> set[int] | None:
    """The CPUs this process's cgroup allows (cgroup v2, then v1), or None where unreadable."""
    paths = []
    for line in (read_system_file("/proc/self/cgroup") or "").splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            paths.append(f"/sys/fs/cgroup{path.rstrip('/')}/cpuset.cpus.effective")
        elif "cpuset" in controllers.split(","):
            paths.append(f"/sys/fs/cgroup/cpuset{path.rstrip('/')}/cpuset.effective_cpus")
    # inside a container the cgroup's own folder is mounted as the root
    paths += ["/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"]
    for path in paths:
        text = read_system_file(path)
        if text:
            try:
                return parse_cpu_list(text)
            except ValueError:  # not a CPU list: judge nothing by it
                return None
    return None


def _physical_cores(allowed: set[int]) -> list[Core]:
    """One Core per (socket, core_id), among the CPUs this process may run on."""
    node_of = _numa_of_cpu()
    seen: dict[tuple[int, int], Core] = {}
    for cpu in sorted(allowed):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        socket = int(read_system_file(f"{base}/physical_package_id") or 0)
        core_id = int(read_system_file(f"{base}/core_id") or cpu)
        seen.setdefault((socket, core_id), Core(cpu=cpu, socket=socket, numa_node=node_of.get(cpu, 0)))
    return sorted(seen.values(), key=lambda c: (c.numa_node, c.socket, c.cpu))


def _backends() -> dict[str, bool]:
    import torch.distributed as dist

    found = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
        "ccl": False,
    }
    try:  # oneCCL registers the "ccl" backend as a side effect of this import
        import oneccl_bindings_for_pytorch  # noqa: F401

        found["ccl"] = True
    except Exception:
        pass
    return found


def peak_flops(flags: dict[str, bool], cores: int, clock_ghz: float) -> tuple[dict[str, float], dict[str, str]]:
    """Theoretical peak FLOP/s per precision, and the formula behind each number."""
    lanes_flag = "avx512f" if flags.get("avx512f") else "avx2" if flags.get("avx2") else None
    lanes = FP32_LANES.get(lanes_flag, 4)
    fp32_per_cycle = FMA_PIPES * lanes * 2 if (flags.get("fma") or lanes_flag == "avx512f") else lanes * 2
    peaks = {"fp32": cores * clock_ghz * 1e9 * fp32_per_cycle}
    formulas = {
        "fp32": f"{cores} cores × {clock_ghz:.2f} GHz × {fp32_per_cycle} FLOP/cycle "
        f"({FMA_PIPES if flags.get('fma') else 1} FMA pipes × {lanes} fp32 lanes ({lanes_flag or 'sse'}) × 2)"
    }
    if flags.get("amx_bf16"):
        bf16_per_cycle, how = AMX_BF16_FLOP_PER_CYCLE, "AMX tile multiply"
    elif flags.get("avx512_bf16"):
        bf16_per_cycle, how = AVX512_BF16_FLOP_PER_CYCLE, f"AVX512-BF16 dot product, {FMA_PIPES} pipes × 32 pairs × 2"
    else:
        # No bf16 instructions: PyTorch converts to fp32 and back; measured 100-300x below fp32.
        bf16_per_cycle, how = fp32_per_cycle / 100, "emulated: no AMX or AVX512-BF16, ≥100× below fp32"
    peaks["bf16"] = cores * clock_ghz * 1e9 * bf16_per_cycle
    formulas["bf16"] = f"{cores} cores × {clock_ghz:.2f} GHz × {bf16_per_cycle:g} FLOP/cycle ({how})"
    return peaks, formulas


# A container's memory limit: cgroup v2, then v1. A Kubernetes pod sees the whole node in
# /proc/meminfo but is killed at its limit, so what a rank may plan on is the smaller of the two.
CGROUP_MEMORY_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit_bytes(files: tuple[str, ...] = CGROUP_MEMORY_FILES) -> int | None:
    """This process's cgroup memory limit in bytes, or None where there is none ("max", v1's
    page-rounded 2^63, or no cgroup file)."""
    for path in files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
        return None
    return None


@lru_cache(maxsize=1)
def detect() -> HardwareFacts:
    import torch

    model, cpu_flags, cpuinfo_ghz = _cpuinfo()
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = _physical_cores(allowed)
    clock, clock_source = _clock_ghz(cpuinfo_ghz, model)
    flags = {name: name in cpu_flags for name in FLAGS_OF_INTEREST}
    peaks, formulas = peak_flops(flags, len(cores), clock)
    return HardwareFacts(
        cpu_model=model,
        logical_cpus=len(allowed),
        cores=cores,
        sockets=len({c.socket for c in cores}),
        numa_nodes=len({c.numa_node for c in cores}),
        memory_gib=min(psutil.virtual_memory().total, memory_limit_bytes() or float("inf")) / 2**30,
        flags=flags,
        clock_ghz=clock,
        clock_source=clock_source,
        torch_version=torch.__version__,
        torch_threads_default=torch.get_num_threads(),
        backends=_backends(),
        peak_flops=peaks,
        peak_formula=formulas,
        affinity_narrowed=None if (cpuset := cgroup_cpuset()) is None else set(allowed) < cpuset,
    )


def report_lines(hw: HardwareFacts) -> list[str]:
    """The text `cputrain doctor` prints."""
    import torch

    flags = "  ".join(f"{k}={'yes' if v else 'no'}" for k, v in hw.flags.items())
    lines = [
        f"CPU            {hw.cpu_model}",
        f"cores          {hw.physical_cores} physical ({hw.logical_cpus} logical CPUs usable), "
        f"{hw.sockets} socket(s), {hw.numa_nodes} NUMA node(s)",
        f"memory         {hw.memory_gib:.1f} GiB",
        f"clock          {hw.clock_ghz:.2f} GHz ({hw.clock_source})",
        f"flags          {flags}",
        f"torch          {hw.torch_version}, mkldnn={'on' if torch.backends.mkldnn.is_available() else 'off'}, "
        f"{hw.torch_threads_default} threads by default",
        "backends       " + "  ".join(f"{k}={'yes' if v else 'no'}" for k, v in hw.backends.items()),
    ]
    for precision, flops in hw.peak_flops.items():
        lines.append(f"peak {precision:<9} {flops / 1e9:9.1f} GFLOP/s = {hw.peak_formula[precision]}")
    return lines
