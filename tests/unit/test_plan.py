"""The memory planner: exact state bytes per strategy, model shapes from a config, instance choice."""

from __future__ import annotations

import json

import pytest
import torch

from cputrain.config.file import load_config
from cputrain.errors import ConfigError, ModelError
from cputrain.plan.memory.accounting import fsdp_rows, state_bytes
from cputrain.plan.memory.build import make_plan
from cputrain.plan.memory.fit import smallest_cluster
from cputrain.plan.instances import builtin_instances, load_instances
from cputrain.plan.model_shape import ModelShape, ParamInfo, model_shape
from cputrain.training.choices import decide_for_plan, decide_and_plan

GIB = 2**30

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "rope_theta": 500000.0,
}


def _decided(cfg, world_size: int = 1):
    """`cfg` with the keys a plan reads decided, as `cputrain plan` decides them."""
    return decide_for_plan(cfg, world_size).config


def _shape(*shapes) -> ModelShape:
    params = tuple(ParamInfo(f"p{i}", s, "root") for i, s in enumerate(shapes))
    return ModelShape(params, layers=1, hidden=4, intermediate=8, heads=1, kv_heads=1, vocab=10, tied_embeddings=False)


def test_zero_accounting_bytes_per_parameter():
    m = _shape((8, 4), (4,))  # 36 elements in 2 tensors
    single = state_bytes(m, "single", "fp32", 1)
    assert (single.param_bytes, single.grad_bytes, single.optimizer_bytes) == (36 * 4, 36 * 4, 36 * 8 + 2 * 4)
    assert state_bytes(m, "ddp", "bf16", 4) == state_bytes(m, "single", "fp32", 1)  # DDP replicates everything
    fsdp = state_bytes(m, "fsdp", "fp32", 4)
    assert fsdp.param_bytes == (2 * 4 + 1) * 4  # 8 rows / 4 ranks = 2 rows of 4; 4 rows / 4 = 1
    z3 = state_bytes(m, "zero3", "bf16", 4)
    # fp32 master + 2 moments per element, and one AdamW `step` per flat group (matrices, vectors)
    assert (z3.param_bytes, z3.grad_bytes, z3.optimizer_bytes) == ((8 + 1) * 2, (8 + 1) * 2, (8 + 1) * 12 + 2 * 4)
    offloaded = state_bytes(m, "zero3", "bf16", 4, offload_optimizer=True)
    assert offloaded.optimizer_bytes == (8 + 1) * 12  # DeepSpeedCPUAdam counts steps in Python


def test_fsdp_pads_dim0_but_moments_hold_owned_rows():
    m = _shape((5, 3))  # 5 rows over 2 ranks: chunks of 3 and 2, storage padded to 3 rows each
    assert [fsdp_rows(5, 2, r) for r in (0, 1)] == [3, 2]
    assert [fsdp_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    r0, r1 = state_bytes(m, "fsdp", "fp32", 2, 0), state_bytes(m, "fsdp", "fp32", 2, 1)
    assert r0.param_bytes == r1.param_bytes == 3 * 3 * 4
    assert r0.optimizer_bytes == 3 * 3 * 8 + 4 and r1.optimizer_bytes == 2 * 3 * 8 + 4


def test_zero3_keeps_small_parameters_whole_beside_their_partitions():
    m = _shape((8, 4), (4,))  # the 4-element vector is under a persistence threshold of 10
    two = state_bytes(m, "zero3", "fp32", 2, persistence_threshold=10)
    assert two.param_bytes == (16 + 2 + 4) * 4  # partitions of both, plus the whole vector
    assert two.grad_bytes == (16 + 2) * 4 and two.optimizer_bytes == (16 + 2) * 12 + 2 * 4
    one = state_bytes(m, "zero3", "fp32", 1, persistence_threshold=10)
    assert one.param_bytes == 36 * 4  # one rank: the partition is the tensor


def test_loading_holds_the_whole_init_only_where_the_code_builds_it_whole(tmp_path):
    from transformers import LlamaConfig

    cfg = load_config(None, ["model.arch.hidden_size=64", "model.arch.intermediate_size=128",
                             "model.arch.num_hidden_layers=2", "model.arch.num_attention_heads=4",
                             "model.arch.num_key_value_heads=2", "parallel.strategy=fsdp", "hardware.precision=fp32",
                             "train.global_batch_size=16", "train.micro_batch_size=4"])
    scratch = decide_and_plan(cfg, 4, vocab_size=512)
    total = scratch.shape.total_params
    # fsdp from scratch: the whole fp32 init beside the rank's shard, freed before the first step.
    assert scratch.ranks[0].load_bytes == total * 4
    assert scratch.ranks[0].load_peak_bytes == scratch.ranks[0].param_bytes + total * 4 + \
        scratch.ranks[0].process_overhead_bytes
    assert scratch.ranks[0].total_bytes == max(scratch.ranks[0].training_peak_bytes, scratch.ranks[0].load_peak_bytes)
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)  # a model folder (its weights are not read)
    folder = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(tmp_path)})})
    loaded = decide_and_plan(folder, 4)  # rows read straight into the shard
    assert loaded.ranks[0].load_bytes == 0
    ddp = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"strategy": "ddp"})})
    # ddp initialises in place, with no start-up broadcast (replica_check): nothing beyond the weights.
    assert decide_and_plan(ddp, 4, vocab_size=512).ranks[0].load_bytes == 0


