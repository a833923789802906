"""The memory planner: exact state bytes per strategy, model shapes from a config, instance choice."""

from __future__ import annotations

import json

import pytest

from cputrain.config import load_config
from cputrain.errors import ConfigError, ModelError
from cputrain.plan.accounting import fsdp_rows, state_bytes
from cputrain.plan.build import make_plan
from cputrain.plan.fit import smallest_cluster
from cputrain.plan.instances import builtin_instances, load_instances
from cputrain.plan.model_shape import ModelShape, ParamInfo, model_shape

GIB = 2**30

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "rope_theta": 500000.0,
}


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
                             "model.arch.num_key_value_heads=2", "parallel.strategy=fsdp", "hardware.precision=fp32"])
    scratch = make_plan(cfg, 4, vocab_size=512)
    total = scratch.shape.total_params
    # fsdp from scratch: the whole fp32 init beside the rank's shard, freed before the first step.
    assert scratch.ranks[0].load_bytes == total * 4
    assert scratch.ranks[0].load_peak_bytes == scratch.ranks[0].param_bytes + total * 4 + \
        scratch.ranks[0].process_overhead_bytes
    assert scratch.ranks[0].total_bytes == max(scratch.ranks[0].training_peak_bytes, scratch.ranks[0].load_peak_bytes)
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)  # a model folder (its weights are not read)
    folder = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(tmp_path)})})
    loaded = make_plan(folder, 4)  # rows read straight into the shard
    assert loaded.ranks[0].load_bytes == 0
    ddp = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"strategy": "ddp"})})
    # ddp initialises in place, then broadcasts rank 0's weights in flattened 250 MiB buckets:
    # a model this small is one bucket, a flat copy of all of it.
    assert make_plan(ddp, 4, vocab_size=512).ranks[0].load_bytes == total * 4


def test_ddp_broadcast_keeps_two_buckets_in_flight():
    from cputrain.plan.estimate import DDP_BROADCAST_BUCKET_BYTES, _ddp_broadcast_bytes

    third = DDP_BROADCAST_BUCKET_BYTES // 4 // 3 + 1  # elements: three tensors just fill a bucket
    m = _shape(*[(third,)] * 7)  # buckets of 3, 3 and 1 tensors
    assert _ddp_broadcast_bytes(m) == 6 * third * 4


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
    ddp = make_plan(cfg, 4, config_json=str(tmp_path))
    assert ddp.shape.total_params == 8_030_261_248
    assert ddp.peak_rank.param_bytes == 8_030_261_248 * 4
    cfg.parallel.strategy = "fsdp"
    fsdp = make_plan(cfg, 4, config_json=str(tmp_path), instances=builtin_instances())
    assert 0.24 < fsdp.peak_rank.param_bytes / ddp.peak_rank.param_bytes <= 0.26
    assert 30 * GIB < fsdp.peak_rank.total_bytes < 70 * GIB  # "about 50-60 GB per process" by `top`
    assert fsdp.fit is not None and fsdp.fit.instance.amx


def test_activation_checkpointing_and_sequence_length_move_activations():
    base = load_config(None, ["data.seq_len=512", "hardware.precision=fp32"])
    shape = model_shape(base.model, vocab_size=4096)
    a = make_plan(base, 1, shape=shape).peak_rank.activation_bytes
    longer = make_plan(base.model_copy(update={"data": base.data.model_copy(update={"seq_len": 1024})}), 1,
                       shape=shape).peak_rank.activation_bytes
    base.model.activation_checkpointing = True
    ckpt = make_plan(base, 1, shape=shape).peak_rank.activation_bytes
    assert longer > 1.9 * a and ckpt < a


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
        make_plan(load_config(None, ["parallel.strategy=single"]), 2, shape=_shape((4, 4)))


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
