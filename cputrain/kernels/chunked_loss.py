"""The language-model head and its cross-entropy, a block of tokens at a time.

The plain path computes logits for every token over the whole vocabulary, upcasts them to
fp32, keeps them and their log-softmax for the backward: for Llama-3 (128,256 tokens) and
2,048 tokens that is 1 GiB per copy, several copies at once. Here the head's matmul, the
softmax, the loss and the gradient of the hidden states are done for one block of tokens at a
time, inside the forward; the gradient of the logits is kept in the compute dtype (bf16: half of
one fp32 copy) for one weight-gradient matmul over all tokens. The FLOPs are the same three
matmuls; the fp32 logits of the whole vocabulary never exist at once.

The loss is Hugging Face's causal-LM loss: labels shifted by one, -100 ignored, mean over the
remaining tokens. tests/unit/test_kernels.py compares loss and gradients with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


IGNORE_INDEX = -100
# fp32 logits of one block stay within this many bytes (256 MiB): 8,192 rows at an 8,192 vocabulary,
# 523 at 128,256; never fewer rows than MIN_ROWS. Blocks of 130 rows made the head's matmuls 1.5×
# slower on AMX (Llama-3-8B head, 2,048 tokens: 6.9 s of matmuls vs 5.0 s at 523 rows).
BLOCK_BYTES = 256 * 2**20
MIN_ROWS = 512


def block_rows(vocab_size: int) -> int:
    return max(MIN_ROWS, BLOCK_BYTES // (4 * vocab_size))


@dataclass
class HeadBlock:
    """One block of tokens through the head: what the cross-entropy and the per-token
    log-probabilities (kernels/chunked_logps.py) both read."""

    rows: slice  # the block's tokens
    logits: torch.Tensor  # fp32, what the plain head gives after its upcast
    lse: torch.Tensor  # logsumexp of each token's logits
    picked: torch.Tensor  # each token's label's logit
    target: torch.Tensor  # the labels, -100 as 0
    valid: torch.Tensor  # the label is not -100

    def nll_grad(self, scale: torch.Tensor | float) -> torch.Tensor:
        """d(-log p(label))/d(logits) × scale on valid tokens, 0 elsewhere: (softmax - one_hot) ×
        scale, made in place of the logits (read nothing of them after this)."""
        grad = self.logits.sub_(self.lse[:, None]).exp_()
        grad[torch.arange(len(self.target)), self.target] -= 1.0
        return grad.mul_((self.valid.float() * scale)[:, None])


def head_blocks(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int,
                scale: float = 1.0) -> Iterator[HeadBlock]:
    """hidden [tokens, d] through the head weight [vocab, d], `rows` tokens at a time; labels [tokens].
    `scale`: each fp32 logit multiplied by it (online RL's 1 / sampling temperature)."""
    for start in range(0, hidden.shape[0], rows):
        block = slice(start, start + rows)
        y = labels[block]
        target = y.clamp(min=0)
        logits = (hidden[block] @ weight.t()).float()
        if scale != 1.0:
            logits.mul_(scale)
        yield HeadBlock(block, logits, torch.logsumexp(logits, dim=-1), logits.gather(1, target[:, None]).squeeze(1),
                        target, y != IGNORE_INDEX)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int,
                divisor: float | None):
        # the mean over this batch's targets, or the sum over them ÷ `divisor` (a count of targets
        # across more than this batch: a step's micro-batches and ranks)
        scale = 1.0 / (divisor if divisor is not None else max(int((labels != IGNORE_INDEX).sum()), 1))
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        # d(loss)/d(logits) of every token, in the compute dtype (bf16: half of one fp32 logits
        # copy): the head's weight gradient is then one matmul over all tokens. Summing it block
        # by block instead would pass over the whole (vocab × d) gradient once per block.
        # Kept transposed (vocab × tokens), so that product runs on contiguous operands and its
        # result is already laid out like the weight.
        grad_logits_t = torch.empty(weight.shape[0], hidden.shape[0], dtype=hidden.dtype) if ctx.needs_input_grad[1] else None
        loss_sum = torch.zeros((), dtype=torch.float32)
        for block in head_blocks(hidden, weight, labels, rows):
            loss_sum += ((block.lse - block.picked) * block.valid).sum()
            if not needs_grad:
                continue
            # (softmax - one_hot(label)) / n_valid on valid rows, 0 elsewhere
            g = block.nll_grad(scale).to(hidden.dtype)
            grad_hidden[block.rows] = g @ weight
            if grad_logits_t is not None:
                grad_logits_t[:, block.rows] = g.t()
        grad_weight = grad_logits_t @ hidden if grad_logits_t is not None else None
        del grad_logits_t
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum * scale

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)
        return (grad_hidden * scale if ctx.needs_input_grad[0] else None,
                grad_weight * scale.to(grad_weight.dtype) if grad_weight is not None else None, None, None, None)


def chunked_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           num_items_in_batch: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy of `hidden` (batch, seq, d) through the head `weight` (vocab, d):
    the mean over the targets, or with `num_items_in_batch` their sum ÷ it (transformers' rule)."""
    # The compute dtype: autocast's, else the hidden states' (a LoRA base stored in bf16 under
    # fp32 compute has a bf16 head weight, converted to fp32 here once for all blocks).
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype
    shifted = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # token t predicts t+1
    with torch.autocast("cpu", enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype), shifted.reshape(-1),
            block_rows(weight.shape[0]), None if num_items_in_batch is None else float(num_items_in_batch),
        )