def test_shape_from_config_json_counts_every_parameter(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)  # config.json only: no weights
    shape = model_shape(load_config().model, config_json=str(tmp_path))
    torch.manual_seed(0)
    real = LlamaForCausalLM(config)
    assert shape.total_params == sum(p.numel() for p in real.parameters())  # tied head counted once
    assert shape.layers == 3 and shape.kv_heads == 2 and shape.vocab == 300
    assert set(shape.unit_params()) == {"root", "layers.0", "layers.1", "layers.2"}


def test_llama3_8b_sizes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    cfg = load_config(None, ["data.seq_len=2048", "train.micro_batch_size=1", "train.global_batch_size=4",
                             "hardware.precision=bf16", "model.activation_checkpointing=true"])
    cfg.parallel.strategy = "ddp"
    ddp = decide_and_plan(cfg, 4, config_json=str(tmp_path))
    assert ddp.shape.total_params == 8_030_261_248
    assert ddp.peak_rank.param_bytes == 8_030_261_248 * 4
    cfg.parallel.strategy = "fsdp"
    fsdp = decide_and_plan(cfg, 4, config_json=str(tmp_path), instances=builtin_instances())
    assert 0.24 < fsdp.peak_rank.param_bytes / ddp.peak_rank.param_bytes <= 0.26
    assert 30 * GIB < fsdp.peak_rank.total_bytes < 70 * GIB  # "about 50-60 GB per process" by `top`
    assert fsdp.fit is not None and fsdp.fit.instance.amx


def test_activation_checkpointing_and_sequence_length_move_activations():
    base = load_config(None, ["data.seq_len=512", "hardware.precision=fp32"])
    shape = model_shape(base.model, vocab_size=4096)
    a = make_plan(_decided(base), 1, shape=shape).peak_rank.activation_bytes
    longer = make_plan(_decided(base.model_copy(update={"data": base.data.model_copy(update={"seq_len": 1024})})), 1,
                       shape=shape).peak_rank.activation_bytes
    base.model.activation_checkpointing = True
    ckpt = make_plan(_decided(base), 1, shape=shape).peak_rank.activation_bytes
    assert longer > 1.9 * a and ckpt < a


def test_ddp_that_accumulates_plans_its_bucket_rebuild_beside_the_gradients():
    """DDP keeps accumulated gradients as views of its buckets; the one rebuild of the buckets holds
    both for a moment: the plan counts a second copy of the gradients where it outweighs the activations."""
    base = load_config(None, ["data.seq_len=16", "hardware.precision=fp32", "parallel.strategy=ddp",
                              "train.micro_batch_size=1", "train.global_batch_size=2"])
    shape = model_shape(base.model, vocab_size=4096)
    one = make_plan(_decided(base), 2, shape=shape).peak_rank  # 1 micro-batch a rank: gradients dropped
    two = make_plan(_decided(base.model_copy(update={"train": base.train.model_copy(
        update={"global_batch_size": 4})})), 2, shape=shape).peak_rank
    assert one.optimizer_step_bytes == 0 and two.optimizer_step_bytes == two.grad_bytes > 0
    assert two.activation_bytes < two.grad_bytes  # short rows: the rebuild is this plan's working set
    assert two.training_peak_bytes - one.training_peak_bytes == two.grad_bytes - one.activation_bytes


