"""What a sharded rank's compute costs beyond the same rank unsharded: the factor a time plan
multiplies a sharded run's compute by, per strategy, FSDP layout and allocator.

Every measured MFU the plans use (cputrain.plan.time.measured_mfu) comes from runs of the single
strategy (or DDP, whose rank computes as single does). A rank under FSDP2 or ZeRO-3 computes the
same FLOPs more slowly: it casts each gathered block to the compute dtype and its gradients back,
copies them in and out of the collectives' buffers, runs the strategies' hooks, and allocates what
it gathers again every micro-batch. One rank alone with nothing to communicate shows that cost on
its own; a plan that left it out would plan a sharded cluster faster than it runs.

The allocator is most of it. glibc, with the mmap threshold fsdp and zero3 pin so that what a rank
frees of its gathered blocks leaves the process, maps and zeroes those pages again every
micro-batch, and every activation over 128 KiB with them; tcmalloc keeps freed spans for the next
allocation of their size and returns them to the system slowly. So each factor is measured on the
allocator `auto` gives the rank (tcmalloc where installed, as the training image has it) and
divided by the single strategy's step on the same allocator, in the compute dtype of the run:
bf16 pays for the casts of every gathered block and gradient, fp32 for none.
"""

from __future__ import annotations

from dataclasses import dataclass

# The allocator the instance plans assume: the training image's (Dockerfile: libgoogle-perftools4).
IMAGE_ALLOCATOR = "tcmalloc"


def _source(block: str, precision: str = "bf16") -> str:
    return (f"one rank alone, ~100M Llama in {precision}, 4 micro-batches of 2 × 512, median of 2 alternated rounds, "
            f"against the single strategy on the same allocator (block {block} of docs/benchmarks/network.md, "
            "AMD EPYC with AVX512-BF16)")


_SOURCE = _source("sharded_rank")
_SOURCE_FP32 = _source("sharded_rank_fp32", "fp32")


@dataclass(frozen=True)
class ShardedCompute:
    strategy: str
    layout: str | None  # fsdp's parallel.layout (None: zero3, which has none)
    allocator: str  # tcmalloc, or glibc (what auto gives a sharded rank without tcmalloc)
    factor: float  # a sharded rank's step ÷ the single strategy's, one rank alone, nothing to communicate
    source: str  # where it was measured
    precision: str = "bf16"  # the compute dtype it was measured in

    def describe(self) -> str:
        where = f"a {self.strategy} rank's own work" + (f" ({self.layout})" if self.layout else "")
        return f"÷ {self.factor:.2f} for {where} in {self.precision} on {self.allocator} (measured: {self.source})"


ROWS = [
    # tcmalloc: single 8.28 s a step; full_shard 9.05, gather_once 8.73
    ShardedCompute("fsdp", "full_shard", "tcmalloc", 1.09, _SOURCE),
    ShardedCompute("fsdp", "gather_once", "tcmalloc", 1.05, _SOURCE),
    # zero3, blocks fetched whole, no numactl per gradient bucket: single 8.98 s, zero3 8.71 (0.97; another run 1.02)
    ShardedCompute("zero3", None, "tcmalloc", 1.00, _source("zero3_reduce_bucket")),
    # glibc: single (tuned) 8.65 s a step; full_shard (as is, pinned) 13.96, zero3 17.63 (fetched module by module:
    # an upper bound now). gather_once takes full_shard's (not measured at ~100M; 1.41× against 1.50× at ~34M)
    ShardedCompute("fsdp", "full_shard", "glibc", 1.61, _SOURCE),
    ShardedCompute("fsdp", "gather_once", "glibc", 1.61, _SOURCE + "; full_shard's, gather_once on glibc not measured "
                   "at this size"),
    ShardedCompute("zero3", None, "glibc", 2.04, _SOURCE + "; fetching module by module, an upper bound for blocks "
                   "fetched whole"),
    # fp32, tcmalloc, zero3 fetching blocks whole: single 15.65 s a step; full_shard 15.95, gather_once 15.51
    # (below single: planned at 1.00), zero3 16.58. FSDP2's are smaller than bf16's: in fp32 it casts
    # nothing, and the matmuls take a larger share of the step. zero3's is not (1.06, measured before
    # DeepSpeed's numactl call per bucket was removed). fp32 on glibc is not measured: bf16's glibc rows stand for it.
    ShardedCompute("fsdp", "full_shard", "tcmalloc", 1.02, _SOURCE_FP32, "fp32"),
    ShardedCompute("fsdp", "gather_once", "tcmalloc", 0.99, _SOURCE_FP32, "fp32"),
    ShardedCompute("zero3", None, "tcmalloc", 1.06, _SOURCE_FP32, "fp32"),
]
# Layouts measured apart; the others (hybrid and the node layouts) shard and gather as full_shard does.
_MEASURED_LAYOUTS = ("full_shard", "gather_once")


def allocator_family(allocator: str) -> str:
    """tcmalloc's row for tcmalloc; glibc's for the rest (glibc as is, tuned, and jemalloc, which
    measured between them: the slower figure is the one a plan may promise)."""
    return "tcmalloc" if allocator == "tcmalloc" else "glibc"


def sharded_factor(strategy: str, layout: str = "full_shard", allocator: str = IMAGE_ALLOCATOR,
                   precision: str = "bf16") -> ShardedCompute | None:
    """The factor for a rank of `strategy` (fsdp: in `layout`) on `allocator` computing in
    `precision`; None where its rank computes as the single strategy's (single, ddp). Where the
    precision was not measured on that allocator, bf16's row (the larger factor)."""
    if strategy not in ("fsdp", "zero3"):
        return None
    layout_key = (layout if layout in _MEASURED_LAYOUTS else "full_shard") if strategy == "fsdp" else None
    family = allocator_family(allocator)
    rows = [r for r in ROWS if (r.strategy, r.layout, r.allocator) == (strategy, layout_key, family)]
    return next((r for r in rows if r.precision == precision), next(r for r in rows if r.precision == "bf16"))


def measured_compute(peak_flops_per_s: float, choice, strategy: str, layout: str = "full_shard",
                     allocator: str = IMAGE_ALLOCATOR, precision: str = "bf16"):
    """A rank's cores at the MFU measured for its CPU (`choice`: measured_mfu's, a single-strategy
    run's), slowed by what sharding costs a rank where `strategy` shards. A factor is never below 1:
    a sharded rank is not planned faster than the same rank unsharded."""
    from cputrain.plan.time.step_time import Compute

    share, said = choice.row.executed_share_of_peak, choice.describe()
    sharded = sharded_factor(strategy, layout, allocator, precision)
    if sharded is None:
        return Compute(peak_flops_per_s, share, said)
    return Compute(peak_flops_per_s, share / max(1.0, sharded.factor), f"{said}; {sharded.describe()}")


def running_allocator(cfg) -> str:
    """The allocator a run of `cfg` gets on this node (hardware.allocator as auto resolves it here)."""
    from cputrain.native.allocator import allocator_choice

    return allocator_choice(cfg.hardware.allocator, precision=cfg.hardware.precision,
                            strategy=cfg.parallel.strategy).name
