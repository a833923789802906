"""The time plan: collective volumes per strategy against the ring formulas, the efficiency table's
interpolation, the advice appearing only where the network dominates, and --link-gbit-s checks."""

from __future__ import annotations

import json
import math

import pytest

from cputrain.errors import ConfigError
from harness.repo import REPO
from cputrain.plan.model_shape import ModelShape, ParamInfo
from cputrain.plan.time import (Compute, EfficiencyTable, Link, StepSettings, comm_pattern, load_table, measured_mfu,
                                parse_table, plan_step_time, remedies)

W = 4


def tiny_shape(lora: bool = False) -> ModelShape:
    """2 blocks of two 8×8 matrices and a norm, an untied 16×8 embedding and head."""
    params = [ParamInfo("model.embed_tokens.weight", (16, 8), "root", trainable=not lora),
              ParamInfo("model.norm.weight", (8,), "root", trainable=not lora),
              ParamInfo("lm_head.weight", (16, 8), "root", trainable=not lora)]
    for i in range(2):
        unit = f"layers.{i}"
        for name in ("q", "o"):
            if lora:
                params.append(ParamInfo(f"model.layers.{i}.{name}.base_layer.weight", (8, 8), unit, False, 2))
                params += [ParamInfo(f"model.layers.{i}.{name}.lora_A.default.weight", (2, 8), unit),
                           ParamInfo(f"model.layers.{i}.{name}.lora_B.default.weight", (8, 2), unit)]
            else:
                params.append(ParamInfo(f"model.layers.{i}.{name}.weight", (8, 8), unit))
        params.append(ParamInfo(f"model.layers.{i}.norm.weight", (8,), unit, trainable=not lora))
    return ModelShape(tuple(params), layers=2, hidden=8, intermediate=16, heads=2, kv_heads=2, vocab=16,
                      tied_embeddings=False)


def settings(strategy: str, precision: str = "fp32", micro_batch: int = 1, global_batch: int = W) -> StepSettings:
    return StepSettings(strategy, precision, micro_batch, 16, global_batch, False)


def test_single_sends_nothing():
    assert all(v == 0 for v in comm_pattern(tiny_shape(), "single", "fp32", 1, 1).rank_bytes(1).values())


def test_ddp_all_reduces_the_trained_gradients_once_a_step():
    shape = tiny_shape()
    grads = shape.trainable_params * 4
    for micro_batches in (1, 4):  # no_sync: accumulation adds nothing
        sent = comm_pattern(shape, "ddp", "bf16", W, micro_batches).rank_bytes(W)
        assert sent["all_reduce"] == pytest.approx(2 * (W - 1) / W * grads)
        assert sent["all_gather"] == sent["reduce_scatter"] == 0


def test_lora_under_ddp_all_reduces_only_the_adapters():
    shape = tiny_shape(lora=True)
    adapters = sum(p.numel for p in shape.params if "lora_" in p.name)
    assert comm_pattern(shape, "ddp", "bf16", W, 1).rank_bytes(W)["all_reduce"] == pytest.approx(
        2 * (W - 1) / W * adapters * 4)


def test_fsdp_gathers_blocks_twice_the_root_once_and_reduce_scatters_every_micro_batch():
    shape = tiny_shape()
    blocks = sum(p.numel for p in shape.params if p.unit != "root")
    root = sum(p.numel for p in shape.params if p.unit == "root")
    for precision, gather_bytes in (("bf16", 2), ("fp32", 4)):
        sent = comm_pattern(shape, "fsdp", precision, W, 3).rank_bytes(W)
        # the root is kept gathered across the step's micro-batches: gathered once a step
        assert sent["all_gather"] == pytest.approx((W - 1) / W * (3 * 2 * blocks + root) * gather_bytes)
        assert sent["reduce_scatter"] == pytest.approx(3 * (W - 1) / W * (blocks + root) * 4)  # fp32 reduce
        assert sent["all_reduce"] == 0


