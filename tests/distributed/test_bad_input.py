"""Bad launch input fails fast with one clear line and a non-zero exit, leaving no process behind.

Flags and rank variables refused before any rank starts are asserted in this process
(`run_cli_here`: the test fails if the command reaches the worker or the agent); one of them also
runs as its own process."""

from __future__ import annotations

import socket
import time

import pytest

from harness.cli_env import cli_env
from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides
from dist_helpers import assert_no_survivors, free_port

pytestmark = pytest.mark.slow


def _error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("cputrain: error:")]
    assert lines, proc.stderr[-2000:]
    return lines[-1]


def test_unreachable_endpoint_times_out_naming_it(tmp_path, cache_dir):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = run_cli("train", *tiny_overrides(tmp_path / "run", cache_dir, **{"launch.rdzv_timeout_s": 3}),
                   "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                   timeout=120)
    assert proc.returncode != 0
    assert endpoint in _error_line(proc)
    assert_no_survivors(tmp_path / "run")


def test_port_in_use(tmp_path, cache_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli("train", *tiny_overrides(tmp_path / "run", cache_dir),
                       "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", timeout=120)
    assert proc.returncode == 2
    assert f"port {port}" in _error_line(proc) and "in use" in _error_line(proc)
    assert_no_survivors(tmp_path / "run")


def test_world_size_must_divide_global_batch(tmp_path, cache_dir):
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", cache_dir), "--nproc-per-node", "3")
    assert proc.returncode == 2
    assert "global_batch_size (8) is not divisible" in _error_line(proc)
    assert not (tmp_path / "run").exists()


def test_node_rank_out_of_range(tmp_path, cache_dir):
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", cache_dir), "--nnodes", "2", "--node-rank", "2",
                        "--rdzv-endpoint", "127.0.0.1:29400")
    assert proc.returncode == 2
    assert "--node-rank 2 is out of range for --nnodes 2" in _error_line(proc)


def test_checkpoint_of_another_model_fails_on_every_rank(tmp_path, cache_dir):
    out = tmp_path / "run"
    run_cli("train", *tiny_overrides(out, cache_dir, **{"train.max_steps": 2, "train.checkpoint_every": 2}), check=True)
    other = tiny_overrides(out, cache_dir, **{"train.max_steps": 4, "model.arch.hidden_size": 32})
    proc = run_cli("train", *other, "--nproc-per-node", "2", timeout=300)
    assert proc.returncode == 2
    assert "holds checkpoints of another run" in _error_line(proc)
    # each rank reported it, and the agent summed it up in one line
    assert proc.stderr.count("holds checkpoints of another run") >= 3
    assert (out / "checkpoints" / "step-000002").is_dir()  # nothing already on disk was lost
    assert_no_survivors(out)


# --- rank variables no launcher set: one line in seconds (was a silent hang) --------------------


@pytest.mark.parametrize("variables, expected, own_process", [
    ({"WORLD_SIZE": 2}, ["WORLD_SIZE=2 is set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not",
                         "unset WORLD_SIZE", "--nproc-per-node"], True),
    ({"WORLD_SIZE": 2, "RANK": 1}, ["RANK=1, WORLD_SIZE=2 are set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"],
     False),
    ({"RANK": 1}, ["RANK=1 is set", "one process can only be rank 0", "unset RANK"], False),
], ids=["world-size", "world-size-and-rank", "rank"])
def test_leftover_rank_variables(tmp_path, variables, expected, own_process):
    started = time.monotonic()
    args = ("train", *tiny_overrides(tmp_path / "run", tmp_path / "cache"))
    proc = run_cli(*args, env=cli_env(**variables), timeout=120) if own_process else run_cli_here(*args, env=variables)
    assert time.monotonic() - started < 60
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _error_line(proc)
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-2000:]
    for text in expected:
        assert text in line, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_rank_started_by_hand_with_no_rank_0_fails_in_seconds(tmp_path):
    port = free_port()  # nothing listens there
    env = dict(RANK=1, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    started = time.monotonic()
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", tmp_path / "cache", **{"launch.rdzv_timeout_s": 3}),
                        env=env)
    assert time.monotonic() - started < 60
    assert proc.returncode == 2
    line = _error_line(proc)
    assert f"nothing answers at MASTER_ADDR:MASTER_PORT (127.0.0.1:{port}) after 3s" in line, line
    assert not (tmp_path / "cache").exists()
