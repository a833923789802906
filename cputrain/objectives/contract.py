"""What the rest of cputrain may ask of an objective, and nothing more: the one written contract
every objective (objectives.lm, .preference, .kto, .reward) answers, chosen by name from
train.objective in objectives.objective.

Class-level facts are read without building the objective: preflight and the plans read them
before any model exists (the head the plans shape, the data format preflight checks, the
forwards the plans count). The rest belongs to the built objective, which the trainer calls the
same way for every objective.

The step's loss is the sum over the global batch ÷ the global count of its items (trained
targets for lm, pairs for dpo, simpo and reward, examples for kto), each rank dividing by that
count ÷ world size because strategies average gradients over ranks: the loss is then the mean
over the whole global batch whatever the micro-batch size and number of ranks.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from cputrain.model.score_head import LM_HEAD

# The reference: the converter's context in which the model is its own reference (LoRA: the
# adapters off), None for full weights.
Reference = Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None


class Objective(ABC):
    """One train.objective. Subclasses set the class-level facts and implement the loss."""

    # ---- facts, readable from the class (preflight, the plans, metrics, evaluation) -------------
    name: ClassVar[str]
    """The train.objective value that selects it (the registry's key; summary.json's "objective")."""
    head: ClassVar[str] = LM_HEAD
    """The head the model needs (model.score_head.fit_head; the memory plan's shape): the language
    model's ("lm") or a reward model's one-output score ("score")."""
    data_format: ClassVar[str] = "text"
    """The data.format it trains on; preflight takes it as a hub source's format under
    data.format=auto, which only the rank decides (check_data says what else it takes)."""
    extra_forwards: ClassVar[int] = 0
    """No-grad forwards a step runs beyond its own over the same tokens (KTO: its KL sequences);
    the memory and time plans count them."""
    stores_reference: ClassVar[bool] = False
    """Whether it keeps reference log-probabilities beside the token cache
    (objectives.reference_store; the trainer opens the store, evaluation loads the starting model)."""
    live_reference: ClassVar[bool] = False
    """Whether, with LoRA, it can run the base (adapters off) on each micro-batch instead of reading
    a table (DPO); evaluation of an adapter folder then builds no table."""
    perplexity: ClassVar[bool] = False
    """Whether its loss is a mean per trained target (a perplexity applies): `cputrain eval` reports
    the loss and perplexity rather than the objective's figures on pairs or feedback."""
    items_key: ClassVar[str] = "pairs"
    """What its items are called in `cputrain eval`'s output (pairs, examples)."""
    item_described: ClassVar[str] = "preference pair"
    """One item, as an error names it where the data holds none."""
    names: ClassVar[tuple[str, ...]] = ()
    """The sums `loss` and `summed` return beside the loss, in order (the trainer sums them over
    the global batch and hands them to `figures`); empty: no figures beside the loss."""
    summary_figures: ClassVar[tuple[str, ...]] = ()
    """The figures summary.json carries of a run (the last logged step's, the first and last
    validation's; metrics.run_metrics); empty: none, and no pairs per second."""
    logs_item_rate: ClassVar[bool] = True
    """Where it has figures (`names`), whether a step logs its items per second and per step
    (pairs_per_s, pairs_per_step: pairs, examples); online RL's items are what its loss divides by
    (tokens, completions), no batch's unit."""
    batches_from_rollouts: ClassVar[bool] = False
    """Whether a step's micro-batches are made by the objective from its rows (online RL: prompts
    sampled from the policy, scored by reward functions: step_batches) rather than cut from the
    token cache; the trainer then hands it the run's reward functions (use_rewards) and sets its
    `fused_rollouts` (False where the memory plan leaves the fused decoder's copy out), and the plans
    count the rollout."""

    @classmethod
    @abstractmethod
    def check_data(cls, data_format: str) -> None:
        """Refuse, in one line, data it cannot train on (preflight, and the trainer once each rank's
        format is decided)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse, in one line, a config it cannot train under, read from the config alone (a batch
        counted in pairs, the strategies its head takes): before any work wherever a config is
        decided (preflight for train; choices for plan and k8s); nothing by default."""

    @classmethod
    def check_reference(cls, cfg) -> None:
        """Refuse, in one line, a reference it cannot run under this config (preflight); nothing by
        default."""

    @classmethod
    def rows_per_step(cls, train_cfg) -> int:
        """Rows of the data a step takes (the batch order's global batch): train.global_batch_size
        by default; online RL's prompts, each sampled num_generations times."""
        return train_cfg.global_batch_size

    # ---- the built objective (the trainer, evaluation) -------------------------------------------
    def __init__(self, train_cfg=None, reference: Reference = None, chunked: bool = False):
        """`reference(model)`: the converter's context in which `model` is the reference; `chunked`:
        model.chunked_loss installed the block-wise head (kernels/chunked_loss)."""
        self.cfg, self.reference, self.chunked = train_cfg, reference, chunked

    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        """Before training and before any checkpoint is loaded, over [train rows, validation rows]
        (a reference's log-probabilities, through `store`, a ReferenceStore); nothing by default."""

    def start_step(self, model, micro_batches: list, autocast) -> None:
        """Before a step's micro-batches, over all of them (KTO: its KL estimate); nothing by default."""

    def step_batches(self, model, rows, indices: list, micro_batch: int, autocast) -> list:
        """This rank's micro-batches of the step from its rows (`indices`: one array of row indices
        per micro-batch, the batch order's cut): those rows by default; online RL samples, scores
        and cuts completions."""
        return [rows.batch(i) for i in indices]

    def use_rewards(self, rewards, seed: int) -> None:
        """The run's reward functions, built by the trainer (batches_from_rollouts), and this rank's
        seed of the sampling; nothing by default."""

    def check_rows(self, rows: list, world_size: int) -> None:
        """Refuse, in one line, rows it cannot train on ([train rows, validation rows]), before the
        model is built (online RL: a prompt that leaves no room to sample); nothing by default."""

    def samples(self) -> list[dict]:
        """Records of the last step the run folder keeps (online RL: completions with their rewards,
        completions.jsonl, metrics.completions); none by default."""
        return []

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the objective for an exact resume (online RL: its sampling
        generator's state); nothing by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """The objective's state as a checkpoint kept it (state_dict)."""

    @abstractmethod
    def items(self, batch) -> int:
        """What a batch counts toward the step's divisor: trained targets, pairs or examples."""

    @abstractmethod
    def loss(self, model, batch, divisor: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the micro-batch's summed loss ÷ divisor, the sums of `names` over it, or None)."""

    def figures(self, sums, items: int) -> dict[str, float]:
        """The logged figures from the global sums of `names` over `items` items; none by default."""
        return {}

    @abstractmethod
    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """Validation: ([sum of the losses, sums of `names`…], items) over rows[indices]."""

    def reference_table(self, model, split, micro_batch: int, autocast, indices=None) -> torch.Tensor:
        """Where it stores a reference: the log-probabilities `model` gives the rows of `split`
        (evaluation builds it from the starting model)."""
        raise NotImplementedError(f"train.objective={self.name} keeps no reference")