def test_lora_under_fsdp_still_gathers_the_frozen_base():
    shape = tiny_shape(lora=True)
    blocks = sum(p.numel for p in shape.params if p.unit != "root")
    root = sum(p.numel for p in shape.params if p.unit == "root")
    adapters = sum(p.numel for p in shape.params if "lora_" in p.name)
    sent = comm_pattern(shape, "fsdp", "bf16", W, 1).rank_bytes(W)
    assert sent["all_gather"] == pytest.approx((W - 1) / W * (2 * blocks + root) * 2)
    assert sent["reduce_scatter"] == pytest.approx((W - 1) / W * adapters * 4)


def test_zero3_keeps_persistent_parameters_and_reduces_in_bf16():
    shape = tiny_shape()
    big = sum(p.numel for p in shape.params if p.unit != "root" and p.numel > 8)
    root = sum(p.numel for p in shape.params if p.unit == "root" and p.numel > 8)
    sent = comm_pattern(shape, "zero3", "bf16", W, 1, persistence_threshold=8, max_reuse_distance=0).rank_bytes(W)
    assert sent["all_gather"] == pytest.approx((W - 1) / W * (2 * big + root) * 2)
    trained = shape.trainable_params
    assert sent["reduce_scatter"] == pytest.approx((W - 1) / W * trained * 2)


def test_one_node_uses_no_link_and_many_nodes_carry_one_ranks_share():
    # rings only (gloo's own reduce-scatter is one): the all-to-all's share is test_comm_layouts.py's
    pattern = comm_pattern(tiny_shape(), "fsdp", "bf16", W, 1, reduce_scatter="native")
    assert all(v == 0 for v in pattern.link_bytes(W, nnodes=1).values())
    assert pattern.link_bytes(W, nnodes=2) == pattern.rank_bytes(W)


def table(rows) -> EfficiencyTable:
    return parse_table({"machine": "test", "measured": "2026-01-01", "rows": [
        {"collective": c, "link_gbit_s": g, "message_bytes": m, "efficiency": e} for c, g, m, e in rows]}, "test")


def test_efficiency_interpolates_in_log_size_and_takes_the_nearest_rate():
    t = table([("all_gather", 10, 2**20, 0.4), ("all_gather", 10, 2**30, 0.9), ("all_gather", 1, 2**20, 0.1)])
    assert t.efficiency("all_gather", 2**25, 10) == pytest.approx(0.4 + 0.5 * 5 / 10)
    assert t.efficiency("all_gather", 2**10, 12.5) == 0.4  # clamped below, nearest rate 10
    assert t.efficiency("all_gather", 2**40, 25) == 0.9  # clamped above
    assert t.efficiency("all_gather", 2**20, 1.5) == 0.1  # 1.5 is nearer 1 than 10 in log rate
    assert t.efficiency("reduce_scatter", 2**20, 10) == 1.0  # not measured: the line rate


def test_a_cpu_cap_limits_fast_links_and_the_slowest_rate_gives_the_protocols_share():
    t = parse_table({"machine": "test", "measured": "2026-01-01", "rows": [
        {"collective": "all_gather", "link_gbit_s": 1, "message_bytes": 2**20, "efficiency": 0.6},
        {"collective": "all_gather", "link_gbit_s": 10, "message_bytes": 2**20, "efficiency": 0.3}],
        "cpu_cap_rows": [{"collective": "all_gather", "message_bytes": 2**20, "gbit_s": 3.0}]}, "test")
    assert t.efficiency("all_gather", 2**20, 1) == pytest.approx(0.6)  # the link is the limit
    assert t.efficiency("all_gather", 2**20, 2) == pytest.approx(0.6)  # 1.2 of the 3 Gbit/s the CPU reaches
    assert t.efficiency("all_gather", 2**20, 10) == pytest.approx(0.3)  # the CPU: 3 of 10 Gbit/s
    assert t.efficiency("all_gather", 2**20, 50) == pytest.approx(0.06)  # no nearest-rate row above the cap
    with pytest.raises(ConfigError, match="cpu_cap_rows row 1"):
        parse_table({"rows": [{"collective": "all_gather", "link_gbit_s": 1, "message_bytes": 1, "efficiency": 1}],
                     "cpu_cap_rows": [{"collective": "all_gather", "message_bytes": 1}]}, "test")


