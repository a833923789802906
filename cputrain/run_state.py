"""What a run keeps in its folder, and how it picks up where it stopped.

    config.yaml          the resolved config (reasons for each "auto" as comments)
    metrics.jsonl        one line per logged step
    summary.json         final figures
    memory.json          memory per setup phase, per rank
    checkpoints/step-N/  state/ (DCP: model + optimizer), rng/rank-K.pt, trainer_state.json
    model/               plain Hugging Face export
    loss.png, sample.txt
"""

from __future__ import annotations

import io
import json
import logging
import random
import warnings

import torch
import yaml

from cputrain.checkpoint.folders import RunFolder
from cputrain.config import Config
from cputrain.distributed import process_group as pg
from cputrain.distributed.env import RankEnv
from cputrain.errors import RunFolderError

log = logging.getLogger("cputrain")

# Keys that define what is being trained. A run folder's checkpoints only continue a run whose
# values here are the same; everything else (steps, logging, ranks, threads) may change.
IDENTITY_KEYS = (
    "seed",
    "model.name_or_path",
    "model.arch",
    "model.tokenizer",
    "model.tokenizer_vocab_size",
    "data.source",
    "data.hf_config",
    "data.text_field",
    "data.seq_len",
    "data.val_fraction",
    "data.max_documents",
    "train.global_batch_size",
)


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_compatible(run: RunFolder, cfg: Config) -> None:
    """Refuse to touch a run folder whose checkpoints belong to a different run."""
    if run.fs.exists(run.root) and not run.fs.isdir(run.root):
        raise RunFolderError(f"output_dir '{run.url}' is a file, not a folder; choose another output_dir")
    if not run.complete_steps():
        return
    old_text = run.read_text("config.yaml")
    if old_text is None:
        raise RunFolderError(
            f"output_dir '{run.url}' holds checkpoints but no config.yaml; choose another output_dir"
        )
    old, new = yaml.safe_load(old_text) or {}, cfg.model_dump(mode="json")
    for key in IDENTITY_KEYS:
        there, now = _get(old, key), _get(new, key)
        if there != now:
            if isinstance(there, dict) and isinstance(now, dict):  # name the one entry that differs
                sub = next(k for k in sorted(set(there) | set(now), key=str) if there.get(k) != now.get(k))
                key, there, now = f"{key}.{sub}", there.get(sub), now.get(sub)
            raise RunFolderError(
                f"output_dir '{run.url}' holds checkpoints of another run ({key}: {there!r} there, "
                f"{now!r} now); choose a new output_dir or set {key} back to resume it"
            )


class RunState:
    def __init__(self, run: RunFolder, cfg: Config, ranks: RankEnv, reasons: list | None = None):
        self.run, self.cfg, self.ranks = run, cfg, ranks
        self.reasons = reasons or []

    # --- run files ---------------------------------------------------------------------
    def write_run_files(self) -> None:
        if not self.ranks.is_main:
            return
        header = "".join(f"# {key} = {value}: {why}\n" for key, value, why in self.reasons)
        self.run.write_text(header + self.cfg.dump_yaml(), "config.yaml")

    # --- checkpoints -------------------------------------------------------------------
    def save(self, step: int, strategy, model, optimizer, schedule) -> None:
        tmp = self.run.step_path(step, tmp=True)
        if self.ranks.is_main and self.run.fs.exists(tmp):
            self.run.fs.rm(tmp, recursive=True)  # left by a save that was killed
        pg.barrier()
        with warnings.catch_warnings():
            # DCP notes that it runs without a process group; for one rank that is the intent.
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            strategy.save(model, optimizer, self.run.url_of(f"{tmp}/state"))
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
                strategy.load(model, optimizer, self.run.url_of(f"{folder}/state"))
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

    # --- end of run --------------------------------------------------------------------
    def export(self, strategy, model, hf_config, tokenizer) -> None:
        from cputrain.checkpoint.export import export_hf

        local = self.run.local_path()
        target = f"{local}/model" if local else None
        if target is None:  # remote run folder: export locally, then upload
            import tempfile

            staging = tempfile.mkdtemp(prefix="cputrain-export-")
            target = f"{staging}/model"
        export_hf(strategy.full_state_dict(model), hf_config, tokenizer, target, is_writer=self.ranks.is_main)
        if self.ranks.is_main and local is None:
            self.run.fs.put(target, self.run.path("model"), recursive=True)
        pg.barrier()

    def after_export(self) -> None:
        """Rank 0: the loss plot and a generated sample, both from files already written."""
        local = self.run.local_path()
        if local is None:
            return
        from pathlib import Path

        from cputrain.metrics.plot import plot_losses

        plot_losses(Path(local) / "metrics.jsonl", Path(local) / "loss.png")
        if self.cfg.train.sample_tokens > 0:
            from cputrain.generate import generate_text

            text = generate_text(f"{local}/model", prompt="The", max_new_tokens=self.cfg.train.sample_tokens,
                                 seed=self.cfg.seed)
            (Path(local) / "sample.txt").write_text(text + "\n")


def _flatten(state):
    version, internal, gauss = state
    return [version, *internal, -1 if gauss is None else gauss]


def _unflatten(flat):
    version, *rest = flat
    internal, gauss = tuple(int(x) for x in rest[:-1]), rest[-1]
    return (version, internal, None if gauss == -1 else gauss)
