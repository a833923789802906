"""model.activation_checkpointing=auto: as little recompute as the node's memory allows.

A checkpointed block runs its forward again in the backward: for full fine-tuning about a third
more compute for that block, for LoRA (no weight gradients of the frozen base) about a half. A
block that keeps its activations costs memory instead: the plan's bytes of one whole block. The
recipes turn checkpointing on for every block whatever the machine, so a Llama-3-8B LoRA step on a
64 GiB node recomputes 33 TFLOP it had the memory to keep (plan: 37.3 GiB per rank without
checkpointing at seq 2048, 17.6 GiB with it). auto asks the plan, in order of recompute, for the first
setting with which each rank's peak fits its share of the node, with a margin for what the plan
leaves out: none; selective (cputrain.model.selective_checkpointing: every block keeps its matmul
outputs and recomputes only norms, RoPE and SiLU × up, so no matmul runs twice, for about half a
block's activations); then the fewest whole blocks (the first ones), up to all, the others
keeping everything or, where that keeps less, selective ("N+selective"; not under zero3).
"""

from __future__ import annotations

from cputrain.config import Config, checkpointing_split
from cputrain.plan.memory.build import make_plan

GIB = 2**30
# The share of a rank's memory the plan may fill. The plan counts what is alive (a ~300M LoRA step
# peak within 0.5% of it with glibc's mmap threshold held, so that freed blocks leave the process:
# benchmarks/memory/heap_retention.py); the rest covers what the allocator keeps of what a step frees:
# +0.69 GiB with glibc-tuned and +0.91 GiB with glibc as is on that 1.37 GiB run, up to 1.37× glibc's
# step peak with a preloaded tcmalloc (benchmarks/memory/allocator.py).
MEMORY_FRACTION = 0.8


def _with_blocks(cfg: Config, blocks: bool | int | str) -> Config:
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"activation_checkpointing": blocks})})


def checkpointing_choice(cfg: Config, world_size: int, local_world_size: int, memory_gib: float,
                         vocab_size: int | None = None,
                         memory_fraction: float = MEMORY_FRACTION) -> tuple[bool | int | str, str]:
    """The resolved model.activation_checkpointing for this node (false, selective, "N+selective",
    a number of blocks under zero3, or true) and why, from the run's plan at each candidate."""
    budget_gib = memory_gib * memory_fraction / local_world_size
    where = f"{budget_gib:.1f} GiB per rank ({memory_fraction:.0%} of this node's {memory_gib:.1f} GiB ÷ " \
            f"{local_world_size} rank(s))"
    # the node's ranks: the FSDP layouts that keep a node's share read them
    # The plan without checkpointing, made once: its shape (the model built once) plans every other candidate.
    unchecked = make_plan(_with_blocks(cfg, False), world_size, nproc_per_node=local_world_size, vocab_size=vocab_size)
    shape = unchecked.shape
    # GiB per rank by (whole, selective) blocks
    peaks = {checkpointing_split(False, shape.layers): unchecked.peak_rank.total_bytes / GIB}

    def peak_gib(blocks: bool | int | str) -> float:
        split = checkpointing_split(blocks, shape.layers)
        if split not in peaks:
            peaks[split] = make_plan(_with_blocks(cfg, blocks), world_size, nproc_per_node=local_world_size,
                                     shape=shape).peak_rank.total_bytes / GIB
        return peaks[split]

    layers = shape.layers
    if peak_gib(False) <= budget_gib:
        return False, (f"the plan without it, {peak_gib(False):.1f} GiB per rank, fits {where}: no block runs its "
                       "forward twice")
    selective_ok = cfg.parallel.strategy != "zero3"  # refused there (config.sections)
    selective_gib = peak_gib("selective") if selective_ok else None
    if selective_ok and selective_gib <= budget_gib:
        return "selective", (f"without it the plan, {peak_gib(False):.1f} GiB per rank, is over {where}; with "
                             f"selective checkpointing it is {selective_gib:.1f} GiB and fits: every block keeps "
                             "its matmul outputs and recomputes only norms, RoPE and SiLU × up, no matmul twice")

    # With n blocks checkpointed whole, the others keep everything (n) or only their matmul
    # outputs ("n+selective"): the mix keeps less unless nearly every block is whole (one block is
    # recomputed in full at a time either way), and both recompute the same matmuls. The fewest
    # whole blocks with which either fits; the one without selective where both do.
    def fitting(n: int) -> bool | int | str | None:
        for setting in (n, f"{n}+selective") if selective_ok else (n,):
            if peak_gib(setting) <= budget_gib:
                return setting
        return None

    # Peaks fall as blocks are added up to all but the last (checkpointing the last block as well
    # keeps one more input and saves nothing: its recompute would follow its forward at once).
    most = max(layers - 1, 1)
    if fitting(most) is None:
        return True, (f"even with every block checkpointed the plan, {peak_gib(True):.1f} GiB per rank, is over "
                      f"{where}: every block (`cputrain plan` shows what fits)")
    low, high = 1, most  # the fewest whole blocks that fit lies in [low, high]
    while low < high:
        mid = (low + high) // 2
        if fitting(mid) is not None:
            high = mid
        else:
            low = mid + 1
    setting = fitting(low)
    others = f"the other {layers - low} selective" if isinstance(setting, str) else "the others keeping everything"
    over_selective = "" if selective_gib is None else f", selective {selective_gib:.1f} GiB"
    return setting, (f"the first {low} of {layers} blocks whole, {others}: the fewest whole blocks with which the "
                     f"plan, {peak_gib(setting):.1f} GiB per rank, fits {where}; without checkpointing "
                     f"{peak_gib(False):.1f} GiB{over_selective}, with every block {peak_gib(True):.1f} GiB")