def test_efficiency_file_bad_rows_are_refused_in_one_line(tmp_path):
    path = tmp_path / "eff.json"
    path.write_text(json.dumps({"machine": "m", "measured": "d", "rows": [{"collective": "broadcast",
                                "link_gbit_s": 1, "message_bytes": 1, "efficiency": 0.5}]}))
    with pytest.raises(ConfigError, match="broadcast") as err:
        load_table(path)
    assert "\n" not in str(err.value)
    assert load_table(tmp_path / "absent.json") is None


def plan(strategy: str, nproc: int, link: float | None, world: int = W, **kw):
    return plan_step_time(settings(strategy, "bf16", global_batch=world), world, nproc, tiny_shape(), Compute(1e9, 0.5),
                          Link(link, efficiency=1.0, **kw))


def test_step_time_is_compute_plus_exposed_network():
    p = plan("fsdp", 1, 1e-3)
    assert p.nnodes == W and p.network_s > 0
    assert p.step_s == pytest.approx(p.compute_s + p.exposed_network_s)
    assert 0 <= p.exposed_network_s <= p.network_s
    assert p.network_share == pytest.approx(p.exposed_network_s / p.step_s)
    assert p.link_bytes_by_kind["all_gather"] / (p.network_s * 1e-3 * 1e9 / 8) <= 1
    # the overlap a benchmark measured replaces the model
    assert plan("fsdp", 1, 1e-3, overlap=1.0).step_s == pytest.approx(p.compute_s)
    assert plan("fsdp", 1, 1e-3, overlap=0.0).exposed_network_s == pytest.approx(p.network_s)


def test_one_node_and_no_link_plan_no_network_time(monkeypatch):
    one_node = plan("fsdp", W, 1e-3)
    assert one_node.network_s == 0 and "not network-bound" in one_node.source["link"]
    no_link = plan("fsdp", 1, None)
    assert no_link.network_s == 0 and no_link.source["link"] == "no link given: network time not planned"
    monkeypatch.setattr("cputrain.plan.time.link.load_table", lambda: None)  # as before the benchmark wrote it
    assert "not measured" in plan_step_time(settings("ddp"), W, 1, tiny_shape(), Compute(1e9, 0.5),
                                            Link(1.0)).source["efficiency"]


def test_advice_only_where_the_network_dominates():
    s = settings("fsdp", "bf16", global_batch=2 * W)
    compute = Compute(1e9, 0.5)
    slow = plan_step_time(s, W, 1, tiny_shape(), compute, Link(1e-4, efficiency=1.0))
    fast = plan_step_time(s, W, 1, tiny_shape(), compute, Link(1e3, efficiency=1.0))
    assert slow.network_share > 0.25 > fast.network_share
    args = {"instance": None, "rank_peak_bytes": None, "compute": compute}
    assert remedies(s, tiny_shape(), W, 1, fast, link=Link(1e3, efficiency=1.0), **args) == []
    advice = remedies(s, tiny_shape(), W, 1, slow, link=Link(1e-4, efficiency=1.0), **args)
    names = " | ".join(r.setting for r in advice)
    # the layouts are built: they left the advice for the table of layouts × instance types
    assert "train.micro_batch_size=2" in names and "layout" not in names and "gather" not in names
    assert all(r.plan.tokens_per_s > 0 for r in advice)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_link_rate_refused_in_one_line(bad):
    from types import SimpleNamespace

    from cputrain.commands.plan import link_gbit_s_of

    with pytest.raises(ConfigError) as err:
        link_gbit_s_of(SimpleNamespace(link_gbit_s=bad))
    assert "--link-gbit-s" in str(err.value) and "\n" not in str(err.value)


def test_measured_mfu_names_its_row_and_what_is_still_to_measure():
    amx = measured_mfu("bf16", "amx", lora=False)
    assert amx.exact and amx.row.block == "layer_mfu" and "still to be measured" in amx.describe()
    nearest = measured_mfu("fp32", "amx", lora=False)  # no fp32 row on AMX: the AVX-512 one
    assert not nearest.exact and nearest.row.block == "strategies"


