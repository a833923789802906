"""`cputrain plan`'s table of FSDP layouts × instance types and its "will N nodes beat 1?" lines
(cputrain.plan.layouts.table), on the Llama-3-8B FSDP recipe over 4 nodes of 2 ranks."""

from __future__ import annotations

import json

import pytest

from cputrain.config.file import load_config
from cputrain.plan.instances import builtin_instances, find_instance
from cputrain.plan.layouts import beat_one_node_line, layout_table, table_lines
from cputrain.plan.time import Network
from cputrain.training.choices import decide_and_plan

SEEDS = "configs/llama3-8b-fsdp.yaml"
BEFORE_TOKENS_S = 166  # the plan of this case before the layouts: full_shard, README's "Plan the time"


@pytest.fixture(scope="module")
def rows():
    cfg = load_config(SEEDS, [])
    table = [find_instance(builtin_instances(), name) for name in ("c7i.8xlarge", "r7i.8xlarge", "m7i.16xlarge")]
    plan = decide_and_plan(cfg, 8, nproc_per_node=2, instances=table)
    one_node = decide_and_plan(cfg, 2, nproc_per_node=2)
    return layout_table(plan, cfg.train.global_batch_size, table, 2, Network(), one_node)


def test_every_layout_on_every_instance_with_its_fit(rows):
    small, big, wide = rows
    assert [f.layout for f in small.figures] == ["full_shard", "node_reshard", "gather_once", "hybrid"]
    assert [f.fits for f in small.figures] == [True, False, False, False]  # 64 GiB nodes: full_shard only
    assert all(f.fits for f in big.figures)  # 256 GiB nodes hold every layout
    assert small.best.layout == "full_shard" and big.best.layout == wide.best.layout == "gather_once"
    # hybrid leans on its node's own collectives: counted at gloo's measured loopback rate, said so, and
    # so ranked below gather_once, whose every byte crosses the link and is counted too
    hybrid = next(f for f in big.figures if f.layout == "hybrid")
    assert hybrid.step.in_node_s > 0 and "not on this node's" in hybrid.step.source["in_node"]
    assert hybrid.step.tokens_per_s < big.best.step.tokens_per_s
    assert not small.one_node.fits and big.one_node.fits
    for row in rows:  # one node: no network, and the same layout, whatever the instance
        assert row.one_node.step.network_s == 0 and row.one_node.layout == "full_shard"


def test_the_seeds_case_planned_on_nodes_that_hold_the_state(rows):
    """Planned figures of the case the layouts were built for, every term counted (a sharded rank's
    own work on the training image's tcmalloc, the node's own collectives): ≥ 2.5× the 166 tokens/s
    planned before the layouts (1.92× while a sharded rank's factor was glibc's), and 4 nodes ≥ 3.4×
    one node of the same type with the network ≤ 25% of the step (a faster rank leaves the network a
    larger share: 12% at glibc's factor)."""
    _, big, wide = rows
    for row in (big, wide):
        best = row.best
        assert "for a fsdp rank's own work (gather_once) in bf16 on tcmalloc" in best.step.source["mfu"]
        assert best.step.tokens_per_s >= 2.5 * BEFORE_TOKENS_S
        assert best.step.tokens_per_s >= 3.4 * row.one_node.step.tokens_per_s
        assert best.step.network_share <= 0.25


def test_the_lines_answer_will_four_nodes_beat_one(rows):
    small, big, _ = rows
    assert "one node does not hold the state" in beat_one_node_line(small)
    line = beat_one_node_line(big)
    assert line.startswith("r7i.8xlarge: gather_once") and "× one node's" in line and line.endswith("4 nodes beat 1")
    text = "\n".join(table_lines(rows, Network()))
    assert "FSDP layouts × instance types (4 nodes × 2 ranks" in text and "not in a cluster placement group" in text
    assert "does not fit (68 GiB)" in text and "will 4 nodes beat 1?" in text
    assert "in a cluster placement group" in "\n".join(table_lines(rows, Network(placement_group=True)))


def test_cputrain_plan_writes_the_table_into_plan_json(capsys):
    from cputrain.cli import main

    args = ["plan", SEEDS, "--nnodes", "4", "--nproc-per-node", "2", "--json"]
    assert main([*args, "--instance-type", "r7i.8xlarge", "--placement-group"]) == 0
    time = json.loads(capsys.readouterr().out)["time"]
    assert time["flow_cap_gbit_s"] == 10 and time["layout"] == "gather_once"
    layouts = {row["instance_type"]: row for row in time["layouts"]}
    assert len(layouts) == len(builtin_instances()) and layouts["r7i.8xlarge"]["best"] == "gather_once"
    assert layouts["r7i.8xlarge"]["one_node"]["layout"] == "full_shard"
    assert main(["plan", SEEDS, "parallel.strategy=zero3", "--nnodes", "4", "--nproc-per-node", "2", "--json"]) == 0
    assert "layouts" not in json.loads(capsys.readouterr().out)["time"]  # fsdp's layouts only
