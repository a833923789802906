"""Each FSDP layout's collectives per step from first principles on a small shape: bytes per rank,
bytes and TCP flows through a node's link, the reduce dtype, the two reduce-scatters; and the
per-flow cap of the network model (cputrain.plan.time.comm_volume, step_time)."""

from __future__ import annotations

import pytest

from cputrain.errors import ConfigError
from cputrain.plan.instances import FLOW_GBIT_S, FLOW_GBIT_S_IN_PLACEMENT_GROUP, flow_cap
from cputrain.plan.model_shape import ModelShape, ParamInfo
from cputrain.plan.time import Compute, Link, StepSettings, comm_pattern, node_link_gbit_s, parse_table, plan_step_time

W, P, N = 4, 2, 2  # ranks, ranks per node, nodes
M = 3  # micro-batches per rank per step


def shape() -> ModelShape:
    """2 blocks of an 8×8 matrix and an 8-vector (72 elements each), a 16×8 embedding and head and
    an 8-vector norm (264 elements of root)."""
    params = [ParamInfo("model.embed_tokens.weight", (16, 8), "root"), ParamInfo("model.norm.weight", (8,), "root"),
              ParamInfo("lm_head.weight", (16, 8), "root")]
    for i in range(2):
        params += [ParamInfo(f"model.layers.{i}.q.weight", (8, 8), f"layers.{i}"),
                   ParamInfo(f"model.layers.{i}.norm.weight", (8,), f"layers.{i}")]
    return ModelShape(tuple(params), layers=2, hidden=8, intermediate=16, heads=2, kv_heads=2, vocab=16,
                      tied_embeddings=False)


BLOCK, ROOT, L = 72, 264, 2
GRADS = L * BLOCK + ROOT  # every parameter is trained


def pattern(layout: str, reduce_scatter: str = "native", reduce_dtype: str = "fp32", precision: str = "bf16"):
    return comm_pattern(shape(), "fsdp", precision, W, M, nnodes=N, layout=layout, reduce_dtype=reduce_dtype,
                        reduce_scatter=reduce_scatter)


def ring(n: int) -> float:
    return (n - 1) / n


