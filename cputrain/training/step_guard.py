"""The bad-step guard: a step that could not update the weights (non-finite loss or gradient
norm), or whose update left a weight non-finite, is a bad step; train.max_bad_steps of them in a
row stop the run with exit 3, before any checkpoint or export. A strategy that cannot skip a step
(its optimizer stepped before the norm was known) stops at the first, in its own words.

The counters live here, not in the loop: how many bad steps in a row, the step whose update broke
the weights, the steps skipped in this session (summary.json's skipped_steps), and the newest
step that updated the weights (the last finite loss the error names).
"""

from __future__ import annotations

import logging

from cputrain.config import TrainConfig
from cputrain.errors import Diverged
from cputrain.parallel.base import Strategy
from cputrain.run_folder.checkpoints import Checkpoints
from cputrain.run_folder.layout import RunFolder
from cputrain.training.step_outcome import StepOutcome

log = logging.getLogger("cputrain")


class StepGuard:
    def __init__(self, train: TrainConfig, strategy: Strategy, checkpoints: Checkpoints, run: RunFolder,
                 is_main: bool):
        self.train, self.checkpoints, self.run, self.is_main = train, checkpoints, run, is_main
        self.can_skip_step, self.cannot_skip_words = strategy.can_skip_step, strategy.cannot_skip_words
        self.bad_steps_in_row = 0  # steps skipped for a non-finite loss or gradient norm (or that broke a weight), in a row
        self.broke_weights_at: int | None = None  # the step whose update left non-finite weights
        self.skipped_steps = 0  # all such steps of this session
        self.last_finite = (None, None)  # (step, loss) of the newest step that updated the weights

    def judge(self, step: int, outcome: StepOutcome) -> None:
        """After step `step`'s row is written (the step that stops the run is on record). A healthy
        step confirms the checkpoints saved before it (rotation may then remove older ones)."""
        if outcome.stepped and outcome.weights_finite:
            self.bad_steps_in_row = 0
            self.broke_weights_at = None
            self.last_finite = (step, outcome.loss)
            self.checkpoints.confirm()
            return
        self.bad_steps_in_row += 1
        limit = self.train.max_bad_steps if self.can_skip_step else 1
        if outcome.stepped:  # applied: the weights cannot be had back, and every later loss is nan
            self.broke_weights_at = step
            what = (f"loss {outcome.loss:.4f} and gradient norm {outcome.grad_norm:.4g} were finite but the update "
                    "left non-finite weights")
        else:
            self.skipped_steps += 1
            what = (f"loss {outcome.loss}, gradient norm {outcome.grad_norm}: not finite, "
                    + ("optimizer step skipped" if self.can_skip_step else self.cannot_skip_words))
        if self.is_main:
            log.warning("step %d: %s (%d in a row, the run stops at %d; no checkpoint is written until a healthy step)",
                        step, what, self.bad_steps_in_row, limit)
        if self.bad_steps_in_row < limit:
            return
        self.diverged(f"the loss or gradient norm was not finite for {self.bad_steps_in_row} step(s) in a row, up "
                      f"to step {step}")

    def diverged(self, what: str) -> None:
        """Stop with exit 3: the saves no healthy step followed are set aside as step-N.diverged,
        so the re-run resumes from the newest healthy checkpoint."""
        step, loss = self.last_finite
        moved = self.checkpoints.set_aside_diverged()
        newest = self.run.newest_complete()
        if self.broke_weights_at is not None:
            updated = f"the update of step {self.broke_weights_at} left non-finite weights, and "
        else:
            updated = "no weight was updated by them, and " if self.can_skip_step else ""
        aside = f"; set aside, never loaded: {', '.join(m.rsplit('/', 1)[-1] for m in moved)}" if moved else ""
        raise Diverged(
            f"training diverged: {what} (last finite loss: "
            + (f"{loss:.4f} at step {step}" if step is not None else "none in this session")
            + f"); {updated}nothing was saved from them "
            f"({'newest checkpoint: ' + self.run.step_path(newest) if newest is not None else 'no checkpoint'}{aside}). "
            f"Try a lower train.lr (now {self.train.lr:g}), more train.warmup_steps (now "
            f"{self.train.warmup_steps}) or train.grad_clip > 0, then re-run to resume"
        )
