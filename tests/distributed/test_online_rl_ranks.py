"""Online RL on 2 gloo ranks (loopback) equals one process on the same completions: each rank takes
one prompt's group whole, its advantages computed there (scale_rewards=batch: the global batch's
std, one all-reduce), the loss divided by the global count ÷ 2 and the gradients averaged as DDP
averages them; the step's loss and gradient equal those of one process taking both groups, for
dapo (a global token count) and grpo (a mean per completion)."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_helpers import free_port

pytestmark = pytest.mark.slow

NUM_GENERATIONS = 4
PROMPTS = [[5, 9, 12, 7], [8, 3, 30, 2]]


def _completions() -> list[list[int]]:
    return [[10 + (i * 7 + j * 3) % 40 for j in range(2 + i % 4)] for i in range(2 * NUM_GENERATIONS)]


def _scores() -> torch.Tensor:
    return torch.tensor([[float((i * 5) % 3)] for i in range(2 * NUM_GENERATIONS)])


def _step(folder: str, loss_type: str, group: slice):
    """(the rank's loss, its gradient as a flat vector, averaged over ranks where there are several)."""
    from transformers import AutoModelForCausalLM

    from cputrain.distributed import process_group as pg
    from cputrain.objectives.online_rl import GrpoObjective

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = SimpleNamespace(num_generations=NUM_GENERATIONS, max_completion_length=6, temperature=1.0,
                          loss_type=loss_type, scale_rewards="batch", epsilon=0.2, epsilon_high=None,
                          num_iterations=1, rl_beta=0.0)
    objective = GrpoObjective(cfg)
    prompts = [p for p in PROMPTS for _ in range(NUM_GENERATIONS)][group]
    batches = objective.batches_from_completions(model, prompts, _completions()[group], _scores()[group], 3,
                                                 contextlib.nullcontext)
    world = dist.get_world_size() if dist.is_initialized() else 1
    items = pg.all_reduce_sum([float(sum(objective.items(b) for b in batches))])[0]
    loss = 0.0
    for batch in batches:
        part, _ = objective.loss(model, batch, items / world)
        part.backward()
        loss += float(part)
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    if world > 1:  # DDP's average
        dist.all_reduce(grad)
        grad /= world
    return pg.all_reduce_sum([loss])[0] / world, grad


LOSS_TYPES = ("dapo", "grpo")


def _rank(rank: int, port: int, folder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        group = slice(rank * NUM_GENERATIONS, (rank + 1) * NUM_GENERATIONS)
        for loss_type in LOSS_TYPES:  # one pair of processes for both: spawning is most of the cost
            loss, grad = _step(folder, loss_type, group)
            results[(rank, loss_type)] = (loss, grad.tolist())
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_one_process_s_loss_and_gradient(tiny_model_dir):
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), str(tiny_model_dir), results), nprocs=2, start_method="spawn")
    for loss_type in LOSS_TYPES:
        one_loss, one_grad = _step(str(tiny_model_dir), loss_type, slice(None))
        assert float(one_grad.norm()) > 0
        for rank in (0, 1):
            loss, grad = results[(rank, loss_type)]
            assert loss == pytest.approx(one_loss, abs=1e-6), (loss_type, rank)
            assert torch.allclose(torch.tensor(grad), one_grad, atol=1e-6), (loss_type, rank)
