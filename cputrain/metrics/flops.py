"""Model FLOPs per token and MFU (model FLOPs utilisation).

FLOPs per trained token = 6·N + 12·L·d·T  (PaLM, appendix B)
  N  non-embedding parameters (every weight that takes part in a matmul; the lm_head counts,
     tied or not, the input embedding lookup does not)
  6  = 2 (multiply + add) × 3 (forward, and backward for inputs and for weights)
  12·L·d·T  attention scores and weighted values: L layers, width d, sequence length T
MFU = achieved model FLOP/s ÷ peak FLOP/s of the cores this run uses. Recomputation under
activation checkpointing is not counted: MFU measures useful work.
"""

from __future__ import annotations


def flops_per_token(non_embedding_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    return 6 * non_embedding_params + 12 * n_layers * hidden * seq_len


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_tok / peak_flops if peak_flops > 0 else 0.0
