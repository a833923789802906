"""The one owner of checkpoints/ and model/: save a step folder, load the newest complete one,
keep the last k, export a plain Hugging Face model. Strategies hand it their state
(Strategy.checkpoint_state, once, when it is made; Strategy.full_state_dict through the export's
writer) and write no files themselves.

    checkpoints/step-N/  state/ (DCP: model + optimizer, trained parameters only, so a LoRA
                         checkpoint is its adapters; zero3: DeepSpeed's), rng/rank-K.pt,
                         trainer_state.json (written last: the folder counts once it exists)
    model/               the export: a plain Hugging Face model, or for LoRA a peft adapter folder
"""

from __future__ import annotations

import errno
import io
import json
import logging
import random
import time
import warnings
from collections.abc import Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from cputrain.run_folder.dcp_state import CheckpointState
from cputrain.run_folder.layout import RunFolder
from cputrain.config import Config
from cputrain.distributed import process_group as pg
from cputrain.distributed.comm import CommMeter
from cputrain.distributed.env import RankEnv
from cputrain.errors import RunFolderError

log = logging.getLogger("cputrain")


class Checkpoints:
    """Rotation keeps the last train.keep_last step folders, and never removes the newest one known
    to be healthy (`healthy_step`) for one that is not yet: a step's loss is computed before its
    update, so the weights saved at step N are known good only once a later step's loss is finite
    (confirm()). A run that diverges right after a save sets that save aside as step-N.diverged
    (set_aside_diverged()), and the re-run resumes from the healthy one."""

    def __init__(self, run: RunFolder, cfg: Config, ranks: RankEnv, state: CheckpointState, meter: CommMeter):
        """`state`: the strategy's model and optimizer state (Strategy.checkpoint_state), which every
        save writes and a resume loads; `meter`: the strategy's communication meter, which leaves
        the traffic of saves and the export out of the training step's."""
        self.run, self.cfg, self.ranks = run, cfg, ranks
        self.state, self.meter = state, meter
        self.last_save_s = time.monotonic()  # the session's start counts as a save for checkpoint_every_s
        self.healthy_step: int | None = None  # the newest checkpoint known to hold healthy weights
        self.unconfirmed: list[int] = []  # saved in this session, not yet followed by a healthy step
        self.objective_state: dict = {}  # the objective's, as the loaded checkpoint kept it (save's objective_state)

    def time_due(self) -> bool:
        """train.checkpoint_every_s has passed since the last save, on this rank's clock (the
        trainer takes rank 0's answer for every rank)."""
        every = self.cfg.train.checkpoint_every_s
        return every is not None and time.monotonic() - self.last_save_s >= every

    def should_save(self, step: int, total_steps: int, stop_at: int) -> bool:
        """Every train.checkpoint_every steps, at the end of the schedule, and where this session
        stops early (train.stop_at_step), so the next one resumes there."""
        return step % self.cfg.train.checkpoint_every == 0 or step in (total_steps, stop_at)

    def save(self, step: int, schedule, objective_state: dict | None = None) -> None:
        """`objective_state`: what the objective keeps for an exact resume (online RL: its sampling
        generator), saved per rank beside the RNG states and read back into `objective_state`."""
        tmp = self.run.step_path(step, tmp=True)
        if self.ranks.is_main and self.run.fs.exists(tmp):
            self.run.fs.rm(tmp, recursive=True)  # left by a save that was killed
        pg.barrier()
        try:
            self._write(step, tmp, schedule, objective_state or {})
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            # A full disk shows as ENOSPC, or only as a short write deep in a writer ("unexpected
            # pos" from torch.save's zip stream): the free space left says which it was.
            if not (disk_full(exc) or _nearly_full(self.run.local_path())):
                raise
            raise self._disk_full_error(step, tmp) from None
        self.last_save_s = time.monotonic()

    def _disk_full_error(self, step: int, tmp: str) -> RunFolderError:
        """The disk filled during the save of `step`: the partial folder goes, the previous
        checkpoint stays, and the message says how much room a checkpoint takes."""
        written = _bytes_under(self.run.fs, tmp)
        if self.ranks.is_main and self.run.fs.exists(tmp):
            self.run.fs.rm(tmp, recursive=True)
        previous = self.run.newest_complete()
        needed = _bytes_under(self.run.fs, self.run.step_path(previous)) if previous is not None else None
        free = _free_bytes(self.run.local_path())
        room = (f"a checkpoint of this run takes {needed / 2**20:,.1f} MiB" if needed else
                f"more than the {written / 2**20:,.1f} MiB written before the disk filled")
        kept = f"{self.run.step_path(previous)} is kept" if previous is not None else "there is no earlier checkpoint"
        return RunFolderError(
            f"the disk filled while saving checkpoint step {step} in {self.run.checkpoints} "
            f"({'' if free is None else f'{free / 2**20:,.1f} MiB free; '}{room}); the partial {tmp.rsplit('/', 1)[-1]} was "
            f"removed and {kept}. Free space there (or lower train.keep_last, or move output_dir), then re-run to resume")

    def _write(self, step: int, tmp: str, schedule, objective_state: dict) -> None:
        with warnings.catch_warnings():
            # DCP notes that it runs without a process group; for one rank that is the intent.
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            with self.meter.suspended():  # checkpoint traffic is not training-step traffic
                self.state.save(self.run.url_of(f"{tmp}/state"))
        rng = {"torch": torch.get_rng_state(), "python": list(_flatten(random.getstate()))}
        if objective_state:
            rng["objective"] = objective_state
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
            self.run.prune(self.cfg.train.keep_last, keep=self.healthy_step)
        self.unconfirmed.append(step)
        pg.barrier()

    def confirm(self) -> None:
        """A healthy step (finite loss, finite weights) followed the saves of this session: they hold
        healthy weights, and rotation may now remove what they replace. Cheap when nothing is
        waiting: called after every healthy step."""
        if not self.unconfirmed:
            return
        self.healthy_step, self.unconfirmed = self.unconfirmed[-1], []
        if self.ranks.is_main:
            self.run.prune(self.cfg.train.keep_last, keep=self.healthy_step)

    def set_aside_diverged(self) -> list[str]:
        """The run diverged: the saves of this session that no healthy step followed are renamed
        step-N.diverged (kept, never loaded), so the re-run resumes from the newest healthy one."""
        moved = []
        if self.ranks.is_main:
            moved = [self.run.set_aside(step, "diverged") for step in self.unconfirmed
                     if step in self.run.complete_steps()]
        self.unconfirmed = []
        pg.barrier()
        return moved

    def newest_intact(self) -> int | None:
        """The newest complete checkpoint that is whole (checkpoint_check). Rank 0 checks; each
        damaged one is renamed to step-N.damaged with one line saying what is wrong, and the
        previous one is tried. Every rank gets the answer, or the same error."""
        found, error = None, None
        if self.ranks.is_main:
            from cputrain.run_folder.checkpoint_check import damage_of

            damaged = []
            for step in reversed(self.run.complete_steps()):
                problem = damage_of(self.run, step)
                if problem is None:
                    found = step
                    break
                aside = self.run.set_aside(step)
                damaged.append(f"step {step} ({problem})")
                log.warning("checkpoint %s is damaged: %s; kept as %s, trying the previous one",
                            self.run.step_path(step), problem, aside)
            if found is None and damaged:
                error = (f"no intact checkpoint is left in {self.run.checkpoints}: {'; '.join(damaged)}; they are kept "
                         "as step-N.damaged. Restore a checkpoint there, or choose a new output_dir to start over")
        found, error = pg.broadcast_from_main((found, error))
        if error:
            raise RunFolderError(error)
        return found

    def load_latest(self, schedule) -> int | None:
        step = self.newest_intact()
        if step is None:
            return None
        folder = self.run.step_path(step)
        state = json.loads(self.run.fs.cat_file(f"{folder}/trainer_state.json"))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                self.state.load(self.run.url_of(f"{folder}/state"))
        except (Exception, CheckpointException) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunFolderError(
                f"checkpoint {folder} does not fit this model ({first[:200]}); "
                "it is from a different model: choose a new output_dir"
            ) from None
        schedule.load_state_dict(state["schedule"])
        self._apply_peak_lr(schedule, int(state["step"]))
        rng_file = f"{folder}/rng/rank-{self.ranks.rank:05d}.pt"
        if self.run.fs.exists(rng_file) and state.get("world_size") == self.ranks.world_size:
            rng = torch.load(io.BytesIO(self.run.fs.cat_file(rng_file)), weights_only=True)
            torch.set_rng_state(rng["torch"])
            random.setstate(_unflatten(rng["python"]))
            self.objective_state = rng.get("objective", {})
        self.healthy_step = int(state["step"])  # an earlier session's: never set aside by this one
        return int(state["step"])

    def _apply_peak_lr(self, schedule, step: int) -> None:
        """The schedule's state holds the peak lr it started with; a resumed run whose train.lr
        differs continues the same warm-up + cosine shape, at this step, with the new peak
        (config.yaml records the value in use, so it must be the one used)."""
        lr, before = self.cfg.train.lr, schedule.peak_lr
        if before == lr:
            return
        schedule.set_peak_lr(lr)
        if self.ranks.is_main:
            log.info("train.lr is %g (the checkpoint's schedule peaked at %g): the schedule continues at step %d "
                     "with peak %g; the next step runs at %.3g", lr, before, step, lr, schedule.get_last_lr()[0])

    def export(self, write_model: Callable[[str, bool], None]) -> None:
        """model/: `write_model(folder, is_writer)` writes it (the model converter's export: a
        plain Hugging Face model, or LoRA's adapter folder), here or staged and uploaded."""
        local = self.run.local_path()
        if local is not None:
            with self.meter.suspended():  # the gathers of the export are not training-step traffic
                write_model(f"{local}/model", self.ranks.is_main)
            pg.barrier()
            return
        import tempfile

        # A remote run folder: export to local staging, upload it, then remove it (left in /tmp,
        # every run on the node would leave a whole model behind)
        with tempfile.TemporaryDirectory(prefix="cputrain-export-") as staging:
            with self.meter.suspended():
                write_model(f"{staging}/model", self.ranks.is_main)
            if self.ranks.is_main:
                self.run.fs.put(f"{staging}/model", self.run.path("model"), recursive=True)
            pg.barrier()


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` comes from a full disk (or quota), also when wrapped: DCP gathers every rank's
    write failures into one CheckpointException, whose `failures` hold the original errors."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # rank → (exception, traceback)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return False


def _bytes_under(fs, path: str) -> int:
    try:
        return int(fs.du(path, total=True)) if fs.exists(path) else 0
    except OSError:
        return 0


def _nearly_full(local: str | None) -> bool:
    """Less than 1 MiB (or 0.5% of the disk) left where the run folder is: a failed write there was
    the disk's fault. Remote run folders are judged by their error only."""
    import shutil

    if local is None:
        return False
    try:
        usage = shutil.disk_usage(local)
    except OSError:
        return False
    return usage.free < max(2**20, usage.total // 200)


def _free_bytes(local: str | None) -> int | None:
    if local is None:
        return None
    import shutil

    try:
        return shutil.disk_usage(local).free
    except OSError:
        return None


def _flatten(state):
    version, internal, gauss = state
    return [version, *internal, -1 if gauss is None else gauss]


def _unflatten(flat):
    version, *rest = flat
    internal, gauss = tuple(int(x) for x in rest[:-1]), rest[-1]
    return (version, internal, None if gauss == -1 else gauss)
