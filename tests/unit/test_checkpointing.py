"""model.activation_checkpointing as a number of blocks, and `auto` by the plan."""

from __future__ import annotations

import pytest

from cputrain.config import checkpointed_blocks, checkpointing_split
from cputrain.config.file import load_config
from cputrain.errors import ConfigError

LAYERS = 4


def _tiny_llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).train()


def _step(model, setting):
    """One forward + backward with `setting` checkpointed blocks: the loss, the gradients, how
    often each block's forward ran, and the bytes autograd saved outside the checkpoints."""
    import torch

    from cputrain import model as models

    models.enable_activation_checkpointing(model, setting)
    calls = [0] * LAYERS
    for i, block in enumerate(models.decoder_blocks(model)):
        # on a module inside the block: transformers checkpoints the block's forward, not its __call__ (hooks)
        block.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}  # storage → bytes: a tensor saved by several ops counts once, the weights not at all

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, calls, sum(saved.values())


def test_the_first_n_blocks_are_recomputed_and_the_step_is_the_same():
    """2 of 4 blocks: those two run their forward again in the backward, the other two once; loss
    and every gradient equal to the step without checkpointing and with every block."""
    import torch

    results = {s: _step(_tiny_llama(), s) for s in (False, 2, True)}
    assert results[False][2] == [1, 1, 1, 1]
    assert results[2][2] == [2, 2, 1, 1]
    assert results[True][2] == [2, 2, 2, 2]
    loss0, grads0, *_ = results[False]
    for setting in (2, True):
        loss, grads, *_ = results[setting]
        assert loss == pytest.approx(loss0, abs=1e-6)
        for name, g in grads0.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_blocks_left_out_keep_their_activations_as_the_plan_counts_them():
    """What autograd saves outside the checkpoints grows by one whole block per block left out,
    and that block is the one the plan adds for each of them (within its ±15%)."""
    from cputrain.plan.memory.activations import activation_bytes
    from cputrain.plan.model_shape import ModelShape

    saved = {n: _step(_tiny_llama(), n)[3] for n in (0, 1, 2, 3, 4)}
    per_block = (saved[0] - saved[4]) / LAYERS
    assert per_block > 0
    for n in (1, 2, 3):
        # up to a few hundred bytes: tensors the kept blocks share (rotary cos/sin) are counted once
        assert saved[n] - saved[4] == pytest.approx((LAYERS - n) * per_block, abs=1024)
    # the plan for this shape: one block left out adds a whole block and drops one input
    m = ModelShape((), layers=LAYERS, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=128,
                   tied_embeddings=False)
    plan = {n: activation_bytes(m, 2, 16, "fp32", n, local_weight_params=0).saved_bytes for n in (0, 1)}
    planned_block = plan[0] - plan[1] + 2 * 16 * 32 * 4  # + the block input (tokens × hidden × fp32)
    assert per_block == pytest.approx(planned_block, rel=0.15)


def test_the_plan_keeps_n_inputs_and_the_other_blocks_whole():
    from cputrain.plan.memory.activations import activation_bytes
    from cputrain.plan.model_shape import ModelShape

    m = ModelShape((), layers=8, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=100, tied_embeddings=False)

    def saved(setting):
        return activation_bytes(m, 2, 32, "fp32", setting, local_weight_params=0).saved_bytes

    none, every = saved(False), saved(True)
    block_input = 2 * 32 * 64 * 4  # tokens × hidden, fp32 under fp32 compute
    block = saved(6) - saved(7) + block_input  # (6 inputs + 2 blocks) − (7 inputs + 1 block) + 1 input
    head = none - 8 * block
    assert block > 10 * block_input
    for n in range(1, 8):
        assert saved(n) == head + n * block_input + (8 - n) * block
    assert every == head + 8 * block_input + block  # every block: one recomputed at a time
    assert saved(8) == every and saved(0) == none and saved(99) == every


def _plan_config(*extra):
    return load_config(None, ["model.arch.hidden_size=64", "model.arch.intermediate_size=128",
                              "model.arch.num_hidden_layers=6", "model.arch.num_attention_heads=4",
                              "model.arch.num_key_value_heads=2", "model.tokenizer_vocab_size=512",
                              "data.seq_len=512", "train.micro_batch_size=8", "train.global_batch_size=8",
                              "hardware.precision=fp32", *extra])


