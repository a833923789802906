"""The one owner of checkpoints/ and model/: save a step folder, load the newest complete one,
keep the last k, export a plain Hugging Face model. Strategies hand it their state
(Strategy.checkpoint_state, Strategy.full_state_dict) and write no files themselves.

    checkpoints/step-N/  state/ (DCP: model + optimizer, trained parameters only, so a LoRA
                         checkpoint is its adapters; zero3: DeepSpeed's), rng/rank-K.pt,
                         trainer_state.json (written last: the folder counts once it exists)
    model/               the export: a plain Hugging Face model, or for LoRA a peft adapter folder
"""

from __future__ import annotations

import io
import json
import logging
import random
import warnings
from collections.abc import Callable

import torch

from cputrain.run_folder.layout import RunFolder
from cputrain.config import Config
from cputrain.distributed import process_group as pg
from cputrain.distributed.env import RankEnv
from cputrain.errors import RunFolderError

log = logging.getLogger("cputrain")


class Checkpoints:
    def __init__(self, run: RunFolder, cfg: Config, ranks: RankEnv):
        self.run, self.cfg, self.ranks = run, cfg, ranks

    def should_save(self, step: int, total_steps: int, stop_at: int) -> bool:
        """Every train.checkpoint_every steps, at the end of the schedule, and where this session
        stops early (train.stop_at_step), so the next one resumes there."""
        return step % self.cfg.train.checkpoint_every == 0 or step in (total_steps, stop_at)

    def save(self, step: int, strategy, model, optimizer, schedule) -> None:
        tmp = self.run.step_path(step, tmp=True)
        if self.ranks.is_main and self.run.fs.exists(tmp):
            self.run.fs.rm(tmp, recursive=True)  # left by a save that was killed
        pg.barrier()
        with warnings.catch_warnings():
            # DCP notes that it runs without a process group; for one rank that is the intent.
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            with strategy.meter.suspended():  # checkpoint traffic is not training-step traffic
                strategy.checkpoint_state(model, optimizer).save(self.run.url_of(f"{tmp}/state"))
        rng = {"torch": torch.get_rng_state(), "python": list(_flatten(random.getstate()))}
        buf = io.BytesIO()
        torch.save(rng, buf)
        self.run.fs.makedirs(f"{tmp}/rng", exist_ok=True)
        with self.run.fs.open(f"{tmp}/rng/rank-{self.ranks.rank:05d}.pt", "wb") as f:
            f.write(buf.getvalue())
        pg.barrier()  # every rank's shards are on disk before the folder is declared complete
        if self.ranks.is_main:
            state = {
                "step": step,
                "sequences_consumed": step * self.cfg.train.global_batch_size,
                "world_size": self.ranks.world_size,
                "strategy": self.cfg.parallel.strategy,
                "schedule": schedule.state_dict(),
            }
            with self.run.fs.open(f"{tmp}/trainer_state.json", "w") as f:  # written last
                f.write(json.dumps(state, indent=1, default=str))
            self.run.commit(step)
            self.run.prune(self.cfg.train.keep_last)
        pg.barrier()

    def load_latest(self, strategy, model, optimizer, schedule) -> int | None:
        step = self.run.newest_complete()
        if step is None:
            return None
        folder = self.run.step_path(step)
        state = json.loads(self.run.fs.cat_file(f"{folder}/trainer_state.json"))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                strategy.checkpoint_state(model, optimizer).load(self.run.url_of(f"{folder}/state"))
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunFolderError(
                f"checkpoint {folder} does not fit this model ({first[:200]}); "
                "it is from a different model: choose a new output_dir"
            ) from None
        schedule.load_state_dict(state["schedule"])
        rng_file = f"{folder}/rng/rank-{self.ranks.rank:05d}.pt"
        if self.run.fs.exists(rng_file) and state.get("world_size") == self.ranks.world_size:
            rng = torch.load(io.BytesIO(self.run.fs.cat_file(rng_file)), weights_only=True)
            torch.set_rng_state(rng["torch"])
            random.setstate(_unflatten(rng["python"]))
        return int(state["step"])

    def export(self, strategy, write_model: Callable[[str, bool], None]) -> None:
        """model/: `write_model(folder, is_writer)` writes it (the model converter's export: a
        plain Hugging Face model, or LoRA's adapter folder), here or staged and uploaded."""
        local = self.run.local_path()
        target = f"{local}/model" if local else None
        if target is None:  # remote run folder: export locally, then upload
            import tempfile

            staging = tempfile.mkdtemp(prefix="cputrain-export-")
            target = f"{staging}/model"
        with strategy.meter.suspended():  # the gathers of the export are not training-step traffic
            write_model(target, self.ranks.is_main)
        if self.ranks.is_main and local is None:
            self.run.fs.put(target, self.run.path("model"), recursive=True)
        pg.barrier()


def _flatten(state):
    version, internal, gauss = state
    return [version, *internal, -1 if gauss is None else gauss]


def _unflatten(flat):
    version, *rest = flat
    internal, gauss = tuple(int(x) for x in rest[:-1]), rest[-1]
    return (version, internal, None if gauss == -1 else gauss)
