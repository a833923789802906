"""How long torch's OpenMP workers spin before they sleep, set before torch is loaded.

torch's CPU wheel runs its intra-op thread pool on GNU OpenMP (libgomp). Between two parallel
operators a worker spins, then sleeps on a futex, and the next operator pays for waking it.
libgomp spins ~300,000 times (~3 ms) by default, but only 100 times (a few microseconds) once the
process holds more OpenMP threads than it has CPUs (its "throttled" mode, meant for oversubscribed
machines). A rank that talks over gloo gets there by itself: gloo's worker threads run the copies
of a collective as torch operators, each of those threads then has a thread pool of its own, and
from the first collective on the process counts more OpenMP threads than CPUs. Every parallel
operator of the rank then wakes sleeping workers, even back to back: an elementwise product of
512K floats took ~30 µs on 2 threads before a collective and ~100 µs after it
(benchmarks/network/openmp_waits.py). OMP_WAIT_POLICY=ACTIVE raises the throttled spin to 1,000;
GOMP_SPINCOUNT=300000, libgomp's own default, keeps the spin outside that mode what it was.
Measured on a ZeRO-3 rank (docs/benchmarks/network.md, "OpenMP workers that sleep"), and unchanged
on a rank that never forms a process group.

libgomp reads these variables once, when torch loads it, so `cputrain train` sets them before its
first torch import; the ranks it starts (the agent's, and its own one-process re-execution)
inherit them. A user who sets either variable, or runs on Intel's OpenMP runtime (KMP_BLOCKTIME is
its knob), keeps their own.
"""

from __future__ import annotations

import os

WAITS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
WAITS_TEXT = ", ".join(f"{name}={value}" for name, value in WAITS.items())
WHY = ("libgomp's throttled spin, the mode gloo's threads put a rank in, raised from 100 to 1,000; "
       "its normal spin kept at its default")


def _intel_runtime(environ) -> bool:
    """Intel's OpenMP runtime preloaded, or its wait set: its own knob (KMP_BLOCKTIME) governs."""
    return "libiomp" in environ.get("LD_PRELOAD", "") or "KMP_BLOCKTIME" in environ


def waits_to_set(environ) -> dict[str, str]:
    """The variables to add to `environ`: none where the user chose their own waits or runtime."""
    if any(name in environ for name in WAITS) or _intel_runtime(environ):
        return {}
    return dict(WAITS)


def set_before_torch() -> None:
    """Add the waits to this process's environment, which its ranks inherit. Called before torch
    is imported: a process that has loaded it already keeps the waits libgomp read then."""
    os.environ.update(waits_to_set(os.environ))


def describe(environ=None) -> str:
    """One line for a launch plan: the waits this process and its ranks run with, and why."""
    env = os.environ if environ is None else environ
    if {name: env.get(name) for name in WAITS} == WAITS:
        return f"OpenMP waits: {WAITS_TEXT} ({WHY})"
    if _intel_runtime(env):
        return "OpenMP waits: Intel's runtime's own (KMP_BLOCKTIME); libgomp's variables not set"
    own = ", ".join(f"{name}={env[name]}" for name in WAITS if name in env)
    return f"OpenMP waits: {own} (set in the environment, kept)" if own else "OpenMP waits: libgomp's defaults"
