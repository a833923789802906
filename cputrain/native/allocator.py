"""Which malloc the ranks run on: tcmalloc where installed, else glibc tuned, by measurement.

glibc malloc returns freed blocks slowly and fragments under the many short-lived activation
tensors of a training step. Measured with `cputrain train`, each malloc preloaded in turn, tokens/s
against glibc's:
- fp32 on a 2-core AVX2 EPYC (benchmarks/step_time/fp32_choices.py): tcmalloc 1.03× at the demo's shape,
  1.00–1.02× at ~100M, 1.17× with a 128k-vocabulary head; jemalloc 0.92×, 0.95–1.00×, 0.97×;
- bf16 on a 2-core AVX512-BF16 EPYC (benchmarks/memory/allocator.py): tcmalloc 1.04× on the demo, 1.28×
  fully fine-tuning ~100M, 1.12× with LoRA on ~300M; jemalloc 0.93×, 0.95×, 0.74×.
So `auto` preloads tcmalloc, in both precisions and modes; jemalloc is there for whoever measures
it better on their machine (hardware.allocator=jemalloc). tcmalloc's price is memory: it keeps
freed blocks for reuse, and the bf16 step peaks were 1.19× glibc's at ~100M and 1.37× with LoRA
(0.92× on the demo); hardware.allocator=system trades that speed back for memory.

A bare install has no tcmalloc (a system package). There, on single and ddp, `auto` tells glibc
itself to keep what a step frees (glibc-tuned, tune_glibc: no mmap, no trimming): measured the
same way in bf16, 1.19× glibc as is on the demo, 1.04× at ~100M, 1.13× with LoRA on ~300M, at the
same step peak (tcmalloc on that run: 1.33×, 1.13×, 1.14×, at 1.19× and 1.55× the step peak); in
fp32 1.17×, 0.92× and 1.10× (the ~100M full run the one loss, within its runs' spread of 196–218
tokens/s against 225–226), so auto takes it in both precisions.
fsdp and zero3 keep glibc as is: they pin its mmap threshold so that what a rank frees of the
gathered parameters leaves the process (pin_mmap_threshold). That pin is most of what a sharded rank
costs on glibc: every gathered block, and every activation over 128 KiB, is mapped and zeroed again
each micro-batch. tcmalloc keeps freed spans for the next allocation of their size, so a sharded
rank on it computes at about the single strategy's speed (SHARDED_MEASURED), at a step peak a few
percent higher under fsdp; `make install` installs it (scripts/install-tcmalloc.sh), the training
image has it, and the time plan's sharded factors are per allocator (plan.time.sharded_compute).

A library can only be preloaded into a process that has not started yet: the agent sets
LD_PRELOAD for the ranks it starts, and a one-process `cputrain train` starts itself again with it
(reexec_env) before anything is imported.
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass

# Files per allocator, in order of preference. gperftools' full tcmalloc (libgoogle-perftools4)
# was measured; its minimal build (libtcmalloc-minimal4) is the same allocator without the profiler.
_NAMES = {"tcmalloc": ("libtcmalloc.so*", "libtcmalloc_minimal.so*"), "jemalloc": ("libjemalloc.so*",)}
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
# What `auto` cites, per precision of the run (the module docstring has the figures' machines).
MEASURED = {
    "fp32": ("fp32 tokens/s against glibc on a 2-core AVX2 EPYC: tcmalloc 1.03× at the demo's shape, 1.00–1.02× "
             "at ~100M, 1.17× with a 128k-vocabulary head; jemalloc 0.92–1.00× (benchmarks/step_time/fp32_choices.py)"),
    "bf16": ("bf16 tokens/s against glibc on a 2-core AVX512-BF16 EPYC: tcmalloc 1.04× on the demo, 1.28× on ~100M, "
             "1.12× with LoRA on ~300M, at up to 1.37× glibc's step peak; jemalloc 0.74–0.95× "
             "(benchmarks/memory/allocator.py)"),
}


def measured(precision: str | None) -> str:
    """The measurement behind `auto` for a run of this precision (both, when it is not resolved yet)."""
    return MEASURED.get(precision or "", "; ".join(MEASURED.values()))


# Set in a process cputrain started again with the allocator preloaded: never start it a third time.
REEXEC_MARK = "CPUTRAIN_ALLOCATOR_PRELOADED"


@dataclass(frozen=True)
class AllocatorChoice:
    name: str  # tcmalloc | jemalloc | glibc-tuned | system
    library: str | None
    reason: str


# What `auto` takes where no tcmalloc is installed, on strategies that keep whole tensors per rank
# (single, ddp): glibc told to keep what a step frees (tune_glibc). The sharding strategies keep
# glibc as is: their memory is the point, and fsdp/zero3 pin its mmap threshold (pin_mmap_threshold).
# What benchmarks/memory/allocator.py measured, by the run's precision (tokens/s against glibc as is).
GLIBC_TUNED_MEASURED = {
    "bf16": ("measured on bf16 runs of a 2-core AVX512-BF16 EPYC at 1.19× glibc as is on the demo, 1.04× on ~100M, "
             "1.13× with LoRA on ~300M, at the same step peak (benchmarks/memory/allocator.py)"),
    "fp32": ("measured on fp32 runs of a 2-core AVX512-BF16 EPYC at 1.17× glibc as is on the demo, 0.92× on ~100M "
             "fully fine-tuned, 1.10× with LoRA on ~300M, at the same step peak (benchmarks/memory/allocator.py)"),
}
SHARDED = ("fsdp", "zero3")
# What a sharded rank loses without tcmalloc (benchmarks/network/sharded_rank.py, block sharded_rank; zero3
# as it runs now, each block fetched whole: zero3_fetch.py): on glibc it maps and zeroes its gathered
# blocks and activations again every micro-batch.
SHARDED_MEASURED = ("one rank alone at ~100M in bf16 on a 2-core AVX512-BF16 EPYC, tcmalloc against glibc as is: fsdp "
                    "full_shard 1.54× faster, zero3 1.59× (fetching module by module); on tcmalloc within 1.09× (fsdp) "
                    "and 1.03× (zero3) of the single strategy's step (benchmarks/network/sharded_rank.py, "
                    "zero3_fetch.py)")


def _search_dirs() -> list[str]:
    dirs = list(_DIRS)
    prefix = os.environ.get("CONDA_PREFIX")
    if prefix:
        dirs.insert(0, os.path.join(prefix, "lib"))
    return dirs


def find_allocator(name: str = "tcmalloc", dirs: list[str] | None = None) -> str | None:
    for pattern in _NAMES[name]:
        for d in dirs or _search_dirs():
            hits = sorted(glob.glob(os.path.join(d, pattern)))
            if hits:
                return hits[0]
    return None


def allocator_choice(setting: str, environ: dict | None = None, dirs: list[str] | None = None,
                     precision: str | None = None, strategy: str | None = None) -> AllocatorChoice:
    """What to put in LD_PRELOAD for the ranks, and why (setting = hardware.allocator; precision =
    the run's hardware.precision, which picks the measurement the reason cites; strategy = the
    run's parallel.strategy: without tcmalloc, auto tunes glibc on single and ddp only)."""
    env = os.environ if environ is None else environ
    auto_why = measured(precision)
    if setting == "system":
        return AllocatorChoice("system", None, "hardware.allocator=system: glibc malloc")
    if setting == "glibc-tuned":
        return AllocatorChoice("glibc-tuned", None, "hardware.allocator=glibc-tuned: glibc malloc keeping what a "
                                                    "step frees (no mmap, no trimming)")
    for name in _NAMES:
        already = [p for p in env.get("LD_PRELOAD", "").split(":") if name in os.path.basename(p)]
        if already and setting in ("auto", name):
            why = auto_why if setting == "auto" and name == "tcmalloc" else f"hardware.allocator={setting}"
            return AllocatorChoice(name, already[0], f"{why}; in LD_PRELOAD")
    name = "tcmalloc" if setting == "auto" else setting
    lib = find_allocator(name, dirs)
    if lib is None:
        package = "libgoogle-perftools4 or libtcmalloc-minimal4" if name == "tcmalloc" else "libjemalloc2"
        if setting == "auto" and strategy is not None and strategy not in SHARDED:
            return AllocatorChoice("glibc-tuned", None, f"no tcmalloc installed (apt install {package}; {auto_why}): "
                                                        f"glibc keeping what a step frees, "
                                   + GLIBC_TUNED_MEASURED.get(precision, GLIBC_TUNED_MEASURED["bf16"]))
        if strategy in SHARDED and name == "tcmalloc":  # where it matters most: say so
            auto_why = SHARDED_MEASURED
        return AllocatorChoice("system", None, f"no {name} installed (apt install {package}; {auto_why}); glibc malloc")
    why = auto_why if setting == "auto" else f"hardware.allocator={setting}"
    return AllocatorChoice(name, lib, f"{why}; preloaded into every rank")


def running_allocator_choice(precision: str, strategy: str, environ: dict | None = None) -> tuple[str, str]:
    """hardware.allocator=auto in a running rank: what this process runs on, and why. The
    allocator was preloaded before it started (or not: started by another launcher), or it is
    glibc, tuned by the worker before the model is built where allocator_choice says so."""
    env = os.environ if environ is None else environ
    choice = allocator_choice("auto", precision=precision, strategy=strategy)
    loaded = choice.library is not None and choice.library in env.get("LD_PRELOAD", "")
    if loaded or choice.library is None:
        return (choice.name if loaded or choice.name == "glibc-tuned" else "system"), choice.reason
    return "system", (f"{choice.name} is installed but was not preloaded into this process (started by another "
                      "launcher): glibc malloc")


def preload_env(choice: AllocatorChoice, environ: dict) -> None:
    """Add the chosen library to LD_PRELOAD in `environ` (the environment the ranks inherit)."""
    if choice.library is None:
        return
    current = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
    if choice.library not in current:
        environ["LD_PRELOAD"] = ":".join([choice.library, *current])
    if choice.name == "tcmalloc":
        # gperftools prints a "large alloc" line to stderr for every allocation over 1 GiB (an
        # 8B model's logits, its weights): noise in a training log.
        environ.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(2**60))


