"""Rollouts from an FSDP2-sharded policy, on 2 gloo ranks: each rank samples its own prompts, of
its own lengths, its rows stopping at their own times, and gets what the same model unsharded gives
on that rank's prompts with the same generator, on both paths:

- fused (the default): the ranks gather the weights together once (a rank with no rows too), then
  each decodes alone; under a bf16 mixed-precision policy it decodes in bf16, as the unsharded
  model cast to bf16 does;
- modules (`fused=False`, what ZeRO-3 and the models the fused decoder does not run take): a sharded
  forward gathers every block's weights from both ranks, so the ranks must run the same number of
  forwards: `any_rank_running` keeps a rank whose rows are done stepping (on a dummy row) until the
  other is done too; were it to stop early, the other rank's next gather would wait for ever (here:
  until the group's timeout fails it).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_helpers import free_port

pytestmark = pytest.mark.slow

WORLD = 2
# per rank: prompts of different lengths, and a different max_new_tokens, so the ranks finish apart
CASES = {
    "apart": {0: ([[5, 9, 13, 2, 44, 71, 8], [3, 17]], 3), 1: ([[60, 61, 62, 63], [11], [7, 7, 7, 7, 7, 7, 7, 7, 7]], 9)},
    "one rank empty": {0: ([], 4), 1: ([[21, 22, 23], [24]], 6)},
}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _any_rank_running(local: bool) -> bool:
    flag = torch.tensor([int(local)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank that falls out of step leaves the other waiting in a gather: fail in a minute, not hang
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from cputrain.model.skeleton import decoder_blocks
        from cputrain.rollouts.sampling import SamplingSettings, sample

        def shard(model, **policy):
            for block in decoder_blocks(model):
                fully_shard(block, **policy)
            fully_shard(model, **policy)
            return model.train()  # as the trainer holds it: sample() puts it in eval and back

        unsharded, sharded = _model().eval(), shard(_model())
        # bf16 as the fsdp strategy computes it: fp32 shards, gathered in bf16 by the policy
        unsharded_bf16 = _model().to(torch.bfloat16).eval()
        sharded_bf16 = shard(_model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        found = {}
        for case, per_rank in CASES.items():
            prompts, max_new_tokens = per_rank[rank]
            for temperature in (0.0, 1.0):
                free = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature)
                alone = sample(unsharded, prompts, free, torch.Generator().manual_seed(rank))
                # a stop token the first row writes: that row ends early, the others later or clipped
                stop = (alone.completion_ids[0][1],) if prompts else ()
                settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop)
                for path, policy, reference in (("fused", sharded, unsharded), ("modules", sharded, unsharded),
                                                ("fused bf16", sharded_bf16, unsharded_bf16)):
                    expected = sample(reference, prompts, settings, torch.Generator().manual_seed(rank))
                    got = sample(policy, prompts, settings, torch.Generator().manual_seed(rank), _any_rank_running,
                                 fused=path != "modules")
                    found[(case, temperature, path)] = (got.completion_ids, got.stopped, expected.completion_ids,
                                                        expected.stopped, policy.training, got.path)
        # what decoder_weights() holds on a sharded rank: every tensor gathered and copied, as the plan counts it
        from cputrain.rollouts.decoder_weights import decoder_weights
        from cputrain.rollouts.fused_weight_size import fused_weight_bytes

        for name, policy in (("fp32", sharded), ("bf16", sharded_bf16)):
            held = decoder_weights(policy, None)
            tensors = [held.embed, held.head, held.final_norm] + [
                t for b in held.blocks for t in (b.input_norm, b.qkv, b.out, b.post_norm, b.gate_up, b.down)]
            found[("bytes", name)] = (sum(t.numel() * t.element_size() for t in tensors),
                                      fused_weight_bytes(policy.config, name, gathered=True), str(held.dtype))
        results[rank] = found
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rollouts() -> dict:
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), results), nprocs=WORLD, start_method="spawn")
    assert sorted(results.keys()) == list(range(WORLD))
    return dict(results)


@pytest.mark.parametrize("path", ["fused", "modules", "fused bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_rank_samples_what_the_unsharded_model_does(rollouts, case, temperature, path):
    for rank, found in rollouts.items():
        got, got_stopped, expected, expected_stopped, training, ran = found[(case, temperature, path)]
        assert got == expected, f"rank {rank}: sharded {got} != unsharded {expected}"
        assert got_stopped == expected_stopped
        assert training, f"rank {rank}: the sharded model was left in eval mode"
        if got:  # a rank with no rows samples nothing on either path
            assert ran == path.split()[0], f"rank {rank} sampled through the {ran} path"


def test_the_ranks_finished_apart(rollouts):
    """The case that needs the lockstep: one rank's rows end before the other's."""
    lengths = {rank: max((len(c) for c in found[("apart", 0.0, "modules")][0]), default=0)
               for rank, found in rollouts.items()}
    assert lengths[0] < lengths[1]


def test_a_sharded_ranks_fused_weights_are_what_the_plan_counts(rollouts):
    for rank, found in rollouts.items():
        for name in ("fp32", "bf16"):
            held, planned, dtype = found[("bytes", name)]
            assert held == planned > 0, f"rank {rank}, {name}: {held} bytes held, {planned} planned"
            assert dtype == f"torch.{'float32' if name == 'fp32' else 'bfloat16'}"
