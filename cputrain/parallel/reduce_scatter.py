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

FSDP2 on CPU calls a reduce-scatter synchronously: a block's backward waits for the previous
block's gradients to cross the network. `OverlappedReduceScatter` issues the all-to-all on gloo's
own thread and sums it later, while the next blocks' backward computes. That is right where FSDP2
makes each new gradient a view of the reduce-scatter's output and adds nothing to it (no gradient
held yet: gather_once's one reduction a step), so filling the output later fills the gradient.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

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
        world = _slices_of(input_tensor, output_tensor, group)
        mean = _is_mean(op)
        if world == 1:  # the slice is its own sum and mean; reached from DeepSpeed only (FSDP2 copies a
            # one-rank gradient itself), which hands the input itself as the output
            if output_tensor.data_ptr() != input_tensor.data_ptr():
                output_tensor.copy_(input_tensor.view_as(output_tensor))
            return None
        received = torch.empty_like(input_tensor)
        # synchronous, as FSDP2 calls it on CPU (no side stream to overlap with)
        dist.all_to_all_single(received, input_tensor, group=group)
        _sum_slices(received, world, mean, output_tensor)
        return None


def _slices_of(input_tensor: torch.Tensor, output_tensor: torch.Tensor, group: dist.ProcessGroup) -> int:
    """The group's size, where `input_tensor` is that many slices of `output_tensor`'s size."""
    world = group.size()
    if input_tensor.numel() != output_tensor.numel() * world:
        raise ValueError(f"reduce-scatter input of {input_tensor.numel()} elements is not {world} slices of "
                         f"{output_tensor.numel()}")
    return world


def _sum_slices(received: torch.Tensor, world: int, mean: bool, output_tensor: torch.Tensor) -> None:
    total = received.view(world, -1).sum(dim=0, dtype=torch.float32)
    if mean:
        total.div_(world)
    output_tensor.copy_(total.view_as(output_tensor))


# A block's gradients cross the network while the next two blocks' backward computes (and two
# blocks' slices are held meanwhile)
IN_FLIGHT = 2


@dataclass
class _InFlight:
    """One issued all-to-all: its buffers stay referenced until it is summed into `output`."""

    work: dist.Work
    sent: torch.Tensor
    received: torch.Tensor
    output: torch.Tensor
    world: int
    mean: bool

    def finish(self) -> None:
        self.work.wait()
        _sum_slices(self.received, self.world, self.mean, self.output)


class OverlappedReduceScatter(AllToAllReduceScatter):
    """The all-to-all issued asynchronously; at most `in_flight` of them wait unsummed, so a block's
    gradients cross the network while the next `in_flight` blocks' backward computes, and what is
    held beyond FSDP2's own buffers is that many blocks' slices. `finish()` sums the rest; the
    strategy calls it when the step's last backward ends, before anything reads a gradient.

    The output is allocated in the gradients' dtype (fp32) whatever the reduce dtype: FSDP2 casts
    an output of another dtype at once, before it holds the sum, and views one of theirs. So bf16
    reduction still sends bf16 (FSDP2's input) and its sum is no longer rounded to bf16 at the end.
    FSDP2 allocates each reduce-scatter's input, then its output (1/`world` of it): told apart by size."""

    def __init__(self, world: int, in_flight: int = IN_FLIGHT, output_dtype: torch.dtype = torch.float32):
        self.world = world
        self.in_flight = in_flight  # 0: every call summed before it returns (a step that must not defer)
        self.output_dtype = output_dtype
        self._input_numel: int | None = None
        self._issued: deque[_InFlight] = deque()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        if self._input_numel is not None and numel * self.world == self._input_numel:
            self._input_numel = None
            return torch.empty(*size, dtype=self.output_dtype, device=device)
        self._input_numel = numel
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        world = _slices_of(input_tensor, output_tensor, group)
        received = torch.empty_like(input_tensor)
        work = dist.all_to_all_single(received, input_tensor, group=group, async_op=True)
        self._issued.append(_InFlight(work, input_tensor, received, output_tensor, world, _is_mean(op)))
        while len(self._issued) > self.in_flight:
            self._issued.popleft().finish()
        return None

    def finish(self) -> None:
        """Sum every issued all-to-all into its output, oldest first."""
        while self._issued:
            self._issued.popleft().finish()


def _is_mean(op) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ValueError(f"the all-to-all reduce-scatter takes ReduceOp.SUM or AVG, not {op}")
