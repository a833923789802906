"""parallel.layout=auto and parallel.reduce_dtype=auto: the pure rules (config.reduction,
plan.layouts.choice), then decided in a plan's walk on an instance type and in a run's walk on
its node, each recorded with its reason; the decided types admit no auto under fsdp."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from cputrain.config import Config
from cputrain.config.file import load_config
from cputrain.config.reduction import reduce_dtype_choice
from cputrain.config.resolved import DecidedConfig, PlannedConfig
from cputrain.plan.instances import builtin_instances, find_instance
from cputrain.plan.layouts import LayoutFigures, layout_choice
from cputrain.training import choices

SEEDS = "configs/llama3-8b-fsdp.yaml"


def test_bf16_reduction_where_several_nodes_communicate_in_bf16():
    value, why = reduce_dtype_choice("auto", "bf16", 4)
    assert value == "bf16" and "reduce_dtype_drift" in why
    value, why = reduce_dtype_choice("auto", "bf16", 1)
    assert value == "fp32" and "one node" in why and "reduce_dtype_drift" in why
    assert reduce_dtype_choice("auto", "fp32", 4)[0] == "fp32"
    assert reduce_dtype_choice("bf16", "fp32", 1) == ("bf16", "")  # set: kept, no reason


def figures(layout: str, step_s: float, fits: bool, link_bytes: float = 1.0) -> LayoutFigures:
    step = SimpleNamespace(step_s=step_s, tokens_per_s=1000 / step_s, network_share=0.5, nnodes=4,
                           link_bytes_by_kind={"all_gather": link_bytes})
    return LayoutFigures(layout, 2**30, fits, step)


def test_the_fastest_layout_that_fits_and_full_shard_where_none_does():
    table = [figures("full_shard", 10, True), figures("gather_once", 4, True), figures("hybrid", 2, False)]
    layout, why = layout_choice(table, "a pod", "test")
    assert layout == "gather_once" and "hybrid does not fit" in why and "full_shard 100 tokens/s" in why
    none = [replace(f, fits=False) for f in table]
    layout, why = layout_choice(none, "a pod", "test")
    assert layout == "full_shard" and "no layout's memory plan fits a pod" in why
    # equal steps (no link rate known): the fewest bytes through the link, then full_shard first
    tie = [figures("full_shard", 5, True, 9.0), figures("gather_once", 5, True, 3.0)]
    assert layout_choice(tie, "a pod", "test")[0] == "gather_once"
    assert layout_choice([figures("full_shard", 5, True), figures("hybrid", 5, True)], "", "")[0] == "full_shard"


def _plan_decision(instance: str | None, nproc: int | None = 2, world: int = 8, **network):
    from cputrain.plan.time import Network

    cfg = load_config(SEEDS, [])
    instances = [find_instance(builtin_instances(), instance)] if instance else builtin_instances()
    res = choices.decide_for_plan(cfg, world, nproc_per_node=nproc, instances=instances, network=Network(**network))
    return res.config, {key: why for key, _, why in res.reasons}


def test_a_plan_decides_the_layout_on_the_instance_it_sizes():
    cfg, why = _plan_decision("r7i.8xlarge")
    assert isinstance(cfg, PlannedConfig)
    # gather_once: hybrid's node-own collectives are counted (at gloo's measured loopback rate) and slow it
    assert (cfg.parallel.layout, cfg.parallel.reduce_dtype) == ("gather_once", "bf16")
    assert "4 × r7i.8xlarge" in why["parallel.layout"] and "full_shard" in why["parallel.layout"]
    cfg, why = _plan_decision("c7i.8xlarge")  # 64 GiB nodes hold full_shard's shards only
    assert cfg.parallel.layout == "full_shard" and "hybrid does not fit" in why["parallel.layout"]
    # the smallest that fits, chosen by the plan (no --instance-type): c7i.8xlarge
    assert _plan_decision(None)[0].parallel.layout == "full_shard"


def test_a_plan_on_one_node_takes_the_fastest_layout_that_fits_and_without_nodes_full_shard():
    # the seeds' 8B on one r7i.8xlarge: 8 ranks each gathering the whole model do not fit
    cfg, why = _plan_decision(None, nproc=8)
    assert (cfg.parallel.layout, cfg.parallel.reduce_dtype) == ("full_shard", "fp32")
    assert "one r7i.8xlarge: no collective crosses a link" in why["parallel.layout"]
    assert "gather_once does not fit" in why["parallel.layout"]
    res = choices.decide_for_plan(load_config(SEEDS, []), 8)  # neither ranks per node nor an instance table
    why = {key: reason for key, _, reason in res.reasons}
    assert (res.config.parallel.layout, res.config.parallel.reduce_dtype) == ("full_shard", "fp32")
    assert "--nproc-per-node" in why["parallel.layout"] and "not known" in why["parallel.reduce_dtype"]


def test_the_plan_keeps_the_ranks_per_node_its_layout_was_decided_for():
    # no --nproc-per-node: the fit of full_shard (the least memory) chooses them, and the plan keeps them
    for instance, per_node in (("r7i.8xlarge", 8), ("c7i.8xlarge", 2)):
        plan = choices.decide_and_plan(load_config(SEEDS, []), 8,
                                       instances=[find_instance(builtin_instances(), instance)])
        assert plan.fit.nproc_per_node == plan.inputs.ranks_per_node == per_node
        assert plan.inputs.layout == "full_shard" and plan.inputs.reduce_dtype == ("bf16" if per_node < 8 else "fp32")


def _run_decision(tmp_path, memory_gib: float | None = None, world: int = 4, local: int = 2, **parallel):
    from cputrain.config.resolve import resolve
    from cputrain.distributed.env import RankEnv
    from cputrain.hardware import detect
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import read_recorded

    cfg = Config.model_validate({
        "model": {"attn_implementation": "sdpa", "arch": {"hidden_size": 64, "intermediate_size": 128,
                                                          "num_hidden_layers": 2, "num_attention_heads": 4,
                                                          "num_key_value_heads": 2},
                  "tokenizer_vocab_size": 512},
        "hardware": {"precision": "bf16", "allocator": "system", "threads": 1},
        "parallel": {"strategy": "fsdp", **parallel},
        "train": {"global_batch_size": 16, "micro_batch_size": 2, "max_steps": 1},
        "data": {"cache_dir": str(tmp_path), "seq_len": 64}, "output_dir": str(tmp_path / "run")})
    hw = detect()
    if memory_gib is not None:
        hw = replace(hw, memory_gib=memory_gib)
    ranks = RankEnv(rank=0, world_size=world, local_rank=0, local_world_size=local, launcher="torchrun")
    res = choices.decide(resolve(cfg, hw, world, local), hw, ranks, read_recorded(RunFolder(cfg.output_dir)))
    return res.config, {key: why for key, _, why in res.reasons}


def test_a_run_decides_both_on_its_node_and_records_why(tmp_path):
    cfg, why = _run_decision(tmp_path)
    assert isinstance(cfg, DecidedConfig)
    assert cfg.parallel.reduce_dtype == "bf16" and "2 nodes" in why["parallel.reduce_dtype"]
    assert cfg.parallel.layout != "auto" and "a run knows no link rate" in why["parallel.layout"]
    # a node that holds none of them: the least memory
    cfg, why = _run_decision(tmp_path, memory_gib=0.5)
    assert cfg.parallel.layout == "full_shard" and "no layout's memory plan fits" in why["parallel.layout"]
    # one node: gather_once gathers once a step, so its node's own collectives take less time
    cfg, why = _run_decision(tmp_path, world=2, local=2)
    assert (cfg.parallel.layout, cfg.parallel.reduce_dtype) == ("gather_once", "fp32")
    assert "this node alone: no collective crosses a link" in why["parallel.layout"]
    assert "full_shard" in why["parallel.layout"] and "collectives over loopback" in why["parallel.layout"]
    # ... unless it does not fit: the least memory
    cfg, why = _run_decision(tmp_path, world=2, local=2, memory_gib=0.5)
    assert cfg.parallel.layout == "full_shard" and "no layout's memory plan fits" in why["parallel.layout"]
    cfg, why = _run_decision(tmp_path, layout="gather_once", reduce_dtype="fp32")  # set: kept, no reason
    assert (cfg.parallel.layout, cfg.parallel.reduce_dtype) == ("gather_once", "fp32")
    assert "parallel.layout" not in why and "parallel.reduce_dtype" not in why


def test_no_auto_survives_under_fsdp_and_other_strategies_leave_both_auto():
    fsdp = Config.model_validate({"parallel": {"strategy": "fsdp"}, "hardware": {"precision": "bf16"}})
    with pytest.raises(ValueError, match="parallel.layout and parallel.reduce_dtype must be decided"):
        PlannedConfig.model_validate(fsdp.model_dump())
    for strategy in ("ddp", "zero3", "auto"):
        with pytest.raises(ValueError, match=f"parallel.layout=hybrid needs parallel.strategy=fsdp"):
            Config.model_validate({"parallel": {"strategy": strategy, "layout": "hybrid"}})
    with pytest.raises(ValueError, match="parallel.reduce_dtype=bf16 needs parallel.strategy=fsdp"):
        Config.model_validate({"parallel": {"strategy": "zero3", "reduce_dtype": "bf16"}})
