"""parallel.layout, reduce_dtype, reduce_scatter and prefetch refused in one line before any work, through the
command in this process: on a strategy other than fsdp, a layout the nodes do not admit, ranks
that do not divide into nodes, a layout whose memory plan does not fit this node."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides


def refused(tmp_path, *args, env: dict | None = None) -> str:
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", tmp_path / "cache"), *args, env=env)
    assert proc.returncode != 0, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "auto"])
def test_a_layout_on_another_strategy(tmp_path, strategy):
    err = refused(tmp_path, f"parallel.strategy={strategy}", "parallel.layout=hybrid")
    assert "parallel.layout=hybrid needs parallel.strategy=fsdp" in err and "leave parallel.layout=auto" in err


def test_a_reduce_dtype_on_a_strategy_that_cannot_take_it(tmp_path):
    err = refused(tmp_path, "parallel.strategy=zero3", "parallel.reduce_dtype=bf16")
    assert "parallel.reduce_dtype=bf16 needs parallel.strategy=fsdp (here zero3)" in err


def test_node_layouts_on_one_node(tmp_path):
    err = refused(tmp_path, "parallel.strategy=fsdp", "parallel.layout=hybrid", "--nproc-per-node", "2")
    assert "parallel.layout=hybrid replicates across nodes" in err
    err = refused(tmp_path, "parallel.strategy=fsdp", "parallel.layout=node_reshard", "--nnodes", "2",
                  "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:29400")
    assert "2 or more nodes of 2 or more ranks (here 2 node(s) of 1)" in err


def test_ranks_that_do_not_divide_into_nodes(tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "layouts", "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    err = refused(tmp_path, "parallel.strategy=fsdp", "parallel.layout=gather_once", env=env)
    assert "3 ranks do not divide into nodes of 2" in err


def test_a_layout_that_does_not_fit_this_node(tmp_path, monkeypatch):
    import cputrain.hardware

    here = cputrain.hardware.detect()
    monkeypatch.setattr(cputrain.hardware, "detect", lambda *a, **k: replace(here, memory_gib=0.5))
    err = refused(tmp_path, "parallel.strategy=fsdp", "parallel.layout=gather_once", "--nproc-per-node", "2")
    assert "parallel.layout=gather_once does not fit this node" in err and "of the node's 0.5 GiB" in err
    assert "(full_shard:" in err and "parallel.layout=auto" in err


def test_cputrain_plan_refuses_a_layout_its_nodes_do_not_admit():
    for args, words in ((["--nnodes", "1", "--nproc-per-node", "2"], "parallel.layout=hybrid replicates across nodes"),
                        (["--world-size", "4"], "parallel.layout=hybrid is planned per node")):
        proc = run_cli_here("plan", "configs/llama3-8b-fsdp.yaml", "parallel.layout=hybrid", *args)
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("layout", ["hybrid", "node_reshard"])
def test_cputrain_plan_plans_a_node_layout_on_many_nodes_against_what_one_node_runs(layout):
    """"Will 4 beat 1?" re-plans the config on one node, where hybrid and node_reshard do not run:
    one node takes what auto decides there, and the plan says so."""
    proc = run_cli_here("plan", "configs/llama3-8b-fsdp.yaml", "--nnodes", "4", "--nproc-per-node", "2",
                        f"parallel.layout={layout}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "will 4 nodes beat 1?" in proc.stdout
    assert f"(parallel.layout={layout} does not run on one node: one node is planned with full_shard, as " \
           "parallel.layout=auto decides there)" in proc.stdout
    k8s = run_cli_here("k8s", "configs/llama3-8b-fsdp.yaml", "--name", "a", "--image", "i", "--nnodes", "4",
                       "--nproc-per-node", "2", f"parallel.layout={layout}")
    assert k8s.returncode == 0 and f"layout: {layout}" in k8s.stdout, k8s.stderr[-3000:]


def test_cputrain_plan_honours_world_size_with_nnodes_or_refuses_both():
    proc = run_cli_here("plan", "configs/llama3-8b-fsdp.yaml", "--nnodes", "4", "--world-size", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fit = json.loads(proc.stdout)["cluster"]
    assert (fit["nnodes"], fit["nproc_per_node"]) == (4, 2)
    proc = run_cli_here("plan", "configs/llama3-8b-fsdp.yaml", "--nnodes", "3", "--world-size", "8")
    assert proc.returncode == 2 and "--world-size 8 does not divide into --nnodes 3 nodes" in proc.stderr


@pytest.mark.parametrize("strategy, setting, needs", [
    ("ddp", "parallel.reduce_scatter=all_to_all", "needs parallel.strategy=fsdp or parallel.strategy=zero3 (here ddp)"),
    ("auto", "parallel.reduce_scatter=native", "(here auto, which resolves to single or ddp)"),
    ("single", "parallel.prefetch=false", "parallel.prefetch=false needs parallel.strategy=fsdp (here single)"),
    ("zero3", "parallel.prefetch=false", "leave parallel.prefetch=true"),
    ("ddp", "parallel.overlap_reduction=false", "parallel.overlap_reduction=false needs parallel.strategy=fsdp (here ddp)"),
])
def test_a_sharding_key_no_strategy_of_its_reads(tmp_path, strategy, setting, needs):
    """reduce_scatter and prefetch do nothing under ddp or single: refused as layout is, not accepted
    and written to config.yaml as if they had acted."""
    err = refused(tmp_path, f"parallel.strategy={strategy}", setting)
    assert needs in err, err


def test_reduce_scatter_under_zero3_is_taken(tmp_path):
    from cputrain.config.file import load_config

    assert load_config(None, ["parallel.strategy=zero3", "parallel.reduce_scatter=native"]).parallel.reduce_scatter \
        == "native"