def test_zero3_keeps_blocks_gathered_whose_backward_comes_within_the_reuse_distance():
    from cputrain.plan.time import zero3_backward_gathers

    # 32 blocks of 218M elements and a 525M head (Llama-3-8B), DeepSpeed's default distance 1e9:
    # the last two blocks stay gathered (2 × 218M + 525M fetched in between is under 1e9)
    assert zero3_backward_gathers(32, 218_000_000, 525_000_000, 10**9) == 30
    assert zero3_backward_gathers(2, 100, 50, 10**9) == 0  # a small model: every block stays
    shape = tiny_shape()
    once = comm_pattern(shape, "zero3", "bf16", W, 1, persistence_threshold=8).rank_bytes(W)["all_gather"]
    twice = comm_pattern(shape, "zero3", "bf16", W, 1, persistence_threshold=8,
                         max_reuse_distance=0).rank_bytes(W)["all_gather"]
    big = sum(p.numel for p in shape.params if p.unit != "root" and p.numel > 8)
    assert twice - once == pytest.approx((W - 1) / W * big * 2)


def test_cputrain_plan_prints_the_time_plan_and_writes_it_into_plan_json(capsys):
    from cputrain.cli import main

    args = ["plan", "configs/llama3-8b-fsdp.yaml", "--nnodes", "4", "--nproc-per-node", "2"]
    assert main([*args, "--instance-type", "c7i.48xlarge"]) == 0
    out = capsys.readouterr().out
    assert "time per optimizer step (4 × c7i.48xlarge" in out and "block layer_mfu" in out
    assert "gloo's efficiency" in out  # measured (cputrain/plan/time/gloo_link_efficiency.json) or said to be assumed
    assert "network over 25% of the step" in out and "FSDP layouts × instance types" in out
    assert "will 4 nodes beat 1?" in out and "not built yet" not in out
    # a fast link on nodes that hold every layout's state: nothing to advise (on the smallest nodes only
    # full_shard fits, and its gathers' one flow a node stays at EC2's per-flow cap however fast the link)
    assert main([*args, "--link-gbit-s", "1000", "--instance-type", "r7i.8xlarge", "--json"]) == 0
    time = json.loads(capsys.readouterr().out)["time"]
    assert time["link_gbit_s"] == 1000 and time["advice"] == [] and time["layout"] == "gather_once"
    assert time["step_s"] == pytest.approx(time["compute_s"] + time["exposed_network_s"])
    assert main([*args, "--link-gbit-s", "0"]) != 0
    err = capsys.readouterr().err
    assert "--link-gbit-s must be a positive number" in err and len(err.strip().splitlines()) == 1


def test_parameters_kept_gathered_across_micro_batches_gather_once_a_step():
    shape = tiny_shape()
    blocks = sum(p.numel for p in shape.params if p.unit != "root")
    root = sum(p.numel for p in shape.params if p.unit == "root")
    sent = comm_pattern(shape, "fsdp", "bf16", W, 4, layout="gather_once").rank_bytes(W)
    assert sent["all_gather"] == pytest.approx((W - 1) / W * (blocks + root) * 2)  # no backward gather either
    assert sent["reduce_scatter"] == pytest.approx((W - 1) / W * (blocks + root) * 4)


def test_a_measured_efficiency_table_slows_the_network_by_its_factor():
    line_rate = plan("fsdp", 1, 1e-3)
    half = plan_step_time(settings("fsdp", "bf16", global_batch=W), W, 1, tiny_shape(), Compute(1e9, 0.5),
                          Link(1e-3, efficiency=table([("all_gather", 1e-3, 1, 0.5), ("reduce_scatter", 1e-3, 1, 0.5)])))
    assert half.network_s == pytest.approx(2 * line_rate.network_s)
    assert half.efficiency_by_kind["all_gather"] == 0.5 and "measured on test" in half.source["efficiency"]


def test_checkpointing_adds_each_blocks_forward_and_selective_no_matmul():
    def with_checkpointing(setting):
        s = StepSettings("fsdp", "bf16", 1, 16, W, setting)
        return plan_step_time(s, W, 1, tiny_shape(), Compute(1e9, 0.5), Link(None, efficiency=1.0))

    none, every, selective = (with_checkpointing(v) for v in (False, True, "selective"))
    assert none.recompute_flops_per_rank == 0 and selective.recompute_flops_per_rank == 0
    assert selective.compute_s == pytest.approx(none.compute_s)
    # the 2 blocks' forwards again: 2 × (2 × 136 parameters (norm included, as the MFU counts
    # them) + the attention's 4·d·T) per token, 16 tokens
    assert every.recompute_flops_per_rank == pytest.approx(2 * (2 * 136 + 4 * 8 * 16) * 16)


