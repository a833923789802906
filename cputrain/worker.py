"""What every rank runs: resolve the config for this machine, then setup() and fit()."""

from __future__ import annotations

import logging

from cputrain.config import Config
from cputrain.distributed.env import normalize
from cputrain.hardware import detect
from cputrain.log import setup_logging
from cputrain.metrics.summary import summary_table
from cputrain.resolve import check_agent_agrees, resolve

log = logging.getLogger("cputrain")


def run_worker(cfg: Config, take_over_lock: bool = False) -> dict:
    ranks = normalize()  # also sets LOCAL_RANK & co. so no library dies on a KeyError
    setup_logging(ranks.rank)
    hw = detect()
    res = resolve(cfg, hw, ranks.world_size, ranks.local_world_size)
    check_agent_agrees(res.config)
    if ranks.is_main:
        log.info("%s rank(s) started by %s; %d physical cores, %.1f GiB", ranks.world_size, ranks.launcher,
                 hw.physical_cores, hw.memory_gib)
        for key, value, why in res.reasons:
            log.info("auto: %s = %s (%s)", key, value, why)
    from cputrain.distributed.placement import cpus_for_rank
    from cputrain.distributed.process_group import collective_threads, destroy, exit_without_teardown
    from cputrain.trainer import Trainer

    cpus = cpus_for_rank(hw, ranks.local_rank, ranks.local_world_size, res.config) if res.config.hardware.pin_cores else None
    trainer = Trainer(res.config, hw, ranks, cpus=cpus, reasons=res.reasons, take_over_lock=take_over_lock)
    try:
        trainer.setup()
        summary = trainer.fit()
        if ranks.is_main and trainer.exported:  # still under the run lock: these are run-folder files
            after_export(res.config)
    finally:  # at the end and on an error exit: the next run need not wait for the lock to go stale
        trainer.release_lock()
    if ranks.is_main and summary:
        for line in summary_table(summary):
            log.info(line)
        log.info("run folder: %s", cfg.output_dir)
    # The wrapped model holds the process group: release it, then the group, so no collective
    # thread is left for interpreter teardown (see distributed.process_group.destroy).
    trainer.close()
    del trainer
    destroy()
    held = collective_threads()
    if held:
        log.debug("rank %d: %d collective thread(s) still held after the group was destroyed (%s); "
                  "ending without interpreter teardown", ranks.rank, len(held), ", ".join(held))
        exit_without_teardown(0)
    return summary


def after_export(cfg: Config) -> None:
    """Rank 0, once model/ and metrics.jsonl are written: loss.png (metrics.plot owns it) and
    sample.txt (generated from the exported model) in a local run folder."""
    from pathlib import Path

    from cputrain.run_folder.layout import RunFolder

    run = RunFolder(cfg.output_dir)
    local = run.local_path()
    if local is None:
        return
    from cputrain.metrics.jsonl import MetricsJsonl
    from cputrain.metrics.plot import plot_losses

    plot_losses(MetricsJsonl(run).rows(), Path(local) / "loss.png")
    if cfg.train.sample_tokens > 0:
        from cputrain.inference import generate_text

        text = generate_text(f"{local}/model", prompt="The", max_new_tokens=cfg.train.sample_tokens, seed=cfg.seed)
        (Path(local) / "sample.txt").write_text(text + "\n")
