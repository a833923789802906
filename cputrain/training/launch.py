"""Starting the ranks: in this process, or N per node through torchrun's elastic agent.

    started by torchrun / mpirun (RANK or OMPI_COMM_WORLD_RANK … set)  → run the worker here
    launch.nproc_per_node × launch.nnodes > 1                          → torchrun's agent starts
                                                                         `python -m cputrain train …`
    otherwise                                                          → one rank, here

This is the command's orchestration (what LitGPT's setup() is to its main()): the checks made
before any work, the dry run, the plan of this node's ranks (their threads, cores and allocator,
from the resolved config), and the choice between running here and starting the agent. Before
anything starts, the plan is checked (node rank in range, batch divisible, port free) so a bad
flag fails at once on every node instead of as a hang. The agent itself is distributed.agent's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from cputrain.config import Config
from cputrain.distributed.agent import (LaunchError, NodeLaunch, RankPlacement, run_agent,
                                        split_endpoint, torchrun_args)
from cputrain.native.allocator import allocator_choice
from cputrain.distributed.env import normalize, started_by_launcher
from cputrain.distributed.env_check import check_rank_variables, wait_for_master
from cputrain.distributed.placement import core_sets, cpus_for_rank
from cputrain.hardware import HardwareFacts, detect
from cputrain.training.preflight import check_before_work
from cputrain.config.resolve import resolve, settings_of

log = logging.getLogger("cputrain")


def node_launch(cfg: Config, hw: HardwareFacts, environ: dict | None = None) -> NodeLaunch:
    """Everything decided before a rank starts, with reasons; raises on bad input."""
    env = os.environ if environ is None else environ
    launch = cfg.launch
    if launch.node_rank >= launch.nnodes:
        raise LaunchError(f"--node-rank {launch.node_rank} is out of range for --nnodes {launch.nnodes}; "
                          f"use 0 … {launch.nnodes - 1}")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address), "
                          "or PET_MASTER_ADDR and PET_MASTER_PORT")
    # One node: port 0, so the agent's store binds a free port itself. A port picked here and bound
    # later could be taken in between by any process's outgoing connection (EADDRINUSE at random).
    endpoint = launch.rdzv_endpoint or "127.0.0.1:0"
    split_endpoint(endpoint)
    world = launch.nnodes * launch.nproc_per_node
    res = resolve(cfg, hw, world, launch.nproc_per_node)  # raises if the world size does not divide the batch
    res.note("launch.nproc_per_node", launch.nproc_per_node,
             "ranks on this node, each with threads = cores ÷ ranks (not torchrun's OMP_NUM_THREADS=1)")
    threads = res.config.hardware.threads
    sets = core_sets(hw, launch.nproc_per_node)
    plan = NodeLaunch(
        nnodes=launch.nnodes, nproc_per_node=launch.nproc_per_node, node_rank=launch.node_rank,
        endpoint=endpoint, is_host=launch.node_rank == 0,
        allocator=allocator_choice(res.config.hardware.allocator, env, precision=res.config.hardware.precision,
                                   strategy=res.config.parallel.strategy),
        reasons=res.reasons, settings=settings_of(res.config), placement_reason=sets.reason if res.config.hardware.pin_cores else "pinning off (hardware.pin_cores=false)",
    )
    for local in range(launch.nproc_per_node):
        cpus = cpus_for_rank(hw, local, launch.nproc_per_node, res.config) if res.config.hardware.pin_cores else None
        plan.ranks.append(RankPlacement(launch.node_rank * launch.nproc_per_node + local, local, threads, cpus))
    return plan


def launch(cfg: Config, worker_args: list[str], run_here: Callable[[], dict], dry_run: bool = False) -> dict | None:
    """Run `cputrain train` here (`run_here`, the worker) or through the agent; returns rank 0's
    summary when it ran here."""

    # Everything that can be refused without data or weights is refused now, before any rank
    # starts or waits: leftover rank variables, the run folder, the model config.
    check_rank_variables()
    outside = started_by_launcher()
    writer = not outside or normalize(dict(os.environ)).rank == 0  # ranks do not probe the folder at once
    check_before_work(cfg, probe_output_dir=writer)
    if outside and not dry_run:
        wait_for_master(cfg.launch.rdzv_timeout_s)
    if outside or cfg.launch.nproc_per_node * cfg.launch.nnodes == 1:
        if dry_run:
            ranks = normalize(dict(os.environ))
            single = cfg.model_copy(deep=True)
            single.launch.nnodes, single.launch.nproc_per_node = 1, ranks.local_world_size
            single.launch.node_rank = 0
            plan = node_launch(single, detect())
            plan.ranks = [r for r in plan.ranks if r.local_rank == ranks.local_rank]
            for r in plan.ranks:
                r.rank = ranks.rank
            print(f"started by {ranks.launcher}: rank {ranks.rank} of {ranks.world_size}")
            print("\n".join(plan.lines()))
            return {}
        return run_here()
    plan = node_launch(cfg, detect())
    if dry_run:
        print("\n".join(plan.lines()))
        print("  agent: torchrun " + " ".join(torchrun_args(plan, cfg, worker_args)))
        return {}
    for line in plan.lines():
        log.info(line)
    run_agent(plan, cfg, worker_args)
    return {}
