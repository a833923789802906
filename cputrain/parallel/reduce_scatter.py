"""A reduce-scatter that sends each byte once, for FSDP2 over gloo.

gloo has no reduce-scatter: ProcessGroupGloo runs an all-reduce of the whole tensor and keeps
this rank's slice, so each rank sends 2·(W−1)/W of the tensor instead of (W−1)/W (measured on a
private loopback: 16 MiB reduce-scattered by 2 ranks sent 16.1 MiB per rank, the same as an
all-reduce; tests/distributed/test_comm_bytes.py). Here each rank sends every other rank the
slice that rank owns, in one all-to-all (gloo opens a connection to every peer, so a node's
link carries one flow per peer rather than a ring's one), and sums the W slices it receives.

Plugged into FSDP2 through its own hook (`FSDPModule.set_custom_reduce_scatter`). The sum runs
in fp32 whatever the reduce dtype: W bf16 slices added in fp32 and rounded once lose less than a
ring that rounds at every hop. FSDP2 asks for the mean (ReduceOp.AVG) or the sum; any other op
is refused rather than computed wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from cputrain.parallel.fsdp2_private import ReduceScatter


class AllToAllReduceScatter(ReduceScatter):
    """FSDP2's ReduceScatter comm: `input` is W equal slices back to back (slice i is rank i's);
    `output` receives this rank's slice summed (or averaged) over the group."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        world = group.size()
        if input_tensor.numel() != output_tensor.numel() * world:
            raise ValueError(f"reduce-scatter input of {input_tensor.numel()} elements is not {world} slices of "
                             f"{output_tensor.numel()}")
        mean = _is_mean(op)
        received = torch.empty_like(input_tensor)
        # synchronous, as FSDP2 calls it on CPU (no side stream to overlap with)
        dist.all_to_all_single(received, input_tensor, group=group)
        slices = received.view(world, -1)
        total = slices.sum(dim=0, dtype=torch.float32)
        if mean:
            total.div_(world)
        output_tensor.copy_(total.view_as(output_tensor))
        return None


def _is_mean(op) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ValueError(f"the all-to-all reduce-scatter takes ReduceOp.SUM or AVG, not {op}")