def reexec_env(choice: AllocatorChoice, environ: dict) -> dict | None:
    """The environment to start this process again with, so that `choice` is its malloc; None
    when nothing needs doing (no library, already preloaded, or already started again once)."""
    if choice.library is None or environ.get(REEXEC_MARK) or choice.library in environ.get("LD_PRELOAD", "").split(":"):
        return None
    env = dict(environ)
    preload_env(choice, env)
    env[REEXEC_MARK] = "1"
    return env


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1  # free memory at the heap's top beyond this is returned to the system
_M_MMAP_THRESHOLD = -3  # blocks at least this large get their own mapping
_M_MMAP_MAX = -4  # how many such mappings at once; 0: none, every block comes from the heap
_INT_MAX = 2**31 - 1  # mallopt takes an int


def tune_glibc() -> bool:
    """glibc malloc keeps what a training step frees for the next step (hardware.allocator=glibc-tuned).

    As is, glibc gives every block over its mmap threshold (128 KiB, rising to at most 32 MiB) a
    mapping of its own and unmaps it when freed; a step's activations and logits are mostly such
    blocks, so every step maps them again and the kernel zeroes each page on first touch. No mmap
    and no trimming keep the freed pages in the heap for the next step, as tcmalloc does, at the
    price of memory a step freed staying in the process. Called before the model is built; the
    same as GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=..., which only a
    new process can take."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
    except (OSError, AttributeError):
        return False
# glibc's initial threshold; pinning it at its own default only stops it from moving.
MMAP_THRESHOLD_BYTES = 128 * 1024


def pin_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Keep glibc malloc from raising its mmap threshold: every large tensor is then mapped on
    allocation and returned to the system when freed.

    The sharding strategies (fsdp, zero3) free large blocks all the time: a whole-model random
    init once, then every step each unit's gathered parameters and unsharded gradients. With glibc's default (dynamic)
    threshold, each such free raises the threshold to the freed size (up to 32 MiB), so later
    tensors of that size come from the heap, and freed heap memory stays in the process: measured
    on an 88M-parameter model at 2 ranks, each rank's peak RSS was that of a single unsharded rank
    (+0.9 GiB) instead of its shard's. Setting the threshold explicitly turns the dynamic
    adjustment off. A preloaded tcmalloc/jemalloc (hardware.allocator) does not use glibc's heap,
    so the call is harmless there; on a libc without mallopt it is skipped.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
    except (OSError, AttributeError):
        return False