def test_a_4d_mask_is_planned_where_rows_carry_one():
    """Rows of several sequences (packed examples, preference pairs, shared or not) keep one
    micro-batch × seq_len² mask through the backward (bool, and the additive one every layer reads:
    cputrain.data.batch.attention_mask_for); text and one example a row keep none."""
    from cputrain.plan.memory.activations import attention_mask_bytes

    def activations(*overrides):
        cfg = load_config(None, ["data.seq_len=512", "train.micro_batch_size=2", "hardware.precision=bf16",
                                 *overrides])
        return make_plan(_decided(cfg), 1, shape=model_shape(cfg.model, vocab_size=4096)).peak_rank.activation_bytes

    none = activations("data.format=chat", "data.packing=false")
    assert activations() == none  # text: the kernel's own causal mask, no 4D one
    mask = attention_mask_bytes(2, 512, "bf16", "single")
    assert mask == 2 * 512 * 512 * 3  # bf16 under autocast, and the bool
    assert activations("data.format=chat") - none == mask
    for shared in ("true", "false"):
        assert activations("data.format=preference", "train.objective=dpo", f"data.shared_prompt={shared}") - none == mask


def test_builtin_instance_table():
    table = {i.name: i for i in builtin_instances()}
    assert len(table) == 12
    assert (table["c7i.8xlarge"].vcpus, table["c7i.8xlarge"].memory_gib) == (32, 64)
    assert (table["m7i.24xlarge"].vcpus, table["m7i.24xlarge"].memory_gib) == (96, 384)
    assert (table["r7i.48xlarge"].vcpus, table["r7i.48xlarge"].memory_gib) == (192, 1536)
    assert all(i.amx for i in table.values())


def test_smallest_cluster_and_user_table(tmp_path):
    table = tmp_path / "mine.yaml"
    table.write_text("- {name: small.x, vcpus: 8, memory_gib: 16}\n- {name: big.x, vcpus: 64, memory_gib: 256, amx: true}\n")
    instances = load_instances(str(table))
    fit = smallest_cluster(instances, 5 * GIB, world_size=4)
    assert fit.instance.name == "small.x" and fit.nproc_per_node == 2 and fit.nnodes == 2  # 2 × 5.5 GiB in 14.2
    assert smallest_cluster(instances, 40 * GIB, world_size=2).instance.name == "big.x"
    with pytest.raises(ConfigError, match="world size 2: each rank needs"):
        smallest_cluster(instances, 300 * GIB, world_size=2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {name: x, vcpus: many, memory_gib: 1}\n")
    with pytest.raises(ConfigError, match="row 1"):
        load_instances(str(bad))


def test_bad_model_config_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        model_shape(load_config().model, config_json=str(tmp_path))
    with pytest.raises(ConfigError, match="strategy=single runs one rank"):
        make_plan(_decided(load_config(None, ["parallel.strategy=single"]), 2), 2, shape=_shape((4, 4)))


@pytest.mark.parametrize("text, expected", [
    ("[1, 2]", "holds a JSON list, not an object of config fields"),
    ('"llama"', "holds a JSON str"),
    (json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
                 "intermediate_size": 128}), "lacks hidden_size (transformers would take its llama default, hidden_size=4096"),
    (json.dumps({"model_type": "llama", "hidden_size": 64}),
     "lacks num_hidden_layers, num_attention_heads, vocab_size, intermediate_size"),
    (json.dumps({"hidden_size": 64}), "has model_type None"),
], ids=["list", "string", "no-hidden-size", "several-missing", "no-model-type"])
def test_model_config_json_must_describe_the_model(tmp_path, text, expected):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelError) as err:
        model_shape(load_config().model, config_json=str(tmp_path))
    assert expected in str(err.value)


def test_model_config_json_fields_under_a_model_types_own_names(tmp_path):
    """GPT-2 stores hidden_size as n_embd (its attribute_map): present, so accepted."""
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100).save_pretrained(tmp_path)
    assert model_shape(load_config().model, config_json=str(tmp_path)).hidden == 32


