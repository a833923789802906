"""Model FLOPs per token and MFU (model FLOPs utilisation).

FLOPs per trained token = 6·N + 12·L·d·T  (PaLM, appendix B)
  N  non-embedding parameters (every weight that takes part in a matmul; the lm_head counts,
     tied or not, the input embedding lookup does not)
  6  = 2 (multiply + add) × 3 (forward, and backward for inputs and for weights)
  12·L·d·T  attention scores and weighted values: L layers, width d, sequence length T
With LoRA only the adapters' weight gradients are computed, so a token costs
  2·N (forward) + 2·N (backward to the activations, which still runs through every frozen
  layer) + 2·N_trained (weight gradients of the trained parameters) + 12·L·d·T,
which is 6·N + 12·L·d·T again when every parameter is trained.
MFU = achieved model FLOP/s ÷ peak FLOP/s of the cores this run uses. Recomputation under
activation checkpointing is not counted: MFU measures useful work.
"""

from __future__ import annotations


def flops_per_token(non_embedding_params: int, n_layers: int, hidden: int, seq_len: int,
                    trained_params: int | None = None) -> float:
    """`trained_params`: non-embedding parameters that get weight gradients (None: all of them)."""
    trained = non_embedding_params if trained_params is None else trained_params
    return 4 * non_embedding_params + 2 * trained + 12 * n_layers * hidden * seq_len


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_tok / peak_flops if peak_flops > 0 else 0.0
