"""The gradient reduction of every FSDP layout, on real gloo ranks, against one process's gradient.

Four spawned processes on loopback shard a small stack of linear layers with each layout, run two
micro-batches of a global batch whose mean loss one process also computes whole, and compare
every gradient (and their global norm) with that process's. The all-to-all reduce-scatter is
checked against gloo's own, in fp32 and bf16; a reduce-scatter that sums where it should average
(the fault of pytorch issue 162338) is caught by the same comparison, so the check can fail; and
node_reshard builds one post-forward mesh, not one per block.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_helpers import free_port

pytestmark = pytest.mark.slow

WORLD = 4
RANKS_PER_NODE = 2
BLOCKS = 4
MICRO_BATCHES = 2
ROWS = 3  # per micro-batch per rank


def _model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(BLOCKS)], nn.Linear(32, 4))


def _batch():
    torch.manual_seed(1)
    return torch.randn(WORLD * MICRO_BATCHES * ROWS, 32), torch.randn(WORLD * MICRO_BATCHES * ROWS, 4)


def _reference_grads() -> tuple[dict, float]:
    model = _model()
    x, y = _batch()
    ((model(x) - y) ** 2).mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return grads, float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))


def _sharded_grads(layout_name: str, reduce_scatter, reduce_dtype=torch.float32, finish: bool = True):
    """This rank's run of the layout: the full gradients (gathered) and the global norm FSDP sees.
    An overlapped reduce-scatter is finished after the last backward, as the strategy does (unless
    `finish` is False: the gradients are then read as the reductions left them)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from cputrain.parallel.fsdp import Layout

    layout = Layout(layout_name, WORLD, RANKS_PER_NODE)
    model = _model()
    kwargs = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)}
    mesh = layout.mesh()
    if mesh is not None:
        kwargs["mesh"] = mesh
    with layout.wrap_context():
        for block in list(model)[:-1]:
            fully_shard(block, reshard_after_forward=layout.block_reshard_after_forward(), **kwargs)
        fully_shard(model, **kwargs)
    if reduce_scatter is not None:
        for module in model.modules():
            if hasattr(module, "set_custom_reduce_scatter"):
                module.set_custom_reduce_scatter(reduce_scatter)
    x, y = _batch()
    rank = dist.get_rank()
    mine_x = x.view(WORLD, MICRO_BATCHES, ROWS, -1)[rank]
    mine_y = y.view(WORLD, MICRO_BATCHES, ROWS, -1)[rank]
    for i in range(MICRO_BATCHES):
        layout.before_micro_batch(model, last=i == MICRO_BATCHES - 1)
        # each micro-batch's share of the global mean: the mean over it ÷ micro-batches (FSDP
        # averages over ranks)
        (((model(mine_x[i]) - mine_y[i]) ** 2).mean() / MICRO_BATCHES).backward()
    overlapped = hasattr(reduce_scatter, "finish")
    if overlapped and finish:
        reduce_scatter.finish()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
    if overlapped:
        reduce_scatter.finish()  # what was left in flight, so the next case's collectives line up
    groups = len(dist.distributed_c10d._world.pg_map)
    return grads, norm, groups