def test_auto_takes_the_fewest_blocks_that_fit_the_node():
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.memory.checkpointing import MEMORY_FRACTION, checkpointing_choice

    # the keys training.choices decides before activation checkpointing, as a one-rank fp32 run decides them
    cfg = _plan_config("model.activation_checkpointing=auto", "parallel.strategy=single",
                       "model.attn_implementation=sdpa", "model.chunked_loss=false")

    def peak_gib(setting):
        c = cfg.model_copy(update={"model": cfg.model.model_copy(update={"activation_checkpointing": setting})})
        return make_plan(c, 1).peak_rank.total_bytes / 2**30

    peaks = {n: peak_gib(n) for n in range(7)}
    assert all(peaks[n] > peaks[n + 1] for n in range(5))  # each block checkpointed saves memory up to the last
    # a node that holds the run without checkpointing
    blocks, why = checkpointing_choice(cfg, 1, 1, memory_gib=peaks[0] / MEMORY_FRACTION * 1.01)
    assert blocks is False and "no block runs its forward twice" in why
    # a node that holds selective checkpointing but not the run without it: selective before any whole block
    selective = peak_gib("selective")
    assert peaks[2] < selective < peaks[0]  # this shape: between 1 and 2 whole blocks' savings
    blocks, why = checkpointing_choice(cfg, 1, 1, memory_gib=(selective + peaks[0]) / 2 / MEMORY_FRACTION)
    assert blocks == "selective" and "no matmul twice" in why
    # below selective: the fewest whole blocks with which the others selective, or keeping
    # everything, fit (the mix keeps less unless nearly every block is whole), named with the budget
    mixed = {n: peak_gib(f"{n}+selective") for n in range(7)}
    assert all(mixed[n] > mixed[n + 1] for n in range(6))
    assert mixed[1] < peaks[1] and mixed[5] > peaks[5]
    for n in (2, 3):
        memory = (mixed[n] + mixed[n - 1]) / 2 / MEMORY_FRACTION  # fits with n, not with n − 1
        blocks, why = checkpointing_choice(cfg, 1, 1, memory_gib=memory)
        assert blocks == f"{n}+selective", (n, blocks)
        assert f"the first {n} of 6 blocks whole, the other {6 - n} selective" in why
        assert f"selective {selective:.1f} GiB" in why
    memory = (peaks[5] + peaks[4]) / 2 / MEMORY_FRACTION  # 5 whole blocks fit, 5+selective does not
    blocks, why = checkpointing_choice(cfg, 1, 1, memory_gib=memory)
    assert blocks == 5 and "the first 5 of 6 blocks whole, the others keeping everything" in why
    # two ranks on the node: each has half of it
    memory = (mixed[3] + mixed[2]) / 2 / MEMORY_FRACTION
    assert checkpointing_choice(cfg, 1, 2, memory_gib=2 * memory)[0] == checkpointing_choice(cfg, 1, 1, memory)[0] \
        == "3+selective"
    # nothing fits: every block, and the run's memory warning follows
    blocks, why = checkpointing_choice(cfg, 1, 1, memory_gib=peaks[6] * 0.5)
    assert blocks is True and "every block" in why


def test_auto_under_zero3_takes_whole_blocks_only():
    """zero3 takes no selective checkpointing: the fewest whole blocks, the others keeping everything."""
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.memory.checkpointing import MEMORY_FRACTION, checkpointing_choice

    cfg = _plan_config("model.activation_checkpointing=auto", "parallel.strategy=zero3",
                       "model.attn_implementation=sdpa", "model.chunked_loss=false")
    peaks = {n: make_plan(cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"activation_checkpointing": n})}), 1).peak_rank.total_bytes / 2**30 for n in (2, 3)}
    blocks, why = checkpointing_choice(cfg, 1, 1, memory_gib=(peaks[3] + peaks[2]) / 2 / MEMORY_FRACTION)
    assert blocks == 3 and "the first 3 of 6 blocks whole, the others keeping everything" in why
    assert "selective" not in why


def test_the_setting_is_checked_and_auto_is_never_counted_unresolved():
    with pytest.raises(ConfigError, match="model.activation_checkpointing is -1"):
        load_config(None, ["model.activation_checkpointing=-1"])
    assert load_config(None, ["model.activation_checkpointing=3"]).model.activation_checkpointing == 3
    with pytest.raises(ValueError, match="resolved by the run"):
        checkpointed_blocks("auto", 4)
    assert [checkpointed_blocks(s, 4) for s in (False, True, 0, 2, 9, "selective", "3+selective", "9+selective")] \
        == [0, 4, 0, 2, 4, 0, 3, 4]
    assert [checkpointing_split(s, 4) for s in (True, 2, "selective", "3+selective")] == [(4, 0), (2, 0), (0, 4),
                                                                                           (3, 1)]
    assert load_config(None, ["model.activation_checkpointing=3+selective"]).model.activation_checkpointing == \
        "3+selective"
    with pytest.raises(ConfigError, match=r"use true or false, or a whole number, or auto or selective, or "
                                          r"N\+selective$"):
        load_config(None, ["model.activation_checkpointing=three+selective"])


def test_cputrain_plan_plans_auto_as_every_block_and_says_so():
    from cputrain.training.choices import decide_and_plan

    auto = decide_and_plan(_plan_config("model.activation_checkpointing=auto"), 1)
    every = decide_and_plan(_plan_config("model.activation_checkpointing=true"), 1)
    assert auto.ranks == every.ranks
    assert any("model.activation_checkpointing=auto" in note for note in auto.notes)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_weights_check_finds_any_non_finite_value(bad):
    import torch

    from cputrain.parallel.base import all_finite

    tensors = [torch.randn(7, 5), torch.randn(3), torch.empty(0)]
    assert all_finite(tensors) and all_finite([])
    for i in (0, 1):
        broken = [t.clone() for t in tensors]
        broken[i].view(-1)[-1] = bad
        assert not all_finite(broken)
    # +inf in one tensor and -inf in another: their sum is nan, still found
    assert not all_finite([torch.tensor([float("inf")]), torch.tensor([float("-inf")])])
