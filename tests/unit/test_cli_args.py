"""Flags and key=value overrides may come in any order on the command line."""

from __future__ import annotations

import pytest

from cputrain.cli import build_parser, parse_command_line
from harness.run_cli_here import run_cli_here


def parse(*words):
    return parse_command_line(build_parser(), list(words))


@pytest.mark.parametrize("words", [
    ("train", "cfg.yaml", "train.max_steps=5", "data.seq_len=64", "--nproc-per-node", "2"),
    ("train", "cfg.yaml", "--nproc-per-node", "2", "train.max_steps=5", "data.seq_len=64"),
    ("train", "cfg.yaml", "train.max_steps=5", "--nproc-per-node", "2", "data.seq_len=64"),
    ("train", "--nproc-per-node", "2", "cfg.yaml", "train.max_steps=5", "data.seq_len=64"),
])
def test_train_overrides_before_or_after_flags(words):
    args = parse(*words)
    assert args.config == "cfg.yaml"
    assert args.overrides == ["train.max_steps=5", "data.seq_len=64"]
    assert args.nproc_per_node == 2


def test_no_config_file_only_overrides_after_flags():
    args = parse("train", "--dry-run", "--max-restarts", "1", "train.max_steps=5", "--nnodes", "1", "a.b=2")
    # the first override lands in `config`; commands.train moves a word with '=' that is no file to the overrides
    assert [args.config, *args.overrides] == ["train.max_steps=5", "a.b=2"]
    assert args.dry_run and args.max_restarts == 1 and args.nnodes == 1


def test_unknown_flag_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("train", "train.max_steps=5", "--procs", "2")
    assert exc.value.code == 2
    assert "unrecognized arguments: --procs" in capsys.readouterr().err


def test_stray_word_for_a_command_without_overrides_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("doctor", "train.max_steps=5")
    assert "unrecognized arguments: train.max_steps=5" in capsys.readouterr().err


def test_dry_run_plan_is_the_same_in_both_orders(tmp_path):
    """Through the command's entry function: the agent's worker command carries the overrides either way."""
    out = tmp_path / "run"
    before = run_cli_here("train", f"output_dir={out}", "train.micro_batch_size=3", "train.global_batch_size=6",
                          "--nproc-per-node", "2", "--dry-run", check=True)
    after = run_cli_here("train", "--nproc-per-node", "2", "--dry-run", f"output_dir={out}",
                         "train.micro_batch_size=3", "train.global_batch_size=6", "hardware.precision=fp32", check=True)
    for proc in (before, after):
        agent = next(line for line in proc.stdout.splitlines() if "agent: torchrun" in line)
        assert "--nproc-per-node=2" in agent and str(out) in agent
        assert "train.micro_batch_size=3 train.global_batch_size=6" in agent
        # one node: port 0, so the agent's store binds a free port as it opens (none picked early)
        assert "--rdzv-endpoint=127.0.0.1:0" in agent and "127.0.0.1 (a free port)" in proc.stdout
    assert "rank 1 (local 1)" in after.stdout
    # the malloc's reason cites the measurement of the run's precision (installed or not)
    allocator = next(line for line in after.stdout.splitlines() if "allocator:" in line)
    assert "fp32 tokens/s" in allocator and "bf16 tokens/s" not in allocator
