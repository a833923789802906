"""Why a LoRA step's peak RSS sits above the memory plan: what glibc keeps of what a step frees.
Writes block heap_retention of docs/benchmarks/memory.md.

    python benchmarks/memory/heap_retention.py            # ~8 min on 2 cores: run it alone
    python benchmarks/memory/heap_retention.py --quick    # a tiny model, 2 steps: checks the script only

The plan (cputrain.plan) counts the bytes that are alive at the step's peak. The step peak the
run reports is the process's RSS high-water mark, which also holds memory the allocator has been
given back by `free` but keeps. The ~300M LoRA run of benchmarks/lora/lora.py (every block
checkpointed, seq 2,048, bf16) is run with the same cputrain command under three glibc settings,
each a fresh process:

- glibc as is (`hardware.allocator=system`): a freed block that had its own mapping raises glibc's
  mmap threshold to its size (up to 32 MiB), so later blocks below it come from the heap and stay
  there when freed;
- glibc-tuned (what `hardware.allocator=auto` takes on a bare install, single and ddp): no mmap,
  no trimming: every block comes from the heap and stays;
- glibc with the mmap threshold fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_=131072`; setting it
  switches the rising threshold off): every block over it is mapped and unmapped, so RSS follows
  what is alive, paid for in page faults.

The third is the plan's measure: its step peak against the plan says whether the plan counts
what is alive; the first two against it say what the allocator keeps.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.lora.lora import ARCH_300M, LAYER_SEQ_LEN, QUICK_ARCH, run_cputrain  # noqa: E402
from benchmarks.runner.base_model import make_base  # noqa: E402

FIXED_THRESHOLD_BYTES = 128 * 1024  # glibc's starting mmap threshold, held there
SETTINGS = {
    "glibc as is (`hardware.allocator=system`)": ("system", {}),
    "glibc-tuned (auto on a bare install)": ("glibc-tuned", {}),
    "glibc, mmap threshold fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_=131072`)":
        ("system", {"MALLOC_MMAP_THRESHOLD_": str(FIXED_THRESHOLD_BYTES)}),
}


def run_with_env(extra_env: dict, **kwargs) -> dict:
    """run_cputrain with `extra_env` in the child's environment (its env() copies os.environ)."""
    with mock.patch.dict(os.environ, extra_env):
        return run_cputrain(**kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 steps; prints, writes no doc")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench"))
    a = ap.parse_args()
    shared = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
    source = str(shared) if shared.exists() else "builtin:pydoc"
    arch, seq_len, steps = (QUICK_ARCH, 128, 2) if a.quick else (ARCH_300M, LAYER_SEQ_LEN, a.steps)
    results = {}
    with tempfile.TemporaryDirectory(prefix="cputrain-heap-") as tmp:
        base = str(Path(tmp) / "base")
        make_base(Path(base), arch, source, a.cache_dir, "bfloat16")
        for name, (allocator, extra_env) in SETTINGS.items():
            r = run_with_env(extra_env, base=base, lora=True, steps=steps, warmup=1, seq_len=seq_len, source=source,
                             cache_dir=a.cache_dir, precision="bf16",
                             extra=("model.activation_checkpointing=true", "train.micro_batch_size=1",
                                    "train.global_batch_size=2", "model.compile=false",
                                    f"hardware.allocator={allocator}"))
            results[name] = r
            print(f"{name}: step peak {r['step_peak_rss_gib']:.2f} GiB, plan {r['plan_peak_rss_gib']:.2f} "
                  f"({r['plan_error']:+.1%}), {r['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    rows = "\n".join(f"| {name} | {r['step_peak_rss_gib']:.2f} | {r['plan_peak_rss_gib']:.2f} | "
                     f"{r['step_peak_rss_gib'] - r['plan_peak_rss_gib']:+.2f} | {r['tokens_per_s']:,.0f} |"
                     for name, r in results.items())
    fixed = results[list(SETTINGS)[2]]
    tuned = results[list(SETTINGS)[1]]
    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line

    table = f"""### What glibc keeps of a step: the LoRA step peak against the plan

{machine_line()}

`python benchmarks/memory/heap_retention.py`: the ~300M Llama of block lora_checkpointing, LoRA r=16 on the seven
projections, bf16, every block checkpointed, {steps} optimizer steps of 2 micro-batches × 1 × {seq_len:,} tokens,
eager blocks, one fresh `cputrain train` process per setting (one run each). Step peak: the RSS high-water mark
of the training steps (memory.json); plan: `cputrain plan`'s peak for the run (plan.json), which counts what is alive.

| glibc setting | step peak RSS (GiB) | plan (GiB) | step peak − plan (GiB) | tokens/s |
| --- | ---: | ---: | ---: | ---: |
{rows}

With the threshold fixed, RSS follows what is alive: the plan is {fixed['plan_error']:+.1%} against that step peak;
glibc-tuned keeps {tuned['step_peak_rss_gib'] - fixed['step_peak_rss_gib']:.2f} GiB more (memory the step freed and
glibc did not give back), at {tuned['tokens_per_s'] / fixed['tokens_per_s']:.2f}× the fixed threshold's tokens/s.
"""
    print(table)
    if not a.quick:
        write_block("heap_retention", table)


if __name__ == "__main__":
    main()
