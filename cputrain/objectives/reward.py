"""The reward model (train.objective=reward): a score head on the model's body
(model.score_head), trained with TRL's RewardTrainer loss (objectives.reward_loss) on preference
pairs. No reference, nothing before training but asking the model for every token's score.

A sequence's reward is the score at its last token that is not the pad token: transformers'
pooling of a sequence classifier (and so TRL's, and the exported model's in transformers), here
found per sequence, since a row holds several (a pair, packed pairs, the shared-prompt layout whose
rejected answer attends to its pair's prompt through the batch's mask). That token is the one
that ends the answer (EOS, or a chat turn's end and what the template writes after it); where the
pad token is EOS (a tokenizer without one of its own), the token before a closing EOS, as in
transformers.
"""

from __future__ import annotations

import numpy as np
import torch

from cputrain.errors import ConfigError
from cputrain.model.score_head import SCORE, install_token_scores
from cputrain.objectives.item_losses import ItemLossObjective
from cputrain.objectives.preference import refuse_unless_pairs
from cputrain.objectives.reward_loss import STAT_NAMES, bradley_terry_losses


def sequence_scores(scores: torch.Tensor, input_ids: torch.Tensor, sequence_ids: torch.Tensor, sequences: int,
                    pad_id: int) -> torch.Tensor:
    """Each sequence's score: `scores` [rows, tokens] at the sequence's last token whose id is not
    `pad_id` (sequence_ids: each token's sequence, -1 padding)."""
    owner, ids = sequence_ids.reshape(-1), input_ids.reshape(-1)
    at = torch.arange(owner.numel())
    kept = (owner >= 0) & (ids != pad_id)
    last = torch.full((sequences,), -1, dtype=torch.long).scatter_reduce(0, owner[kept], at[kept], "amax")
    return scores.reshape(-1)[last]


def pair_scores(model, batch, pad_id: int) -> torch.Tensor:
    """The reward of each sequence of the pairs of `batch`: 2k pair k's chosen, 2k+1 its rejected."""
    scores = model(**batch.model_inputs(model)).scores
    return sequence_scores(scores.float(), batch.input_ids, batch.sequence_ids, 2 * batch.pairs, pad_id)


class RewardObjective(ItemLossObjective):
    name = "reward"
    head = SCORE
    data_format = "preference"
    names = summary_figures = STAT_NAMES

    def __init__(self, train_cfg=None, reference=None, chunked: bool = False):
        super().__init__(train_cfg, reference, chunked)  # no reference; no vocabulary head to chunk
        self.pad_id = None  # the rows' (prepare)

    @classmethod
    def check_data(cls, data_format: str) -> None:
        refuse_unless_pairs(cls.name, data_format)

    @classmethod
    def check_config(cls, cfg) -> None:
        """The score head: not cut into blocks, and not yet under the strategies that build the model
        themselves."""
        if cfg.model.chunked_loss is True:
            raise ConfigError("model.chunked_loss=true cuts a vocabulary head's logits into blocks, and "
                              "train.objective=reward trains a score head of one output; set model.chunked_loss=auto "
                              "or false")
        # These two build their own copy of the model as a causal LM (ZeRO-3 inside zero.Init,
        # FSDP's random init of a model from scratch): not yet a sequence classifier.
        if cfg.parallel.strategy == "zero3":
            raise ConfigError("parallel.strategy=zero3 does not train a reward model yet (train.objective=reward); use "
                              "single, ddp or fsdp, which shard or replicate the same model")
        if cfg.parallel.strategy == "fsdp" and cfg.model.name_or_path is None:
            raise ConfigError("a reward model from random weights does not take parallel.strategy=fsdp yet; start "
                              "from a model folder (model.name_or_path), or use single or ddp")

    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        """Every token's score from the model (model.score_head.install_token_scores); the rows' pad token."""
        install_token_scores(getattr(model, "module", model))  # inside DDP's and ZeRO-3's wrappers
        self.pad_id = rows[0].pad_id

    def items(self, batch) -> int:
        return batch.pairs

    def losses(self, model, batch):
        rewards = pair_scores(model, batch, self.pad_id)
        return bradley_terry_losses(rewards[0::2], rewards[1::2], batch.margins, self.cfg.center_rewards_coefficient)

    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """([sum of the losses, sums of TRL's figures…], pairs) over rows[indices]."""
        if self.pad_id is None:  # a finished model, scored outside a run
            if hasattr(model, "get_base_model"):  # a LoRA reward model loaded by peft: the classifier under it
                model = model.get_base_model()
            self.prepare(model, [rows], micro_batch, autocast)
        return super().summed(model, rows, indices, micro_batch, autocast)
