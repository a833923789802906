"""What every rank runs: resolve the config for this machine, then setup() and fit()."""

from __future__ import annotations

import gc
import logging
import os

from cputrain.training import choices
from cputrain.config import Config
from cputrain.distributed.env import normalize
from cputrain.hardware import detect
from cputrain.log import setup_logging
from cputrain.metrics.summary import summary_table
from cputrain.native.allocator import tune_glibc
from cputrain.native.openmp_waits import describe as describe_waits
from cputrain.parallel import needs_process_group
from cputrain.run_folder.layout import RunFolder
from cputrain.run_folder.run_config import read_recorded
from cputrain.config.resolve import check_agent_agrees, resolve

log = logging.getLogger("cputrain")


def run_worker(cfg: Config, take_over_lock: bool = False) -> dict:
    ranks = normalize()  # also sets LOCAL_RANK & co. so no library dies on a KeyError
    setup_logging(ranks.rank)
    hw = detect()
    # A rank mpirun bound to fewer CPUs than its cgroup allows: those are its own cores.
    bound = ranks.launcher == "mpirun" and bool(hw.affinity_narrowed) and ranks.local_world_size > 1
    res = resolve(cfg, hw, ranks.world_size, ranks.local_world_size, bound_by_launcher=bound)
    check_agent_agrees(res.config)
    # Whether this rank forms a process group, read off the resolved config with its checks: several
    # ranks, or one of a strategy that runs collectives anyway (every one but single).
    needs_group = ranks.distributed or needs_process_group(res.config.parallel.strategy)
    # The run folder's config.yaml, read once: a resumed run keeps what it recorded (the choices
    # below, and the trainer's check of the folder).
    recorded = read_recorded(RunFolder(cfg.output_dir))
    user_threads = os.environ.get("OMP_NUM_THREADS")
    # A one-process run (launcher "python") inherits the user's own value; a launcher's (torchrun's
    # 1, cputrain's agent's own) is not the user's to be told about.
    if ranks.launcher == "python" and user_threads and user_threads != str(res.config.hardware.threads):
        log.warning("OMP_NUM_THREADS=%s is set in the environment: cputrain sets each rank's threads from "
                    "hardware.threads (%s here) instead; set hardware.threads=%s to use %s", user_threads,
                    res.config.hardware.threads, user_threads, user_threads)
    from cputrain.distributed import group_nodes
    from cputrain.distributed import process_group as pg
    from cputrain.distributed.placement import cpus_for_rank
    from cputrain.training.trainer import Trainer

    # What the imports made (torch, its distributed and tensor packages: most of the objects this
    # process will ever hold) lives until the process ends: out of every later garbage collection,
    # which then walks only what the run makes (the two at the end, pg.destroy, and Python's own
    # during training). Nothing here holds the process group, which does not exist yet.
    gc.freeze()

    # This rank's cores and threads, then the process group: everything after runs on the
    # right threads, and the attention kernel is timed (by rank 0) on them.
    cpus = cpus_for_rank(hw, ranks.local_rank, ranks.local_world_size, res.config) if res.config.hardware.pin_cores else None
    pg.set_threads(res.config.hardware.threads, cpus)
    if needs_group:
        pg.init_process_group(res.config.parallel.backend, ranks.world_size, res.config.parallel.timeout_s)
    if ranks.distributed and res.config.launch.nnodes > 1:
        # Which node each rank runs on, so a collective failed by a lost node names it.
        group_nodes.learn(res.config.launch.node_rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    # Every "auto" that needs the data, the model or the process group, in one fixed order.
    res = choices.decide(res, hw, ranks, recorded)
    if ranks.is_main:
        log.info("%s rank(s) started by %s; %d physical cores, %.1f GiB", ranks.world_size, ranks.launcher,
                 hw.physical_cores, hw.memory_gib)
        for key, value, why in res.reasons:
            log.info("auto: %s = %s (%s)", key, value, why)
        log.info(describe_waits())
    if res.config.hardware.allocator == "glibc-tuned":  # before the model and its steps allocate
        tune_glibc()
    # From here on the config is read-only: every part of the run sees the same values.
    trainer = Trainer(res.config, hw, ranks, reasons=res.reasons, take_over_lock=take_over_lock, recorded=recorded)
    try:
        trainer.setup()
        summary = trainer.fit()
    finally:  # at the end (a finished run's plot and sample first) and on an error exit
        trainer.close()
    if ranks.is_main and summary:
        for line in summary_table(summary):
            log.info(line)
        log.info("run folder: %s", cfg.output_dir)
    # The wrapped model held the process group, and the trainer has let go of it: the group goes
    # now, so no collective thread is left for interpreter teardown (see distributed.process_group.destroy).
    del trainer
    pg.destroy()
    held = pg.collective_threads()
    if held:
        log.debug("rank %d: %d collective thread(s) still held after the group was destroyed (%s); "
                  "ending without interpreter teardown", ranks.rank, len(held), ", ".join(held))
        pg.exit_without_teardown(0)
    return summary
