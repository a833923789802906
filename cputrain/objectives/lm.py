"""The language-model objective (train.objective=lm): the next-token loss on trained targets, what
every run trained before preference objectives; the model's own loss, no figures beside it."""

from __future__ import annotations

import numpy as np
import torch

from cputrain.errors import ConfigError
from cputrain.objectives.contract import Objective


class LmObjective(Objective):
    name = "lm"
    perplexity = True
    items_key = "trained_targets"
    item_described = "sequence"

    @classmethod
    def check_data(cls, data_format: str) -> None:
        """Every record format but pairs and feedback, which hold no text to continue."""
        if data_format == "preference":
            raise ConfigError("data.format=preference holds pairs, which the language-model loss (train.objective=lm) "
                              "does not read; set train.objective=dpo or simpo (or reward, to train a reward model)")
        if data_format == "feedback":
            raise ConfigError("data.format=feedback holds answers with a thumbs-up or down, which the language-model "
                              "loss (train.objective=lm) does not read; set train.objective=kto")
        if data_format == "prompt":
            raise ConfigError("data.format=prompt holds prompts without answers, which the language-model loss "
                              "(train.objective=lm) does not read; set train.objective=grpo or rloo (and train.rewards)")

    @classmethod
    def check_config(cls, cfg) -> None:
        """A batch counted in pairs, where there are none."""
        if cfg.train.global_batch_pairs is not None:
            raise ConfigError("train.global_batch_pairs counts preference pairs (train.objective dpo or simpo); "
                              "train.objective=lm trains no pairs: set the batch with train.global_batch_size")

    def items(self, batch) -> int:
        return batch.trained_targets

    def loss(self, model, batch, divisor: float) -> tuple[torch.Tensor, None]:
        return model(**batch.model_inputs(model), num_items_in_batch=divisor).loss, None

    @torch.no_grad()
    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """([sum of the losses], trained targets) over rows[indices]."""
        from cputrain.objectives.validation_loss import summed_loss

        total, targets = summed_loss(model, rows, indices, micro_batch, autocast)
        return np.array([total]), targets
