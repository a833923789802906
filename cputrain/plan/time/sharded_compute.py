"""What a sharded rank's compute costs beyond the same rank unsharded: the factor a time plan
multiplies a sharded run's compute by.

Every measured MFU the plans use (cputrain.plan.time.measured_mfu) comes from runs of the single
strategy (or DDP, whose rank computes as single does). A rank under FSDP2 or ZeRO-3 computes the
same FLOPs more slowly: it casts each gathered block to the compute dtype and its gradients back,
copies them in and out of the collectives' buffers, runs the strategies' hooks, and allocates what
it gathers again every micro-batch. One rank alone with nothing to communicate shows that cost on
its own; a plan that left it out would plan a sharded cluster faster than it runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardedCompute:
    strategy: str
    factor: float  # a sharded rank's step ÷ the single strategy's, one rank alone, nothing to communicate
    source: str  # where it was measured


ROWS = {
    "fsdp": ShardedCompute("fsdp", 1.47, "measured: one FSDP rank alone, ~34M Llama in bf16, 4 micro-batches of "
                                         "2 × 512, 8.62 s a step against the single strategy's 5.86 s (block "
                                         "fsdp_layouts, AMD EPYC with AVX512-BF16)"),
    "zero3": ShardedCompute("zero3", 2.29, "measured: one ZeRO-3 rank alone, ~34M Llama in bf16, 4 micro-batches "
                                           "of 2 × 512, a profiled step of 8.02 s against the single strategy's 3.50 "
                                           "s, one round (block sharded_rank, AMD EPYC with AVX512-BF16)"),
}


def sharded_factor(strategy: str) -> ShardedCompute | None:
    """The factor for a run of `strategy`; None where its rank computes as the single strategy's."""
    return ROWS.get(strategy)


def measured_compute(peak_flops_per_s: float, choice, strategy: str):
    """A rank's cores at the MFU measured for its CPU (`choice`: measured_mfu's, a single-strategy
    run's), slowed by what sharding costs a rank where `strategy` shards."""
    from cputrain.plan.time.step_time import Compute

    share, said = choice.row.executed_share_of_peak, choice.describe()
    sharded = sharded_factor(strategy)
    if sharded is None:
        return Compute(peak_flops_per_s, share, said)
    return Compute(peak_flops_per_s, share / sharded.factor,
                   f"{said}; ÷ {sharded.factor:.2f} for a {strategy} rank's own work ({sharded.source})")
