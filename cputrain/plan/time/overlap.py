"""How much of a step's network time no compute hides: one function per regime.

FSDP2 on CPU, measured over a shaped link (docs/benchmarks/network.md): a gather issued as its block
begins hides none of it (block gloo_link-runs: no side streams on a CPU). Issued one block ahead on
gloo's own thread (parallel.prefetch), part of each block's gather crosses while the block before
computes (block fsdp_prefetch); gather_once's reduce-scatter left running (parallel.overlap_reduction)
hides behind the last backward (block fsdp_overlap); other reduce-scatters show whole. ZeRO-3,
modelled: DeepSpeed gathers the next block while the current one computes and reduce-scatters a
block's gradients behind the next block's backward, so each block exposes max(0, its communication
− its compute), plus the first gather of a pass and the last reduce-scatter, which never hide. DDP's
bucketed all-reduce runs behind the last micro-batch's backward, all but its last bucket (measured
within 10% at 1 Gbit/s). A measured overlap (the share hidden, 0 to 1) replaces these where a
benchmark has one. Planned for the machine the efficiency table was measured on (`gloo_cpu_capped`),
gloo's CPU time never hides: it comes out of the cores the compute keeps busy; nor do a node's own
collectives (over loopback, on the cores: cputrain.plan.time.step_time adds them whole).
"""

from __future__ import annotations

from cputrain.plan.time.comm_volume import Collective, CommPattern
from cputrain.plan.time.link import LinkTimer

# The share of the shorter of two things that hides, measured on 2 nodes of one rank on one core
# each, gloo's thread sharing it (docs/benchmarks/network.md; a core left to gloo: not measured). The
# blocks' gathers a block ahead and the compute (fsdp_prefetch.py): 118%, 61%, 47% at 0.25, 0.5, 1 Gbit/s.
PREFETCH_HIDDEN_SHARE = 0.61
# gather_once's blocks' reduce-scatters and the last backward less a block's (fsdp_overlap.py): the
# step saved 276% and 199% of that at 0.25 and 0.5 Gbit/s (the waited-for path also stalls between
# its calls): the whole window hides, never more than the transfer.
REDUCE_HIDDEN_SHARE = 1.0


def fsdp_exposed_s(network_s: float, block_gathers_s: float, compute_s: float, prefetch: bool, layers: int,
                   reduces_s: float = 0.0, backward_s: float = 0.0) -> float:
    """FSDP2 on CPU: everything shows but, measured, each share of the shorter of the blocks' gathers
    (less a pass's first) and the compute, and of their reduce-scatters (less the last) and `backward_s`."""
    hidden = REDUCE_HIDDEN_SHARE * min(reduces_s * (layers - 1) / layers, backward_s)
    if prefetch:
        hidden += PREFETCH_HIDDEN_SHARE * min(block_gathers_s * (layers - 1) / layers, compute_s)
    return network_s - hidden


def fsdp_overlap_source(prefetch: bool, reduces_behind: bool = False) -> str:
    gathers = (f"gathers issued a block ahead: {PREFETCH_HIDDEN_SHARE:.0%} of the shorter of the blocks' gathers "
               "and the compute hides" if prefetch else "gathers issued as their block begins: none hides")
    behind = (f"; the reduce-scatter left running behind the last backward: {REDUCE_HIDDEN_SHARE:.0%} of the "
              "shorter of the two hides" if reduces_behind else "")
    return f"FSDP2 on CPU, {gathers}{behind}, measured"


def _sharded_micro_batch_s(p: CommPattern, t_gather: float, t_root_gather: float, t_reduce: float,
                           t_root_reduce: float, fwd_s: float, bwd_s: float) -> float:
    """One gathering micro-batch of ZeRO-3: what its communication adds to its compute."""
    layers = p.layers
    # forward: the root's and the first block's gathers wait; each next block's hides behind the one before
    exposed = t_root_gather + t_gather + (layers - 1) * max(0.0, t_gather - fwd_s)
    backward_gather = t_gather * p.backward_gathers / layers  # on average over the blocks
    # backward: a block's gather (if resharded) and the previous block's reduce-scatter share the
    # link behind a block's backward; the first gather and the last reduce-scatters never hide
    exposed += backward_gather + (layers - 1) * max(0.0, backward_gather + t_reduce - bwd_s)
    return exposed + t_reduce + t_root_reduce


def _one_call_s(timer: LinkTimer, kind: str, whole_bytes: int) -> float:
    """One collective of `whole_bytes` across the nodes."""
    via = timer.pattern.reduce_scatter if kind == "reduce_scatter" else "ring"
    return timer.seconds(Collective(kind, "", whole_bytes, whole_bytes, via=via))


def modelled_exposed_s(timer: LinkTimer, network_s: float, allreduce_s: float, gloo_cpu_s: float,
                       block_s: tuple[float, float]) -> float:
    """ZeRO-3's and DDP's exposed network time, modelled; `block_s`: one block's forward and
    backward seconds on one micro-batch."""
    p, (fwd_s, bwd_s) = timer.pattern, block_s
    exposed = 0.0
    if p.gathering_micro_batches:
        one = _sharded_micro_batch_s(p, _one_call_s(timer, "all_gather", p.block_gather_bytes),
                                     _one_call_s(timer, "all_gather", p.root_gather_bytes),
                                     _one_call_s(timer, "reduce_scatter", p.block_reduce_bytes),
                                     _one_call_s(timer, "reduce_scatter", p.root_reduce_bytes), fwd_s, bwd_s)
        exposed += one * p.gathering_micro_batches
    if p.allreduce_bytes:
        buckets = max(1.0, p.allreduce_bytes / max(p.allreduce_message_bytes, 1))
        last_bucket = allreduce_s / buckets
        exposed += last_bucket + max(0.0, allreduce_s - last_bucket - bwd_s * p.layers)
    exposed = min(exposed, network_s)
    # gloo's own CPU time comes out of the cores the compute saturates: it never hides; the rest of
    # the wait (the link's) hides as the model above says
    if gloo_cpu_s:
        exposed = gloo_cpu_s + (network_s - gloo_cpu_s) * exposed / network_s
    return exposed
