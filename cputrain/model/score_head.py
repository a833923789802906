"""A reward model's head: the body of a causal LM with one linear score on top (transformers'
<Model>ForSequenceClassification with num_labels=1), what train.objective=reward trains.

The model's config says which it is: `fit_head` makes a causal LM's config a sequence
classifier's (architectures, num_labels=1, the pad token transformers' pooling skips), and the
skeleton is built from it as that class (model.skeleton). A model folder that is a causal LM has
no `score.weight`: the head is then new, drawn as transformers initialises it (normal, std
initializer_range) from the run's seed, the same on every rank, and copied into what each rank holds
once the strategy has materialised the model (`NewScoreHead.fill`, called by the converter).
A folder that already is a reward model loads its head from its files.

transformers' forward scores only the last token that is not padding of each row; a run lays
several sequences out in a row (pairs, packed), so the objective asks for every token's score
(`install_token_scores`) and picks each sequence's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cputrain.errors import ModelError

SCORE = "score"  # the head's module name in every transformers sequence classifier
LM_HEAD = "lm"  # a causal language model's own head: the vocabulary's logits


def is_score_config(hf_config) -> bool:
    """Whether `hf_config` is a sequence classifier's (a reward model's)."""
    return any(str(name).endswith("ForSequenceClassification") for name in getattr(hf_config, "architectures", None) or [])


def fit_head(hf_config, head: str, pad_token_id: int | None) -> None:
    """`hf_config`, in place, as the head an objective trains needs it: "score" makes it a
    sequence classifier with one output whose pooling skips `pad_token_id` (TRL's RewardTrainer
    sets both); any other (LM_HEAD, the language model's) refuses a reward model's config, which has
    no language-model head."""
    if head != SCORE:
        if is_score_config(hf_config):
            raise ModelError(f"the model is a sequence classifier ({hf_config.architectures[0]}: a reward model), "
                             "which has no language-model head; train it with train.objective=reward, or start from "
                             "a causal language model")
        return
    if not is_score_config(hf_config):
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

        name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(hf_config.model_type)
        if name is None:
            raise ModelError(f"transformers has no sequence classifier for model type '{hf_config.model_type}': "
                             "train.objective=reward needs one")
        hf_config.architectures = [name]
    hf_config.num_labels = 1  # the only output is the reward
    hf_config.pad_token_id = pad_token_id
    hf_config.tie_word_embeddings = False  # no output embedding to tie (the counts would see a vocabulary head)


def score_in_files(folder: Path | None) -> bool:
    """Whether the model folder's safetensors files hold the head (a reward model's folder)."""
    if folder is None:
        return False
    from cputrain.model.weights import SafetensorsReader, checkpoint_name

    return checkpoint_name(f"{SCORE}.weight", SafetensorsReader(folder)) is not None


@dataclass
class NewScoreHead:
    """A head the model's files do not hold: its parameter's name and initial value."""

    name: str
    initial: torch.Tensor

    def fill(self, model: nn.Module) -> None:
        """Copy the initial value into what this rank holds of the materialised (possibly sharded) head."""
        from cputrain.model.weights import copy_full_into

        # a plain tensor or an FSDP2 DTensor: ZeRO-3, whose partitioned parameter would need a
        # gather, does not train a reward model (config.sections refuses it)
        param = dict(model.named_parameters())[self.name]
        with torch.no_grad():
            copy_full_into(param, self.initial)


def new_score_head(skeleton: nn.Module, folder: Path | None, seed: int) -> NewScoreHead | None:
    """The head of a reward model built on a causal LM's folder, drawn as transformers draws it
    (normal, std initializer_range) from `seed`, without touching the global generator; None where
    there is nothing to draw: no head, a head in the files, or no files (random weights draw all)."""
    head = getattr(skeleton, SCORE, None)
    if not isinstance(head, nn.Linear) or folder is None or score_in_files(folder):
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        initial = torch.empty(head.weight.shape, dtype=torch.float32).normal_(
            0.0, getattr(skeleton.config, "initializer_range", 0.02))
    return NewScoreHead(f"{SCORE}.weight", initial)


@dataclass
class TokenScores:
    scores: torch.Tensor  # [rows, tokens]: the head's output at every token


def install_token_scores(model: nn.Module) -> None:
    """Make `model(input_ids=..., ...)` return every token's score (TokenScores), not transformers'
    pooled one. Installed on the instance, so the hooks of DDP, FSDP2 and DeepSpeed on the model
    still run around it; the head is called as a module, so ZeRO-3 gathers its weight."""
    if getattr(model, "_token_scores", False):
        return
    body, head = getattr(model, model.base_model_prefix), getattr(model, SCORE)

    def forward(input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        kwargs.pop("labels", None)
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      **kwargs).last_hidden_state
        return TokenScores(head(hidden).squeeze(-1))

    model.forward = forward
    model._token_scores = True
