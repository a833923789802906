"""Online RL on 2 gloo ranks (loopback) equals one process on the same completions: each rank takes
one prompt's group whole, its advantages computed there (scale_rewards=batch: the global batch's
std, one all-reduce), the loss divided by the global count ÷ 2 and the gradients averaged as DDP
averages them; the step's loss and gradient equal those of one process taking both groups, for
dapo (a global token count) and grpo (a mean per completion), and where the second group's rewards
are all equal (rank 1 then trains none of its completions, each micro-batch keeping one to run
its forward, while their counts still divide the loss). And a GRPO run through the CLI on 2
FSDP ranks with LoRA, the KL to the reference and the block-wise head."""

from __future__ import annotations

import contextlib
import json
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


def _scores(equal_second: bool = False) -> torch.Tensor:
    """Varied within each group; `equal_second`: the second group's all equal (its advantages 0, so
    rank 1 leaves every completion out of its rows but the one that keeps its forward running)."""
    return torch.tensor([[2.0 if equal_second and i >= NUM_GENERATIONS else float((i * 5) % 3)]
                         for i in range(2 * NUM_GENERATIONS)])


def _step(folder: str, loss_type: str, group: slice, equal_second: bool = False):
    """(the rank's loss, its gradient as a flat vector, averaged over ranks where there are several,
    the completions its rows left out)."""
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
    batches = objective.batches_from_completions(model, prompts, _completions()[group], _scores(equal_second)[group],
                                                 3, contextlib.nullcontext)
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
    return pg.all_reduce_sum([loss])[0] / world, grad, sum(b.skipped_completions for b in batches)


# (loss type, the second group's rewards all equal)
CASES = (("dapo", False), ("grpo", False), ("dapo", True))


def _rank(rank: int, port: int, folder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        group = slice(rank * NUM_GENERATIONS, (rank + 1) * NUM_GENERATIONS)
        for case in CASES:  # one pair of processes for all: spawning is most of the cost
            loss, grad, skipped = _step(folder, case[0], group, case[1])
            results[(rank, case)] = (loss, grad.tolist(), skipped)
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_one_process_s_loss_and_gradient(tiny_model_dir):
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), str(tiny_model_dir), results), nprocs=2, start_method="spawn")
    for case in CASES:
        one_loss, one_grad, one_skipped = _step(str(tiny_model_dir), case[0], slice(None), case[1])
        assert float(one_grad.norm()) > 0
        # the equal group: micro-batches of 3 over its 4 on rank 1 leave 2 out (the last keeps its one)
        assert [results[(rank, case)][2] for rank in (0, 1)] == ([0, 2] if case[1] else [0, 0])
        assert one_skipped == (3 if case[1] else 0)  # one process: [a a a] [a b b] [b b]
        for rank in (0, 1):
            loss, grad, _ = results[(rank, case)]
            assert loss == pytest.approx(one_loss, abs=1e-6), (case, rank)
            assert torch.allclose(torch.tensor(grad), one_grad, atol=1e-6), (case, rank)


def test_grpo_trains_on_two_fsdp_ranks_with_lora_and_the_reference(tmp_path, cache_dir, tiny_model):
    """The CLI on 2 FSDP ranks: each samples its prompts' groups from the sharded policy on the fused
    decoder (the ranks gather the weights, adapters merged, together, then decode alone), the KL to
    the reference (the adapters off) is logged; the log-probabilities come from the block-wise head
    (model.chunked_loss), which reads the head's weight gathered by FSDP2's root."""
    from pydoc_data.topics import topics

    from harness.run_cli import run_cli
    from harness.run_metrics import metrics_rows
    from harness.tiny_run import tiny_overrides

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Topic: {name}\nFirst word:", "answer": name}) + "\n"
                               for name in sorted(topics)[:40]))
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{
        "model.name_or_path": tiny_model(), "data.source": prompts, "data.format": "auto", "data.seq_len": 64,
        "data.val_fraction": 0.1, "data.max_documents": "null", "train.objective": "grpo",
        "train.rewards": '["regex:^ "]', "train.num_generations": 4, "train.max_completion_length": 8,
        "train.global_batch_size": 16, "train.micro_batch_size": 4, "train.max_steps": 2, "train.eval_every": 2,
        "model.lora.enabled": "true", "model.lora.rank": 4, "train.rl_beta": 0.04, "train.lr": 1e-2,
        "parallel.strategy": "fsdp", "model.chunked_loss": "true"}), "--nproc-per-node", "2", check=True)
    rows = metrics_rows(out)
    assert len(rows) == 2 and rows[1]["kl"] > 0 and "eval_reward" in rows[1]
    assert "rollouts: the fused decoder" in proc.stderr, proc.stderr[-2000:]
