"""Where a step accumulates, DDP's gradients stay views of its all-reduce buckets from step to step.

With gradient_as_bucket_view, a gradient set to None after a step leaves its bucket allocated, and
the next micro-batches under no_sync build fresh gradients beside the buckets: two copies of the
gradients for most of a step (measured: 0.13 GiB more peak RSS a rank on a ~34M Llama in fp32, 2
micro-batches a step). A step of one micro-batch keeps None, which costs nothing there and spares
the copy DDP's bucket rebuild would make of views. In process, on a one-rank gloo group torn down
after each test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from cputrain.config import Config
from cputrain.parallel.base import StrategyContext
from cputrain.parallel.ddp import DDPStrategy


def _grad_storages(model) -> set[int]:
    return {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}


@pytest.fixture
def ddp(tmp_path):
    """The ddp strategy, the tiny Llama it wrapped, its optimizer and a micro-batch's forward and backward."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    strategy = DDPStrategy(StrategyContext(Config(), 0, 1, torch.float32))
    try:
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=96)
        with torch.device("meta"):
            skeleton = LlamaForCausalLM(config)
        model = strategy.wrap(skeleton)
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))

        def micro_batch(last: bool) -> None:
            with strategy.accumulation(model, last_micro_batch=last):
                model(input_ids=ids, labels=ids).loss.backward()

        yield strategy, model, strategy.build_optimizer(model), micro_batch
    finally:
        strategy.meter.uninstall()
        dist.destroy_process_group()


def test_an_accumulating_step_leaves_the_gradients_in_the_buckets(ddp):
    strategy, model, optimizer, micro_batch = ddp
    for _ in range(2):  # the second step runs on the buckets DDP rebuilt after the first
        micro_batch(last=False)
        micro_batch(last=True)
        in_buckets = _grad_storages(model)
        strategy.step(model, optimizer, grad_clip=1.0)
    assert len(in_buckets) < sum(1 for _ in model.parameters())  # a few flat buckets hold every gradient

    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # zeroed in place
    micro_batch(last=False)  # accumulating under no_sync writes into the same buckets
    assert _grad_storages(model) == in_buckets


def test_a_step_of_one_micro_batch_drops_the_gradients(ddp):
    strategy, model, optimizer, micro_batch = ddp
    micro_batch(last=True)
    strategy.step(model, optimizer, grad_clip=1.0)
    assert all(p.grad is None for p in model.parameters())