def test_fsdp_hides_no_network_time_and_gloos_cpu_time_never_hides():
    measured = parse_table({"machine": "test", "measured": "2026-01-01", "rows": [
        {"collective": k, "link_gbit_s": 1e-3, "message_bytes": 2**20, "efficiency": 1.0} for k in
        ("all_gather", "reduce_scatter", "all_reduce")], "cpu_cap_rows": [
        {"collective": "all_reduce", "message_bytes": 2**20, "gbit_s": 1e-4}]}, "test")
    fsdp = plan("fsdp", 1, 1e-3)
    assert fsdp.network_s > 0 and fsdp.exposed_network_s == pytest.approx(fsdp.network_s)

    def ddp(capped: bool):
        return plan_step_time(settings("ddp"), W, 1, tiny_shape(), Compute(1e3, 0.5),
                              Link(1e-3, efficiency=measured, gloo_cpu_capped=capped))

    free, capped = ddp(False), ddp(True)
    assert free.efficiency_by_kind["all_reduce"] == 1.0 and capped.efficiency_by_kind["all_reduce"] == 0.1
    cpu_s = free.link_bytes_by_kind["all_reduce"] * 8 / 1e5  # the bytes at the 1e-4 Gbit/s cap
    assert capped.network_s == pytest.approx(cpu_s)
    assert capped.exposed_network_s == pytest.approx(cpu_s)  # all of it the CPU's: none hidden
    assert free.network_s == pytest.approx(cpu_s / 10)  # an instance's plan: the link's share only


def test_fsdp_gathers_issued_a_block_ahead_hide_the_measured_share():
    """parallel.prefetch: PREFETCH_HIDDEN_SHARE of the shorter of the blocks' gathers (after each
    pass's first) and the compute hides; the reduce-scatters and the root's gather never do."""
    from dataclasses import replace

    from cputrain.plan.time import PREFETCH_HIDDEN_SHARE

    base = settings("fsdp", global_batch=W)

    def step(prefetch: bool, peak: float):
        return plan_step_time(replace(base, prefetch=prefetch), W, 1, tiny_shape(), Compute(peak, 0.5),
                              Link(1e-3, efficiency=1.0))

    for peak in (1e3, 1e9):  # network-bound, then compute-bound
        off, on = step(False, peak), step(True, peak)
        gathers = sum(c.seconds for c in on.collectives if c.kind == "all_gather" and c.what.startswith("blocks"))
        layers = tiny_shape().layers
        hidden = PREFETCH_HIDDEN_SHARE * min(gathers * (layers - 1) / layers, on.compute_s)
        assert off.exposed_network_s == pytest.approx(off.network_s)
        assert on.exposed_network_s == pytest.approx(on.network_s - hidden)
        assert on.step_s < off.step_s


def test_gather_once_hides_its_reduce_scatter_behind_the_last_backward_where_it_runs_behind_it():
    """parallel.overlap_reduction under gather_once with the all-to-all: REDUCE_HIDDEN_SHARE of the
    shorter of the blocks' reduce-scatters (after the last block's) and the last micro-batch's
    backward (less a block's) hides. Not where it is off, nor under full_shard (one reduction a
    micro-batch onto a gradient held), nor with gloo's own reduce-scatter."""
    from dataclasses import replace

    from cputrain.plan.time import REDUCE_HIDDEN_SHARE

    base = settings("fsdp", global_batch=4 * W)
    layers = tiny_shape().layers

    def step(peak: float, **changes):
        return plan_step_time(replace(base, **changes), W, 1, tiny_shape(), Compute(peak, 0.5),
                              Link(1e-3, efficiency=1.0))

    for peak in (1e3, 1e9):  # network-bound, then compute-bound
        off = step(peak, layout="gather_once", reduce_scatter="all_to_all")
        on = step(peak, layout="gather_once", reduce_scatter="all_to_all", overlap_reduction=True)
        reduces = sum(c.seconds for c in on.collectives if c.kind == "reduce_scatter")
        backward_s = _last_backward_s(on, base.seq_len, layers)
        hidden = REDUCE_HIDDEN_SHARE * min(reduces * (layers - 1) / layers, backward_s)
        assert hidden > 0 and off.exposed_network_s == pytest.approx(off.network_s)
        assert on.exposed_network_s == pytest.approx(on.network_s - hidden)
        assert "reduce-scatter left running behind the last backward" in on.overlap_source
        for unchanged in (step(peak, layout="full_shard", reduce_scatter="all_to_all", overlap_reduction=True),
                          step(peak, layout="gather_once", reduce_scatter="native", overlap_reduction=True)):
            assert unchanged.exposed_network_s == pytest.approx(unchanged.network_s)


