"""LoRA through peft, in one process: adapters on the meta skeleton, a frozen base in the compute
dtype with no gradients or optimizer state, peft's init from the seed, the FLOPs counted, the base
fingerprint, and the bad inputs (targets matching nothing, unknown model types, bad ranks,
resuming across LoRA and full fine-tuning)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cputrain import model as models
from cputrain.config import LLAMA_PROJECTIONS, Config, LoraConfig, ModelConfig
from cputrain.config.file import load_config
from cputrain.errors import ConfigError, ModelError, RunFolderError
from cputrain.lora.adapters import add_adapters, base_file_name, fill_adapters, is_adapter_parameter, target_modules


def _skeleton(folder):
    source = models.resolve_source(ModelConfig(name_or_path=str(folder)), vocab_size=None)
    return source, models.build_skeleton(source, ModelConfig())


def _lora_model(folder, dtype=torch.float32, seed=0, compute_dtype=None, **lora):
    """What the single strategy builds: skeleton + adapters, materialized, base from the file."""
    source, skeleton = _skeleton(folder)
    initial = add_adapters(skeleton, LoraConfig(enabled=True, **lora), frozen_dtype=dtype, seed=seed,
                           compute_dtype=compute_dtype)
    models.materialize(skeleton)
    models.load_into(skeleton, source.folder, file_name_of=base_file_name)
    fill_adapters(skeleton, initial)
    return skeleton, initial


def test_adapters_on_every_projection_base_frozen_in_bf16(tiny_model_dir):
    _, skeleton = _skeleton(tiny_model_dir)
    initial = add_adapters(skeleton, LoraConfig(enabled=True, rank=4), frozen_dtype=torch.bfloat16, seed=0)
    layers = skeleton.config.num_hidden_layers
    assert len(initial) == 2 * len(LLAMA_PROJECTIONS) * layers  # A and B on all 7 projections of every block
    for name, param in skeleton.named_parameters():
        if is_adapter_parameter(name):
            assert param.requires_grad and param.dtype == torch.float32, name
            assert param.shape == initial[name].shape
        else:  # frozen: 2 bytes per parameter, never a gradient
            assert not param.requires_grad and param.dtype == torch.bfloat16, name
    q = skeleton.model.layers[0].self_attn.q_proj
    assert initial["model.layers.0.self_attn.q_proj.lora_A.default.weight"].shape == (4, q.in_features)
    assert initial["model.layers.0.self_attn.q_proj.lora_B.default.weight"].shape == (q.out_features, 4)


def test_init_is_peft_s_and_follows_the_seed(tiny_model_dir):
    def init(seed, how=True):
        _, skeleton = _skeleton(tiny_model_dir)
        return add_adapters(skeleton, LoraConfig(enabled=True, init_weights=how), torch.float32, seed=seed)

    a, b, c = init(0), init(0), init(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    a_keys = [k for k in a if ".lora_A." in k]
    assert any(not torch.equal(a[k], c[k]) for k in a_keys)
    assert all(not a[k].any() for k in a if ".lora_B." in k)  # B = 0: the model starts as the base
    # kaiming_uniform(a=√5) as nn.Linear: bound 1/√fan_in
    fan_in = a[a_keys[0]].shape[1]
    assert a[a_keys[0]].abs().max() <= fan_in**-0.5 + 1e-6
    gauss = init(0, "gaussian")
    assert all(not gauss[k].any() for k in gauss if ".lora_B." in k)
    both = init(0, False)
    assert all(both[k].any() for k in both)  # peft's init_lora_weights=False: B random too


def test_starts_as_the_base_and_trains_only_the_adapters(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from cputrain.config import TrainConfig
    from cputrain.parallel.adamw import build_adamw

    model, initial = _lora_model(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 16))
    assert torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)

    optimizer = build_adamw(model, TrainConfig(lr=1e-2))
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = dict(model.named_parameters())
    assert in_optimizer == {id(named[n]) for n in initial}
    frozen_before = {n: p.detach().clone() for n, p in named.items() if not is_adapter_parameter(n)}
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None for n, p in named.items() if not is_adapter_parameter(n))
    assert all(named[n].grad is not None for n in initial)
    optimizer.step()
    assert all(torch.equal(named[n], t) for n, t in frozen_before.items())
    assert any(not torch.equal(named[n], initial[n]) for n in initial)
    state = optimizer.state_dict()["state"]
    assert len(state) == len(initial)  # AdamW moments for the adapters only


@pytest.mark.parametrize("tie", [True, False], ids=["tied-head", "own-head"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-loss", "plain-head"])
def test_bf16_stored_base_computes_as_the_fp32_stored_one(tiny_model, tie, chunked):
    """model.lora.base_dtype=bf16 under fp32 compute, on bf16 files: the same losses and adapter
    updates as the base stored in fp32 (the fp32 copy of bf16 values is exact), with the frozen
    matrices in bf16 and no fp32 copy of one kept for the backward."""
    from cputrain.config import TrainConfig
    from cputrain.kernels.chunked_head import install_chunked_loss
    from cputrain.parallel.adamw import build_adamw

    folder = tiny_model(tie=tie, dtype=torch.bfloat16)
    # 21 tokens: no activation has a frozen matrix's shape (the hook below tells them apart by shape)
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    losses, adapters = {}, {}
    for base_dtype in (torch.float32, torch.bfloat16):
        model, initial = _lora_model(folder, dtype=base_dtype, compute_dtype=torch.float32, init_weights=False)
        if chunked:
            install_chunked_loss(model)
        optimizer = build_adamw(model, TrainConfig(lr=1e-2))
        shapes = {p.shape for p in model.parameters() if not p.requires_grad and p.dim() == 2}
        saved_fp32_weights = []

        def pack(t, out=saved_fp32_weights):
            if t.dtype == torch.float32 and t.shape in shapes:
                out.append(tuple(t.shape))
            return t

        losses[base_dtype] = []
        for _ in range(3):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[base_dtype].append(loss.item())
        adapters[base_dtype] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        stored = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
        if base_dtype == torch.bfloat16:
            assert all(d == torch.bfloat16 for n, d in stored.items() if "norm" not in n), stored
            assert all(d == torch.float32 for n, d in stored.items() if "norm" in n), stored
            assert not saved_fp32_weights, f"fp32 copies of frozen matrices kept for the backward: {saved_fp32_weights}"
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], abs=1e-5)
    assert losses[torch.float32][-1] < losses[torch.float32][0]  # the adapters learn
    for name, value in adapters[torch.float32].items():
        torch.testing.assert_close(adapters[torch.bfloat16][name], value, atol=1e-5, rtol=1e-5)


def test_base_dtype_auto_reads_the_files_headers(tmp_path, tiny_model, tiny_model_dir):
    """auto stores the base in bf16 under fp32 compute only where every matrix in the files is bf16;
    a broken file reads as not bf16 (loading then names it, with no traceback here)."""
    from cputrain.lora.base_storage import base_dtype_choice, files_are_bf16

    bf16_folder = tiny_model(dtype=torch.bfloat16)
    assert files_are_bf16(bf16_folder) and not files_are_bf16(tiny_model_dir)
    assert base_dtype_choice("auto", torch.float32, True)[0] == torch.bfloat16
    assert base_dtype_choice("auto", torch.float32, False)[0] == torch.float32
    assert base_dtype_choice("auto", torch.bfloat16, False)[0] == torch.bfloat16
    assert base_dtype_choice("fp32", torch.float32, True)[0] == torch.float32
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    assert not files_are_bf16(broken)


def test_flops_count_adapter_weight_gradients_only(tiny_model_dir):
    from cputrain.metrics.flops import flops_per_token

    model, initial = _lora_model(tiny_model_dir)
    counts = models.parameter_counts(model)
    adapters = sum(t.numel() for t in initial.values())
    assert counts["trained"] == counts["trained_non_embedding"] == adapters
    n, layers, d, t = counts["non_embedding"], 2, 64, 32
    assert flops_per_token(n, layers, d, t, trained_params=adapters) == 4 * n + 2 * adapters + 12 * layers * d * t
    assert flops_per_token(n, layers, d, t) == 6 * n + 12 * layers * d * t


def test_target_matching_nothing_names_the_linear_layers(tiny_model_dir):
    _, skeleton = _skeleton(tiny_model_dir)
    with pytest.raises(ModelError) as err:
        target_modules(skeleton, LoraConfig(enabled=True, target_modules=["q_proj", "qkv_proj"]))
    text = str(err.value)
    assert "'qkv_proj' names no linear layer" in text and "\n" not in text
    for name in (*LLAMA_PROJECTIONS, "lm_head"):
        assert name in text
    with pytest.raises(ModelError, match="'mlp' names no linear layer"):  # a module, but not a linear one
        target_modules(skeleton, LoraConfig(enabled=True, target_modules=["mlp"]))
    assert target_modules(skeleton, LoraConfig(enabled=True, target_modules=["layers.1.mlp.up_proj"])) == [
        "layers.1.mlp.up_proj"]


def test_model_type_peft_does_not_know():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"model_type": "my-own-lm"})()
            self.fc_in, self.fc_out = nn.Linear(8, 8), nn.Linear(8, 8)

    with pytest.raises(ModelError) as err:
        target_modules(Custom(), LoraConfig(enabled=True))
    assert "model type 'my-own-lm'" in str(err.value) and "fc_in, fc_out" in str(err.value)
    # named explicitly, its linear layers can take adapters
    assert target_modules(Custom(), LoraConfig(enabled=True, target_modules=["fc_in"])) == ["fc_in"]


def test_a_rank_as_wide_as_a_layer_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.lora.adapters import check_rank

    with torch.device("meta"):  # k_proj and v_proj: 2 KV heads × 16 = 32 outputs, the narrowest
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    check_rank(model, LoraConfig(enabled=True, rank=31))
    with pytest.raises(ModelError) as err:
        check_rank(model, LoraConfig(enabled=True, rank=32))
    assert "model.lora.rank 32 is not below the width of" in str(err.value) and "(32)" in str(err.value)
    check_rank(model, LoraConfig(enabled=True, rank=32, target_modules=["q_proj", "o_proj"]))  # 64 wide


@pytest.mark.parametrize("overrides, expected", [
    (["model.lora.rank=0"], "model.lora.rank must be a positive integer"),
    (["model.lora.rank=-4"], "model.lora.rank must be a positive integer"),
    (["model.lora.enabled=true"], "model.lora needs pretrained weights"),
    (["model.lora.enabled=true", "model.name_or_path=m", "parallel.strategy=zero3"], "zero3 does not take model.lora"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules is empty"),
    (["model.lora.init_weights=pissa"], "model.lora.init_weights"),
])
def test_bad_lora_config_is_one_line(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_resuming_across_lora_and_full_is_refused(tmp_path):
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import check_compatible, write_run_config

    for was_lora, expected in ((True, "holds checkpoints of LoRA adapters"), (False, "holds checkpoints of a full fine-tune")):
        run = RunFolder(str(tmp_path / f"run-{was_lora}"))
        old = Config.model_validate({"model": {"name_or_path": "m", "lora": {"enabled": was_lora}}})
        write_run_config(run, old, [])
        run.fs.makedirs(run.step_path(5), exist_ok=True)
        run.write_text("{}", "checkpoints", "step-000005", "trainer_state.json")
        assert run.complete_steps() == [5]
        check_compatible(run, old)  # the same run continues
        new = Config.model_validate({"model": {"name_or_path": "m", "lora": {"enabled": not was_lora}}})
        with pytest.raises(RunFolderError, match=expected) as err:
            check_compatible(run, new)
        assert f"model.lora.enabled={str(was_lora).lower()}" in str(err.value)
        other_rank = Config.model_validate({"model": {"name_or_path": "m", "lora": {"enabled": True, "rank": 4}}})
        if was_lora:
            with pytest.raises(RunFolderError, match="model.lora.rank: 16 there, 4 now"):
                check_compatible(run, other_rank)


def test_fingerprint_tells_bases_apart(tmp_path, tiny_model_dir):
    import shutil

    from cputrain.lora import base_model
    from cputrain.run_folder.layout import RunFolder

    copy = tmp_path / "base"
    shutil.copytree(tiny_model_dir, copy)
    assert base_model.fingerprint(copy) == base_model.fingerprint(tiny_model_dir)
    run = RunFolder(str(tmp_path / "run"))
    base_model.record(run, copy)
    run.fs.makedirs(run.step_path(3), exist_ok=True)
    run.write_text("{}", "checkpoints", "step-000003", "trainer_state.json")
    base_model.check_same_base(run, str(copy))
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(RunFolderError, match="trained on other base weights"):
        base_model.check_same_base(run, str(copy))
