"""The all-to-all reduce-scatter on one rank: the slice is its own sum and mean, so nothing is
sent and nothing summed (a one-rank zero3 run paid a collective and an fp32 sum per gradient
bucket; FSDP2 copies a one-rank gradient without calling it). The reductions on several ranks are
checked on real gloo ranks (tests/distributed/test_fsdp_collectives.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cputrain.parallel.reduce_scatter import AllToAllReduceScatter


class OneRank:
    """A group of one: no collective may run on it (this object has none to run)."""

    def size(self) -> int:
        return 1


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_one_rank_copies_its_slice(op):
    grads = torch.randn(12, dtype=torch.bfloat16)
    out = torch.zeros(12, dtype=torch.bfloat16)
    AllToAllReduceScatter()(out, grads, OneRank(), op)
    assert torch.equal(out, grads)


def test_one_rank_given_its_own_input_leaves_it():
    """DeepSpeed hands the input itself as the one rank's output slice."""
    grads = torch.randn(12)
    before = grads.clone()
    AllToAllReduceScatter()(grads, grads, OneRank(), dist.ReduceOp.SUM)
    assert torch.equal(grads, before)


def test_one_rank_refuses_what_several_ranks_refuse():
    with pytest.raises(ValueError, match="takes ReduceOp.SUM or AVG"):
        AllToAllReduceScatter()(torch.zeros(4), torch.zeros(4), OneRank(), dist.ReduceOp.MAX)


def test_a_slice_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="not 1 slices"):
        AllToAllReduceScatter()(torch.zeros(5), torch.zeros(6), OneRank(), dist.ReduceOp.SUM)