def _worst(grads: dict, reference: dict) -> float:
    return max(float((grads[n].float() - g).abs().max() / g.abs().max()) for n, g in reference.items())


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from cputrain.parallel.reduce_scatter import AllToAllReduceScatter, OverlappedReduceScatter

    class SummingReduceScatter(AllToAllReduceScatter):
        """The fault to catch: the slices summed where FSDP asked for their mean."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return super().__call__(output_tensor, input_tensor, group, dist.ReduceOp.SUM, async_op)

    try:
        reference, reference_norm = _reference_grads()
        found = {}
        cases = [(layout, rs) for layout in ("full_shard", "node_reshard", "gather_once", "hybrid")
                 for rs in ("native", "all_to_all")]
        for layout, rs in cases:
            before = len(dist.distributed_c10d._world.pg_map)
            grads, norm, groups = _sharded_grads(layout, AllToAllReduceScatter() if rs == "all_to_all" else None)
            found[(layout, rs)] = (_worst(grads, reference), abs(norm / reference_norm - 1), groups - before)
        grads, norm, _ = _sharded_grads("full_shard", AllToAllReduceScatter(), torch.bfloat16)
        found[("full_shard", "all_to_all bf16")] = (_worst(grads, reference), abs(norm / reference_norm - 1), 0)
        grads, norm, _ = _sharded_grads("full_shard", SummingReduceScatter())
        found[("full_shard", "summing")] = (_worst(grads, reference), norm / reference_norm, 0)
        # gather_once's reductions left running behind the backward, summed when it ends; reduced in
        # bf16 (summed into fp32); and read before they are summed, which the comparison must catch
        grads, norm, _ = _sharded_grads("gather_once", OverlappedReduceScatter(WORLD))
        found[("gather_once", "overlapped")] = (_worst(grads, reference), abs(norm / reference_norm - 1), 0)
        grads, norm, _ = _sharded_grads("gather_once", OverlappedReduceScatter(WORLD), torch.bfloat16)
        found[("gather_once", "overlapped bf16")] = (_worst(grads, reference), abs(norm / reference_norm - 1), 0)
        grads, _, _ = _sharded_grads("gather_once", OverlappedReduceScatter(WORLD), finish=False)
        found[("gather_once", "overlapped, read unsummed")] = (
            sum(not torch.allclose(grads[n], g, rtol=1e-5, atol=1e-6) for n, g in reference.items()), 0, 0)
        results[rank] = found
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reductions() -> dict:
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), results), nprocs=WORLD, start_method="spawn")
    assert sorted(results.keys()) == list(range(WORLD))
    return dict(results)


@pytest.mark.parametrize("layout", ["full_shard", "node_reshard", "gather_once", "hybrid"])
@pytest.mark.parametrize("reduce_scatter", ["native", "all_to_all"])
def test_every_layout_reduces_to_one_process_gradient(reductions, layout, reduce_scatter):
    for rank, found in reductions.items():
        worst, norm_error, _ = found[(layout, reduce_scatter)]
        assert worst < 1e-5, f"rank {rank}: {layout}/{reduce_scatter} gradient off by {worst:.2e} (relative)"
        assert norm_error < 1e-5, f"rank {rank}: {layout}/{reduce_scatter} gradient norm off by {norm_error:.2e}"


def test_bf16_reduction_stays_within_bf16_rounding(reductions):
    for rank, found in reductions.items():
        for case in (("full_shard", "all_to_all bf16"), ("gather_once", "overlapped bf16")):
            worst, norm_error, _ = found[case]
            # each slice rounded to bf16 (8 bits of mantissa) once before the fp32 sum: within 2⁻⁷ of the mean
            assert worst < 2**-7, f"rank {rank}: {case} reduction off by {worst:.2e}"
            assert norm_error < 2**-7


def test_overlapped_reductions_equal_one_process_and_are_summed_only_at_the_end(reductions):
    """gather_once's reduce-scatters issued on gloo's thread and summed later give the one-process
    gradient; read before `finish()`, the units still in flight (the last two reduced: the first
    block and the root) are not summed yet, so the reductions really were left running."""
    for rank, found in reductions.items():
        worst, norm_error, _ = found[("gather_once", "overlapped")]
        assert worst < 1e-5 and norm_error < 1e-5, (rank, worst, norm_error)
        unsummed, _, _ = found[("gather_once", "overlapped, read unsummed")]
        assert unsummed >= 2, f"rank {rank}: every gradient was summed before finish(): nothing overlapped"


def test_a_reduce_scatter_that_sums_is_caught(reductions):
    """The comparison above fails on the fault of pytorch#162338: the gradient W× too large."""
    for rank, found in reductions.items():
        worst, norm_ratio, _ = found[("full_shard", "summing")]
        assert worst > 1.0 and norm_ratio == pytest.approx(WORLD, rel=1e-4), (rank, worst, norm_ratio)


def test_node_reshard_makes_one_post_forward_mesh(reductions):
    """5 modules reshard to the node: one 2 × 2 mesh (its two dimensions' groups), not one per module."""
    for rank, found in reductions.items():
        assert found[("node_reshard", "native")][2] <= 2, found[("node_reshard", "native")]
        assert found[("hybrid", "native")][2] <= 2  # the 2-D mesh itself