def _last_backward_s(plan, seq_len: int, layers: int) -> float:
    """One micro-batch's backward of the blocks after the first to be reduced, as the plan counts it."""
    from cputrain.plan.time import token_flops

    ft = token_flops(tiny_shape(), seq_len, False)
    rate = plan.model_flops_per_rank / plan.compute_s if plan.compute_s else 0.0
    return ft.block_backward * plan.tokens_per_rank / plan.micro_batches / rate * (layers - 1)


def test_a_sharded_rank_computes_at_the_measured_mfu_divided_by_its_factor():
    """measured_compute: the MFU measured on single-strategy runs, divided for fsdp and zero3 by what
    sharding costs a rank in its layout on its allocator (cputrain.plan.time.sharded_compute), its
    source said; never by less than 1; unchanged for single and ddp."""
    from cputrain.plan.time import IMAGE_ALLOCATOR, measured_compute, measured_mfu, sharded_factor

    choice = measured_mfu("bf16", "amx", lora=False)
    share = choice.row.executed_share_of_peak
    for strategy in ("single", "ddp"):
        plain = measured_compute(1e12, choice, strategy)
        assert sharded_factor(strategy) is None and plain.mfu == share and plain.source == choice.describe()
    for strategy, layout in (("fsdp", "full_shard"), ("fsdp", "gather_once"), ("zero3", "full_shard")):
        for allocator in ("tcmalloc", "system", "glibc-tuned", "jemalloc"):
            factor = sharded_factor(strategy, layout, allocator)
            sharded = measured_compute(1e12, choice, strategy, layout, allocator)
            assert factor.strategy == strategy and factor.allocator == ("tcmalloc" if allocator == "tcmalloc" else "glibc")
            assert sharded.mfu == pytest.approx(share / max(1.0, factor.factor))
            assert sharded.peak_flops_per_s == 1e12 and factor.describe() in sharded.source
            assert "measured" in sharded.source and f"{strategy} rank" in sharded.source
        # glibc maps and zeroes a sharded rank's gathered blocks every micro-batch: never faster than tcmalloc
        assert sharded_factor(strategy, layout, "system").factor >= sharded_factor(strategy, layout, "tcmalloc").factor
    # the node layouts gather and shard as full_shard does; the instance plans assume the image's tcmalloc
    assert sharded_factor("fsdp", "hybrid") == sharded_factor("fsdp", "full_shard", IMAGE_ALLOCATOR)
    # fp32 measured apart on tcmalloc (its own block; FSDP2's smaller: no bf16 casts); on glibc bf16's row stands
    for strategy, layout in (("fsdp", "full_shard"), ("fsdp", "gather_once"), ("zero3", "full_shard")):
        fp32, bf16 = (sharded_factor(strategy, layout, "tcmalloc", p) for p in ("fp32", "bf16"))
        assert (fp32.precision, bf16.precision) == ("fp32", "bf16") and fp32.factor != bf16.factor
        assert fp32.factor < bf16.factor or strategy == "zero3"
        assert "sharded_rank_fp32" in fp32.source and "in fp32" in fp32.describe()
        assert sharded_factor(strategy, layout, "system", "fp32") == sharded_factor(strategy, layout, "system", "bf16")
    assert measured_compute(1e12, choice, "fsdp", "gather_once", "tcmalloc", "fp32").mfu == share  # 0.99: never < 1
    assert IMAGE_ALLOCATOR == "tcmalloc" and "libgoogle-perftools4" in (REPO / "Dockerfile").read_text()