@pytest.mark.parametrize("layout, gathered_world, gathered_node, reduced_world, reduced_node, all_reduced", [
    # (bf16 elements gathered over all ranks, over a node's; fp32 elements reduce-scattered over all
    # ranks, over a node's; fp32 elements all-reduced across the nodes, per rank) per step
    ("full_shard", M * 2 * L * BLOCK + ROOT, 0, M * GRADS, 0, 0),
    ("node_reshard", M * L * BLOCK + ROOT, M * L * BLOCK, M * GRADS, 0, 0),
    ("gather_once", L * BLOCK + ROOT, 0, GRADS, 0, 0),
    ("hybrid", 0, M * 2 * L * BLOCK + ROOT, 0, M * GRADS, GRADS // P),
])
def test_each_layouts_bytes_per_rank_and_through_a_nodes_link(layout, gathered_world, gathered_node, reduced_world,
                                                             reduced_node, all_reduced):
    p = pattern(layout)
    sent = p.rank_bytes(W)
    assert sent["all_gather"] == pytest.approx(2 * (gathered_world * ring(W) + gathered_node * ring(P)))
    # gloo's own reduce-scatter is an all-reduce: 2(W−1)/W of the tensor, as the comm meter counts it
    assert sent["reduce_scatter"] == pytest.approx(4 * 2 * (reduced_world * ring(W) + reduced_node * ring(P)))
    assert sent["all_reduce"] == pytest.approx(4 * 2 * ring(N) * all_reduced)
    link = p.link_bytes(W, N)
    # a ring over node-contiguous ranks puts one rank's share through each node's link; in-node ones none;
    # the hybrid all-reduce runs one ring per local rank across the nodes
    assert link["all_gather"] == pytest.approx(2 * gathered_world * ring(W))
    assert link["reduce_scatter"] == pytest.approx(4 * 2 * reduced_world * ring(W))
    assert link["all_reduce"] == pytest.approx(P * 4 * 2 * ring(N) * all_reduced)


def test_the_all_to_all_sends_each_byte_once_through_many_flows():
    native, a2a = pattern("full_shard", "native"), pattern("full_shard", "all_to_all")
    whole = M * GRADS * 4
    assert native.rank_bytes(W)["reduce_scatter"] == pytest.approx(2 * ring(W) * whole)
    assert a2a.rank_bytes(W)["reduce_scatter"] == pytest.approx(ring(W) * whole)
    # through a node's link: each of its P ranks sends its W − P off-node peers their slices
    assert a2a.link_bytes(W, N)["reduce_scatter"] == pytest.approx(P * (W - P) / W * whole)
    flows = {c.via: c.flows(W, N) for c in (*native.collectives, *a2a.collectives) if c.kind == "reduce_scatter"}
    assert flows == {"native": 1, "all_to_all": P * (W - P)}
    hybrid = pattern("hybrid")
    assert {c.kind: c.flows(W, N) for c in hybrid.collectives if c.span != "node"} == {"all_reduce": P}
    assert all(c.flows(W, 1) == 0 and c.link_bytes(W, 1) == 0 for c in a2a.collectives)  # one node: no link


def test_bf16_reduction_halves_the_gradients_bytes_and_the_gathers_keep_theirs():
    fp32, bf16 = pattern("full_shard", reduce_dtype="fp32"), pattern("full_shard", reduce_dtype="bf16")
    assert bf16.rank_bytes(W)["reduce_scatter"] == pytest.approx(fp32.rank_bytes(W)["reduce_scatter"] / 2)
    assert bf16.rank_bytes(W)["all_gather"] == fp32.rank_bytes(W)["all_gather"]
    assert (bf16.reduce_dtype, fp32.reduce_dtype) == ("bf16", "fp32")
    # fp32 compute gathers fp32 parameters
    assert pattern("gather_once", precision="fp32").rank_bytes(W)["all_gather"] == pytest.approx(
        4 * (L * BLOCK + ROOT) * ring(W))


def test_a_flow_gets_at_most_the_cap_and_a_link_its_rate():
    assert node_link_gbit_s(12.5, 1, 5.0) == 5.0
    assert node_link_gbit_s(12.5, 2, 5.0) == 10.0
    assert node_link_gbit_s(12.5, 12, 5.0) == 12.5
    assert node_link_gbit_s(12.5, 1, None) == 12.5
    assert flow_cap(False)[0] == FLOW_GBIT_S == 5.0 and flow_cap(True)[0] == FLOW_GBIT_S_IN_PLACEMENT_GROUP == 10.0


def _step(layout: str, cap: float | None, reduce_scatter: str = "all_to_all", efficiency=1.0):
    s = StepSettings("fsdp", "bf16", 1, 16, W * M, False, layout=layout, reduce_dtype="fp32",
                     reduce_scatter=reduce_scatter)
    return plan_step_time(s, W, P, shape(), Compute(1e9, 0.5),
                          Link(1e-3, efficiency=efficiency, flow_cap_gbit_s=cap, flow_cap_source="test"))


def test_the_cap_slows_a_rings_one_flow_and_not_the_all_to_alls_many():
    free, capped = _step("full_shard", None), _step("full_shard", 0.25e-3)  # a flow gets a quarter of the link
    by = {c.kind: c for c in capped.collectives if c.link_bytes}
    assert by["all_gather"].rate_gbit_s == pytest.approx(0.25e-3) and by["all_gather"].flows == 1
    assert by["reduce_scatter"].rate_gbit_s == pytest.approx(1e-3) and by["reduce_scatter"].flows == P * (W - P)
    gather_s = {c.what: c.seconds for c in free.collectives}
    for c in capped.collectives:
        assert c.seconds == pytest.approx(gather_s[c.what] * (4 if c.kind == "all_gather" else 1))
    assert capped.network_s == pytest.approx(sum(c.seconds for c in capped.collectives))
    assert "one TCP flow at most 0.00025 (test)" in capped.source["link"]


def test_the_all_to_all_takes_the_all_gathers_measured_share_and_says_it_is_assumed():
    table = parse_table({"machine": "test", "measured": "2026-01-01", "rows": [
        {"collective": "all_gather", "link_gbit_s": 1e-3, "message_bytes": 1, "efficiency": 0.6},
        {"collective": "reduce_scatter", "link_gbit_s": 1e-3, "message_bytes": 1, "efficiency": 0.45}]}, "test")
    a2a, native = _step("gather_once", None, "all_to_all", table), _step("gather_once", None, "native", table)
    share = {s: next(c.efficiency for c in p.collectives if c.kind == "reduce_scatter")
             for s, p in (("a2a", a2a), ("native", native))}
    assert share["a2a"] == pytest.approx(0.6) and "assumed" in a2a.source["efficiency"]
    # gloo's own, measured against the ring's bytes, is counted in the all-reduce's it sends: twice the share,
    # the same seconds as before it was counted so
    assert share["native"] == pytest.approx(0.9) and "assumed" not in native.source["efficiency"]
    native_rs = next(c for c in native.collectives if c.kind == "reduce_scatter")
    ring_bytes = GRADS * 4 * ring(W)
    assert native_rs.seconds == pytest.approx(ring_bytes * 8 / (1e-3 * 1e9 * 0.45))


def test_measured_all_to_all_rows_replace_the_assumption():
    table = parse_table({"machine": "test", "measured": "2026-01-01", "rows": [
        {"collective": "all_gather", "link_gbit_s": 1e-3, "message_bytes": 1, "efficiency": 0.6},
        {"collective": "all_to_all", "link_gbit_s": 1e-3, "message_bytes": 1, "efficiency": 0.8}]}, "test")
    step = _step("gather_once", None, "all_to_all", table)
    assert next(c.efficiency for c in step.collectives if c.kind == "reduce_scatter") == pytest.approx(0.8)
    assert "assumed" not in step.source["efficiency"]


def test_a_nodes_own_collectives_take_gloos_cpu_rate_where_it_was_measured_and_on_instances_too():
    """hybrid's in-node gathers and reduce-scatters cross no link, but gloo runs them on the cores:
    on the measuring machine at its unshaped rate × each rank's share of a core, none hidden; on an
    instance at one measured core's rate per rank, counted (never left out, so no layout leaning on
    them outranks one whose bytes are all counted), and the plan says where the rate comes from."""
    caps = {"all_gather": 1e-4, "all_to_all": 2e-4, "all_reduce": 1e-4}  # Gbit/s
    table = parse_table({"machine": "test", "measured": "2026-01-01", "rows": [
        {"collective": k, "link_gbit_s": 1e-3, "message_bytes": 1, "efficiency": 1.0} for k in caps],
        "cpu_cap_rows": [{"collective": k, "message_bytes": 1, "gbit_s": v} for k, v in caps.items()]}, "test")
    s = StepSettings("fsdp", "bf16", 1, 16, W * M, False, layout="hybrid", reduce_dtype="fp32",
                     reduce_scatter="all_to_all")

    def hybrid(capped: bool, share: float = 1.0):
        return plan_step_time(s, W, P, shape(), Compute(1e9, 0.5),
                              Link(1e-3, efficiency=table, gloo_cpu_capped=capped, rank_core_share=share))

    gathered = (M * 2 * L * BLOCK + ROOT) * 2 * ring(P)  # bf16 blocks for each pass, the root once
    reduced = M * GRADS * 4 * ring(P)  # fp32 gradients, the all-to-all's bytes
    in_node_s = gathered * 8 / (caps["all_gather"] * 1e9) + reduced * 8 / (caps["all_to_all"] * 1e9)
    whole, half, instance = hybrid(True), hybrid(True, 0.5), hybrid(False)
    assert whole.in_node_s == pytest.approx(in_node_s)
    assert half.in_node_s == pytest.approx(2 * in_node_s)  # two ranks on one core: each at half the rate
    across = sum(c.seconds for c in whole.collectives if c.link_bytes)
    assert whole.network_s == pytest.approx(across)
    assert whole.exposed_network_s == pytest.approx(across + in_node_s)  # FSDP hides none; the node's own never
    assert whole.step_s == pytest.approx(whole.compute_s + across + in_node_s)
    assert instance.in_node_s == pytest.approx(in_node_s)  # a rank's own cores: one measured core's rate
    assert "at the rate one test core reached (measured on that CPU, not on this node's)" in instance.source["in_node"]
    assert instance.exposed_network_s == pytest.approx(instance.network_s + in_node_s)  # none of it hides
    no_table = plan_step_time(s, W, P, shape(), Compute(1e9, 0.5), Link(1e-3, efficiency=1.0))
    assert no_table.in_node_s == 0 and "not planned (no measured gloo rate)" in no_table.source["in_node"]
    full_shard = plan_step_time(StepSettings("fsdp", "bf16", 1, 16, W * M, False, layout="full_shard"), W, P, shape(),
                                Compute(1e9, 0.5), Link(1e-3, efficiency=table, gloo_cpu_capped=True))
    assert full_shard.in_node_s == 0 and "in_node" not in full_shard.source  # every collective crosses the link
    with pytest.raises(ConfigError, match="share of a core"):
        hybrid(True, 0.0)