# --- LoRA: adapters trained in full, the base frozen at its stored bytes -----------------------

TINY_LORA = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)


def _lora_config(folder, *extra):
    return load_config(None, [f"model.name_or_path={folder}", "model.lora.enabled=true", "model.lora.rank=4",
                              "hardware.precision=bf16", "data.seq_len=16", "train.micro_batch_size=2",
                              "train.global_batch_size=2", *extra])


def test_lora_shape_counts_adapters_and_frozen_base(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(**TINY_LORA, tie_word_embeddings=False).save_pretrained(tmp_path)
    cfg = _lora_config(tmp_path)
    plan = decide_and_plan(cfg, 1)
    m = plan.shape
    # Per layer, r·in + out·r for each projection (kv width 16, MLP width 64), rank 4:
    # q 4·32+32·4, k 4·32+16·4, v the same, o as q, gate 4·32+64·4, up the same, down 4·64+32·4.
    per_layer = 256 + 192 + 192 + 256 + 384 + 384 + 384
    assert m.trainable_params == 2 * per_layer == 4096
    assert len(m.adapter_inputs()) == 14
    base = 100 * 32 * 2 + 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32  # untied embed + head
    assert m.frozen_params == base
    assert all(p.stored_bytes == 2 for p in m.params if not p.trainable)
    assert all(p.stored_bytes == 4 and ".lora_" in p.name for p in m.params if p.trainable)
    r = plan.ranks[0]
    assert r.param_bytes == base * 2 + 4096 * 4  # frozen bf16 + fp32 adapters
    assert r.grad_bytes == 4096 * 4
    assert r.optimizer_bytes == 4096 * 8 + 28 * 4  # two moments + one `step` per adapter tensor
    assert r.load_bytes == 4096 * 4  # the adapters' initial values, held until they are copied in
    # fp32: the frozen base keeps 4 bytes, still without gradients or optimizer state
    fp32 = decide_and_plan(_lora_config(tmp_path, "hardware.precision=fp32"), 1).ranks[0]
    assert fp32.param_bytes == (base + 4096) * 4 and fp32.grad_bytes == r.grad_bytes


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_lora_bytes_match_the_real_models_tensors(tmp_path, tie):
    """The plan's state bytes against real tensors after an optimizer step, counted by the
    function memory.json uses (cputrain.metrics.phases.state_bytes)."""
    import torch
    from peft import inject_adapter_in_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.lora.adapters import ADAPTER, peft_config
    from cputrain.metrics.phases import state_bytes as measured_state
    from cputrain.parallel.adamw import build_adamw

    config = LlamaConfig(**TINY_LORA, tie_word_embeddings=tie)
    config.save_pretrained(tmp_path)
    cfg = _lora_config(tmp_path, "model.lora.target_modules=[q_proj,v_proj,down_proj]")
    plan = decide_and_plan(cfg, 1).ranks[0]

    torch.manual_seed(0)
    real = LlamaForCausalLM(config)
    inject_adapter_in_model(peft_config(real, cfg.model.lora), real, adapter_name=ADAPTER)
    for p in real.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    torch.nn.init.normal_(real.model.layers[0].self_attn.q_proj.lora_B[ADAPTER].weight)  # B starts at zero
    optimizer = build_adamw(real, cfg.train)
    ids = torch.randint(0, 100, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = real(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()  # gradients are still there: what the step-time measurement sees
    measured = measured_state(real, optimizer)
    assert sum(p.numel() for p in real.parameters() if p.requires_grad) == 2 * (256 + 192 + 384)
    assert (plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes) == (
        measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"])


def test_lora_plan_builds_the_skeleton_the_trainer_builds(tmp_path):
    """`cputrain plan` (from the config) and the run's plan.json (from the trainer's skeleton)
    see the same parameters, trainable flags and dtypes."""
    import torch

    from cputrain import model as models
    from cputrain.lora.adapters import add_adapters
    from cputrain.plan.model_shape import model_shape, shape_of

    from transformers import LlamaConfig

    LlamaConfig(**TINY_LORA, tie_word_embeddings=True).save_pretrained(tmp_path)
    cfg = _lora_config(tmp_path, "model.activation_checkpointing=true", "model.lora.dropout=0.1")
    source = models.resolve_source(cfg.model, vocab_size=None)
    skeleton = models.build_skeleton(source, cfg.model)
    add_adapters(skeleton, cfg.model.lora, frozen_dtype=torch.bfloat16, seed=cfg.seed)
    models.enable_activation_checkpointing(skeleton)
    decided = _decided(cfg)  # targets and base dtype as a run decides them
    planned = model_shape(decided.model, compute_dtype=torch.bfloat16, seed=cfg.seed)
    assert shape_of(skeleton) == planned
    assert make_plan(decided, 1, shape=shape_of(skeleton)).ranks == decide_and_plan(cfg, 1).ranks


def test_lora_under_fsdp_shards_frozen_and_trained_parameters_alike():
    frozen = ParamInfo("layers.0.q_proj.base_layer.weight", (5, 3), "layers.0", trainable=False, stored_bytes=2)
    lora_a = ParamInfo("layers.0.q_proj.lora_A.default.weight", (4, 2), "layers.0")
    m = ModelShape((frozen, lora_a), layers=1, hidden=3, intermediate=6, heads=1, kv_heads=1, vocab=10,
                   tied_embeddings=False)
    ranks = [state_bytes(m, "fsdp", "bf16", 3, r) for r in range(3)]
    # dim 0 padded to 2 rows on every rank: frozen 2·3 bf16, adapter 2·2 fp32 (and its gradient)
    assert [r.param_bytes for r in ranks] == [2 * 3 * 2 + 2 * 2 * 4] * 3
    assert [r.grad_bytes for r in ranks] == [2 * 2 * 4] * 3
    # moments only for the adapter rows a rank owns (4 rows over 3 ranks: 2, 2, 0), one `step` each
    assert [r.optimizer_bytes for r in ranks] == [2 * 2 * 8 + 4, 2 * 2 * 8 + 4, 4]
    with pytest.raises(ValueError, match="zero3"):
        state_bytes(m, "zero3", "bf16", 2)


def test_lora_adds_only_small_activations_and_no_autocast_copies_of_the_base(tmp_path):
    from transformers import LlamaConfig

    from cputrain.plan.memory.activations import activation_bytes

    LlamaConfig(**TINY_LORA, tie_word_embeddings=False).save_pretrained(tmp_path)
    full_cfg = load_config(None, [f"model.name_or_path={tmp_path}", "hardware.precision=bf16", "data.seq_len=16",
                                  "train.micro_batch_size=2", "train.global_batch_size=2"])
    full, lora = decide_and_plan(full_cfg, 1), decide_and_plan(_lora_config(tmp_path), 1)
    # bf16: the plan takes the chunked head, as model.chunked_loss=auto resolves there
    full_act = activation_bytes(full.shape, 2, 16, "bf16", False, 0, chunked_loss=True).saved_bytes
    lora_act = activation_bytes(lora.shape, 2, 16, "bf16", False, 0, chunked_loss=True).saved_bytes
    # lora_A's output (32 tokens × r=4 in bf16, per adapted linear); the frozen head keeps neither the gradient
    # of every logit (32 × V in bf16) nor a weight gradient (V × h in fp32)
    v, h = full.shape.vocab, full.shape.hidden
    assert lora_act - full_act == 14 * 32 * 4 * 2 - 32 * v * 2 - v * h * 4
    # autocast keeps bf16 copies of the fp32 weights: every weight in full fine-tuning, the adapters under LoRA
    assert full.ranks[0].activation_bytes == full_act + full.shape.total_params * 2
    assert lora.ranks[0].activation_bytes == lora_act + 4096 * 2
    # with checkpointing the kept block inputs follow the hidden states' dtype: bf16 behind a frozen bf16 embedding
    assert activation_bytes(lora.shape, 2, 16, "bf16", True, 0).saved_bytes < \
        activation_bytes(full.shape, 2, 16, "bf16", True, 0).saved_bytes


def test_llama3_8b_lora_fits_one_node_where_full_fine_tuning_does_not():
    """The shipped 8B config with LoRA on one node (single, bf16, r=16, seq 2048, mb 1,
    activation checkpointing), planned offline from the built-in Llama-3-8B shape."""
    from cputrain.errors import UserError
    from cputrain.k8s.options import ClusterOptions
    from cputrain.k8s.render import render
    from cputrain.plan.memory.fit import fits

    instances = builtin_instances()
    table = {i.name: i for i in instances}
    single = ["parallel.strategy=single", "hardware.precision=bf16"]
    lora_cfg = load_config("configs/llama3-8b-fsdp.yaml", [*single, "model.lora.enabled=true"])
    lora = decide_and_plan(lora_cfg, 1, instances=instances)
    full = decide_and_plan(load_config("configs/llama3-8b-fsdp.yaml", single), 1, instances=instances)
    assert lora.shape.trainable_params == 32 * 16 * (4096 * 4 + 4096 * 2 + 1024 * 2 + 4096 * 2 + 14336 * 3 + 4096)
    assert lora.shape.frozen_params == full.shape.total_params == 8_030_261_248
    r = lora.peak_rank
    assert r.param_bytes == 8_030_261_248 * 2 + 41_943_040 * 4
    assert r.grad_bytes == 41_943_040 * 4 and r.optimizer_bytes == 41_943_040 * 8 + 448 * 4
    assert r.training_peak_bytes < 21 * GIB and r.training_peak_bytes < full.peak_rank.training_peak_bytes / 6
    # Loading reads the bf16 files straight into the bf16 base (plain reads, no mapped pages): beyond the
    # parameters only the adapters' initial values. The training step is now the rank's peak.
    assert r.load_bytes == 41_943_040 * 4
    assert r.total_bytes == r.training_peak_bytes < 21 * GIB and r.total_bytes < full.peak_rank.total_bytes / 6
    # One node of the smallest m7i and r7i sizes holds the LoRA rank; full fine-tuning's does not fit an m7i.8xlarge.
    assert lora.fit.nnodes == 1
    for name in ("m7i.8xlarge", "r7i.8xlarge"):
        assert fits(table[name], r.total_bytes, 1)
    assert not fits(table["m7i.8xlarge"], full.peak_rank.total_bytes, 1)
    # Sharded over the shipped 4 nodes × 2 ranks, a full fine-tuning step still holds more per rank than LoRA's on one.
    fsdp = decide_and_plan(load_config("configs/llama3-8b-fsdp.yaml", ["hardware.precision=bf16"]), 8, nproc_per_node=2)
    assert fsdp.peak_rank.training_peak_bytes > r.training_peak_bytes
    # `cputrain k8s` sizes the pod from the same plan: one m7i.8xlarge holds it, not full fine-tuning.
    opts = dict(name="llama3-8b-lora", image="registry.example.com/cputrain:0.1.0", nnodes=1, nproc_per_node=1,
                instance_type="m7i.8xlarge")
    rendered = render(lora_cfg, ClusterOptions(**opts), instances)
    assert rendered.plan.peak_rank.total_bytes == r.total_bytes
    with pytest.raises(UserError, match="m7i.8xlarge allocates"):
        render(load_config("configs/llama3-8b-fsdp.yaml", single), ClusterOptions(**opts), instances)


def test_llama3_8b_lora_in_fp32_keeps_its_bf16_base():
    """On a CPU without bf16 units (fp32 compute) the 8B base is stored as its files are, in bf16
    (model.lora.base_dtype=auto), and fits 24 GiB; stored in fp32 it would not."""
    from cputrain.plan.memory.activations import upcast_copy_bytes

    args = ["parallel.strategy=single", "hardware.precision=fp32", "model.lora.enabled=true"]
    auto = decide_and_plan(load_config("configs/llama3-8b-fsdp.yaml", args), 1)
    fp32 = decide_and_plan(load_config("configs/llama3-8b-fsdp.yaml", [*args, "model.lora.base_dtype=fp32"]), 1)
    norms = 32 * 2 * 4096 + 4096  # kept in fp32: small, and not used by a linear layer
    adapters = 41_943_040
    assert auto.peak_rank.param_bytes == (8_030_261_248 - norms) * 2 + norms * 4 + adapters * 4
    assert fp32.peak_rank.param_bytes == 8_030_261_248 * 4 + adapters * 4
    # the head (128,256 × 4096) is converted to fp32 for the loss, beside every saved activation
    assert upcast_copy_bytes(auto.shape, "fp32") == 128_256 * 4096 * 4 and upcast_copy_bytes(fp32.shape, "fp32") == 0
    assert auto.peak_rank.total_bytes < 21 * GIB < 30 * GIB < fp32.peak_rank.total_bytes


def test_compare_lora_prints_both_side_by_side(capsys):
    from cputrain.cli import main

    assert main(["plan", "configs/llama3-8b-fsdp.yaml", "parallel.strategy=single", "--compare-lora"]) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning" in out and "LoRA rank 16 on down_proj, gate_proj, k_proj" in out
    rows = {line.split("  ")[0]: line.split()[-2:] for line in out.splitlines()
            if line.startswith(("gradients", "trained"))}
    assert rows["trained parameters"] == ["8,030,261,248", "41,943,040"]
    assert main(["plan", "configs/llama3-8b-fsdp.yaml", "parallel.strategy=zero3", "--compare-lora"]) != 0
    assert "zero3 does not take model.lora" in capsys.readouterr().err


def test_loading_from_a_folder_counts_the_mapped_weight_files(tmp_path):
    """single/ddp read every tensor through safetensors' memory map: the files' pages are in RSS
    until they are closed. fsdp maps only rows whose file dtype is not the parameter's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.plan.model_shape import weight_file_bytes

    config = LlamaConfig(**TINY_LORA, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)  # fp32 safetensors, the tied head stored once
    file_data = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    cfg = _lora_config(tmp_path)
    assert set(weight_file_bytes(cfg.model).values()) == {4}
    lora = decide_and_plan(cfg, 1)
    base = lora.shape.frozen_params
    assert all(p.file_bytes == (0 if p.trainable else 4) for p in lora.shape.params)
    largest = 100 * 32 * 4  # the embedding: the largest fp32 tensor read into a buffer, then cast to bf16
    assert lora.ranks[0].load_bytes == largest + 4096 * 4  # + the adapters' initial values; no mapped pages
    assert base * 4 <= file_data < base * 4 + 64 * 1024  # the files are their tensors and a header
    # fsdp reads an fp32 file into its fp32 masters with plain reads; into a bf16 frozen base through a
    # buffer of its largest rows
    full_fsdp = load_config(None, [f"model.name_or_path={tmp_path}", "parallel.strategy=fsdp",
                                   "hardware.precision=bf16"])
    assert decide_and_plan(full_fsdp, 2).ranks[0].load_bytes == 0
    lora_fsdp = decide_and_plan(_lora_config(tmp_path, "parallel.strategy=fsdp", "train.global_batch_size=4"), 2)
    owned = sum(-(-p.shape[0] // 2) * (p.numel // p.shape[0]) for p in lora_fsdp.shape.params if not p.trainable)
    assert lora_fsdp.ranks[0].load_bytes == largest // 2 + 4096 * 4
    assert owned * 4 > largest  # (the shard read through safetensors' map would have counted all of it)


def test_the_plan_follows_the_head_the_run_uses():
    """The chunked head keeps one compute-dtype copy of the logits' gradient and one block of fp32
    logits instead of three fp32 copies: at Llama-3's vocabulary that is GiBs per rank."""
    fp32_llama3_head = ["data.seq_len=1024", "train.micro_batch_size=2", "train.global_batch_size=2",
                        "hardware.precision=fp32"]
    plain = decide_and_plan(load_config(None, [*fp32_llama3_head, "model.chunked_loss=false"]), 1, vocab_size=128_256)
    chunked = decide_and_plan(load_config(None, [*fp32_llama3_head, "model.chunked_loss=true"]), 1, vocab_size=128_256)
    auto = decide_and_plan(load_config(None, fp32_llama3_head), 1, vocab_size=128_256)
    saved = plain.ranks[0].activation_bytes - chunked.ranks[0].activation_bytes
    assert saved > 1.5 * 2048 * 128_256 * 4  # about two of the three fp32 logits copies
    assert auto.inputs.chunked_loss is True  # fp32 with 1 GiB of logits per micro-batch
    small = decide_and_plan(load_config(None, ["hardware.precision=fp32"]), 1, vocab_size=4096)
    assert small.inputs.chunked_loss is False  # the demo in fp32: the plain head


def test_plan_and_k8s_refuse_a_world_size_that_train_would_refuse():
    """global_batch_size 8 over 3 ranks is no whole micro-batches per rank: `train` refuses it,
    so the plan (and k8s, which renders from it) refuses it too, with the same line."""
    with pytest.raises(ConfigError, match=r"global_batch_size \(8\) is not divisible by micro_batch_size × world size \(4 × 3\)"):
        decide_and_plan(load_config(None, []), 3)
    assert decide_and_plan(load_config(None, []), 2).inputs.world_size == 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eager_attention_keeps_the_attention_matrix_the_plan_counts(precision):
    """transformers' eager attention saves one attention matrix per block (fp32 from the softmax,
    and under bf16 autocast the bf16 copy the product with V saves), which sdpa's flash kernel
    does not (measured through saved_tensors_hooks); the plan adds exactly that when the run
    resolved model.attn_implementation=eager."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.plan.memory.activations import eager_attention_bytes

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))

    def square_matrices_saved(implementation):
        """Bytes of saved tensors shaped (…, seq, seq): attention matrices."""
        config._attn_implementation = implementation
        model = LlamaForCausalLM(config).train()
        storages = {}

        def pack(t):
            if t.dim() >= 2 and t.shape[-2:] == (48, 48):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids).loss.backward()
        return sum(storages.values())

    element_bytes = 4 if precision == "fp32" else 4 + 2
    per_block = 2 * 4 * 48 * 48 * element_bytes  # micro-batch × heads × seq² × bytes
    assert square_matrices_saved("eager") == 2 * per_block
    assert square_matrices_saved("sdpa") == 0
    assert eager_attention_bytes(_tiny_shape(), 2, 48, 2 if precision == "bf16" else 4) == per_block
    run = ["train.micro_batch_size=2", "train.global_batch_size=2", "data.seq_len=48", "hardware.precision=fp32"]
    sdpa = decide_and_plan(load_config(None, run), 1, vocab_size=256)
    eager = decide_and_plan(load_config(None, [*run, "model.attn_implementation=eager"]), 1, vocab_size=256)
    m = sdpa.shape
    assert eager.ranks[0].activation_bytes - sdpa.ranks[0].activation_bytes == m.layers * 2 * m.heads * 48 * 48 * 4


def _tiny_shape() -> ModelShape:
    return ModelShape((), layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, tied_embeddings=True)


def test_a_plan_reads_decided_values_and_decides_none_itself(tmp_path):
    """Every key a plan reads is decided by cputrain.training.choices (decide_for_plan before a run,
    decide in one); make_plan and model_shape refuse a key still auto rather than decide it, and no
    module of cputrain.plan calls a rule of another domain (plan.memory.checkpointing is the home of its own)."""
    import ast
    from pathlib import Path

    from transformers import LlamaConfig

    from cputrain.config.resolved import PLANNED_KEYS, undecided_for_plan

    cfg = load_config(None, [])
    with pytest.raises(ValueError, match="still auto: hardware.precision, parallel.strategy, "
                                         "model.attn_implementation, model.chunked_loss"):
        make_plan(cfg, 1)
    LlamaConfig(**TINY_LORA).save_pretrained(tmp_path)
    lora = _lora_config(tmp_path)
    with pytest.raises(ValueError, match="still auto: .*model.lora.target_modules, model.lora.base_dtype"):
        make_plan(lora, 1)
    with pytest.raises(ValueError, match="model.lora.target_modules and model.lora.base_dtype are read decided"):
        model_shape(lora.model)
    assert undecided_for_plan(cfg) and undecided_for_plan(_decided(cfg)) == []
    assert undecided_for_plan(_decided(lora)) == [] and len(PLANNED_KEYS) == 9
    rules = {"precision_choice", "strategy_choice", "chunked_loss_choice", "base_dtype_choice", "target_modules_choice",
             "files_are_bf16", "attention_choice", "reduce_dtype_choice"}
    called = set()
    for path in (Path(__file__).resolve().parents[2] / "cputrain" / "plan").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in rules:
                called.add(f"{path.name}: {name}")
    assert not called, f"cputrain.plan decides on its own again: {sorted(called)}"
