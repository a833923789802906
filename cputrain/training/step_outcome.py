"""What one optimizer step reports to the loop: its figures, and whether the weights moved."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepOutcome:
    loss: float  # this rank's loss (sum over its micro-batches of each one's share of the global mean)
    grad_norm: float  # global, before clipping
    trained: int  # trained targets in the global batch
    tokens: int  # tokens processed in the global batch
    stepped: bool  # False: a non-finite loss or gradient norm on some rank; the weights were left alone
    stop_signal: str | None  # a stop was asked for (on any rank): finish here with a checkpoint
    save_due: bool  # train.checkpoint_every_s has passed on rank 0's clock
    weights_finite: bool = True  # False: the update left a trained weight at inf or nan (on some rank)
    figures: dict | None = None  # the objective's figures of the global batch (preference: TRL's rewards/…)
    pairs: int | None = None  # preference pairs in the global batch (None: the objective counts none)
