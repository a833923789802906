"""Each sequence's summed log-probability under a model, for every objective that reads them
(DPO and SimPO on pairs, KTO on labelled answers): from the block-wise head a block of tokens at a
time where model.chunked_loss installed it, else from the whole logits."""

from __future__ import annotations

import torch

from cputrain.objectives.preference_loss import sequence_logps, sums_by_sequence


def summed_logps(model, batch, chunked: bool, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's trained tokens, their number) for the `sequences`
    sequences of `batch` (its sequence_ids say which token belongs to which)."""
    inputs = batch.model_inputs(model)  # a shared prompt's 4D mask typed for the model's attention kernel
    if chunked:  # labels stay: the head reads each one's log-probability, block by block
        token_logps = model(**inputs, token_logps=True).token_logps
        return sums_by_sequence(token_logps, batch.labels, batch.sequence_ids, sequences)
    del inputs["labels"]  # the logits are wanted, not the language-model loss
    return sequence_logps(model(**inputs).logits, batch.labels, batch.sequence_ids, sequences)
