"""How fsdp's gradients are reduced across ranks: parallel.reduce_dtype=auto's rule, and the
reduce-scatter parallel.reduce_scatter runs on a backend.

bf16 reduction halves the gradient bytes each rank sends. Measured against fp32 reduction on the
demo's shape under FSDP (block reduce_dtype_drift of docs/benchmarks/network.md), its final
validation loss stayed within the spread a run has anyway between rank counts (+0.038 at 2 ranks
and −0.023 at 8, against 0.066 between 2 and 8 ranks in fp32), its per-step drift 2–4× that of
changing the rank count. It pays only where bytes cross a network: on one node a collective is a
memory copy, and there fp32 keeps every bit for nothing.
"""

from __future__ import annotations

REDUCE_DTYPE_DRIFT = "measured: see block reduce_dtype_drift of docs/benchmarks/network.md"


def reduce_scatter_in_use(setting: str, backend: str) -> str:
    """parallel.reduce_scatter as a run takes it (cputrain.parallel.fsdp, zero3): auto is the
    all-to-all on gloo, whose own reduce-scatter sends twice the bytes, and ccl's native one; a
    backend not decided yet (a plan's) is planned as gloo, the backend the plan's efficiency
    table measured."""
    if setting not in ("auto", "native", "all_to_all"):
        raise ValueError(f"unknown parallel.reduce_scatter {setting}")
    if setting == "auto":
        return "native" if backend == "ccl" else "all_to_all"
    return setting


def reduce_dtype_choice(setting: str, precision: str, nnodes: int) -> tuple[str, str]:
    """parallel.reduce_dtype under fsdp, and why ("" when the config fixed it)."""
    if setting != "auto":
        return setting, ""
    if precision != "bf16":
        return "fp32", "fp32 compute: gradients are reduced in the dtype they are computed in"
    if nnodes <= 1:
        return "fp32", ("one node: the reduction is a memory copy, so bf16 would save no network time and round "
                        f"every gradient ({REDUCE_DTYPE_DRIFT})")
    return "bf16", (f"{nnodes} nodes in bf16: half the gradient bytes through each node's link (the weights and "
                    "AdamW stay fp32; the all-to-all reduce-scatter rounds each slice once and sums in fp32); the "
                    "final validation loss stayed within the spread between rank counts "
                    f"({REDUCE_DTYPE_DRIFT})")
