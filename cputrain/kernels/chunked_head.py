"""The block-wise head installed on a model (model.chunked_loss): its forward computes the
language-model loss (kernels/chunked_loss.py) or, asked for token_logps, each label's
log-probability (kernels/chunked_logps.py, for preference objectives), or given the positions
that predict each completion token, theirs at the sampling temperature (online RL), a block of
tokens at a time; without labels it is the model's own forward (generation, evaluation of logits)."""

from __future__ import annotations

from torch import nn

from cputrain.kernels.chunked_logps import PickedPositions, TokenLogpsOutput, chunked_token_logps, picked_logps
from cputrain.kernels.chunked_loss import chunked_causal_lm_loss


def install_chunked_loss(model: nn.Module) -> None:
    """Make `model(input_ids=..., labels=...)` compute its loss block by block.

    The replacement forward runs the decoder, then the chunked head + loss; with token_logps=True
    the chunked head + each label's log-probability (kernels/chunked_logps.py, for preference
    objectives); with picked=PickedPositions, the log-probability of each target from the position
    given for it (online RL's completion tokens at the sampling temperature); without labels
    (generation, logits wanted) it is the model's own forward. Installed on the instance, so the
    hooks of DDP, FSDP2 and DeepSpeed on the model still run around it. The head's weight is read
    at call time: under FSDP2 it is then the gathered (unsharded) parameter; under ZeRO-3
    the strategy has the model gather it (cputrain.parallel.zero3, model.chunked_loss), since the
    head's module itself is never called.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward
    head = model.get_output_embeddings()
    decoder = model.get_decoder()

    def forward(input_ids=None, labels=None, num_items_in_batch=None, token_logps=False,
                picked: PickedPositions | None = None, **kwargs):
        if token_logps:  # preference objectives: each label's log-probability, block by block
            hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
            return TokenLogpsOutput(token_logps=chunked_token_logps(hidden, head.weight, labels))
        if picked is not None:  # online RL: each completion token's, from the position that predicts it
            hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
            return TokenLogpsOutput(token_logps=picked_logps(hidden, head.weight, picked))
        if labels is None or kwargs.get("return_dict") is False:
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return original(input_ids=input_ids, labels=labels, **kwargs)
        hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=chunked_causal_lm_loss(hidden, head.weight, labels, num_items_in_batch))

    model.forward = forward
