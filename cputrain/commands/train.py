"""`cputrain train [CONFIG] [key=value ...]`: a run in this process, or its ranks through the
torchrun agent; re-run, it resumes from the newest complete checkpoint."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    train = sub.add_parser(
        "train",
        help="train or fine-tune a model (resumes from the newest checkpoint in output_dir)",
        description="Train from a YAML config with dotted key=value overrides; no config runs the built-in demo. "
        "Re-running the same command resumes from the newest complete checkpoint.",
        epilog="overrides: any config key, e.g. train.max_steps=20 data.seq_len=512 hardware.precision=fp32\n"
        "           `cputrain train --help-config` lists every key with its default and meaning.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", help="YAML config file (optional)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=20")
    train.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    train.add_argument("--take-over-lock", action="store_true",
                       help="take output_dir's run.lock from the run holding it (use when that run is gone)")
    # torchrun's flags; each maps onto config section `launch` (PET_* variables give their defaults).
    dist = train.add_argument_group("ranks and nodes (torchrun's flags; default from PET_* variables)")
    dist.add_argument("--nproc-per-node", type=int, help="ranks on this node, started by the torchrun agent")
    dist.add_argument("--nnodes", type=int, help="nodes taking part")
    dist.add_argument("--node-rank", type=int, help="this node's index, 0 … nnodes-1 (node 0 hosts the rendezvous)")
    dist.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous on node 0")
    dist.add_argument("--max-restarts", type=int, help="restart the ranks this many times after one dies")
    dist.add_argument("--dry-run", action="store_true", help="print each rank's threads, cores and settings; start nothing")
    return train


def run(args) -> int:
    from cputrain.config.file import config_and_overrides, describe_fields, load_config
    if args.help_config:
        for key, default, doc in describe_fields():
            print(f"{key:<34} {default:<22} {doc}")
        return 0
    config_path, overrides = config_and_overrides(args.config, args.overrides)
    if args.from_command_line:
        # Before anything loads torch: libgomp reads its wait variables once, as it loads.
        from cputrain.native.openmp_waits import set_before_torch

        set_before_torch()
    from cputrain.distributed.agent import pet_overrides
    from cputrain.training.launch import launch

    flags = {"nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes, "node_rank": args.node_rank,
             "rdzv_endpoint": args.rdzv_endpoint, "max_restarts": args.max_restarts}
    # Precedence: config file < PET_* variables < key=value overrides < flags.
    overrides = pet_overrides() + overrides + [f"launch.{k}={v}" for k, v in flags.items() if v is not None]
    from cputrain.training.objective_data_keys import objective_sets_data_keys

    cfg = objective_sets_data_keys(load_config(config_path, overrides))
    if args.from_command_line and not args.dry_run:
        _start_again_with_allocator(cfg)
    # Ranks started by the agent re-run this same command, config and overrides included.
    worker_args = ([config_path] if config_path else []) + overrides + (["--debug"] if args.debug else []) + (
        ["--take-over-lock"] if args.take_over_lock else [])
    from cputrain.training.worker import run_worker

    summary = launch(cfg, worker_args, run_here=lambda: run_worker(cfg, take_over_lock=args.take_over_lock),
                     dry_run=args.dry_run)
    return 0 if summary is not None else 1


def _start_again_with_allocator(cfg) -> None:
    """A one-process run started from the command line starts itself again, once, with tcmalloc
    preloaded (hardware.allocator; a library can only be preloaded into a new process). Nothing
    has been read, written or imported by then; the pid stays the same (exec), so signals and
    exit codes are the caller's as before. The agent preloads its ranks itself."""
    from cputrain.native.allocator import allocator_choice, reexec_env
    from cputrain.distributed.env import started_by_launcher

    if started_by_launcher() or cfg.launch.nproc_per_node * cfg.launch.nnodes != 1:
        return
    env = reexec_env(allocator_choice(cfg.hardware.allocator), dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "cputrain", *sys.argv[1:]], env)
