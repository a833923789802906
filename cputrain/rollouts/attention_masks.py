"""The attention masks of a left-padded rollout, built once: a decode step passes a view (rows × 1 ×
1 × positions so far) instead of a 2D mask that the model would turn into a 4D one every step."""

from __future__ import annotations

import torch


class RolloutMasks:
    """What each row may attend to, in the form the model's attention implementation takes:
    - "rollout" (decode_attention.py's): bool for the prefill (it goes to sdpa), additive for a step;
    - "sdpa": bool (True: attend); "eager": additive (0, or the dtype's minimum);
    - any other: the plain 2D padding mask, which the model expands itself."""

    def __init__(self, padding: torch.Tensor, capacity: int, kind: str | None, dtype: torch.dtype):
        rows, width = padding.shape
        self.width = width
        self.kind = kind if kind in ("rollout", "sdpa", "eager") else "2d"
        self.dtype = dtype
        valid = torch.ones((rows, capacity), dtype=torch.bool)
        valid[:, :width] = padding.bool()
        self.valid = valid  # every new position is a real token
        self._decode: torch.Tensor | None = None  # built by start_decoding(): 2D, or rows × 1 × 1 × capacity

    def _form(self, allowed: torch.Tensor, step: bool = False) -> torch.Tensor:
        if self.kind == "eager" or (self.kind == "rollout" and step):
            return torch.zeros(allowed.shape, dtype=self.dtype).masked_fill(~allowed, torch.finfo(self.dtype).min)
        return allowed

    def prefill(self) -> torch.Tensor:
        """Causal within the prompt, pads masked; a pad position attends to itself, so that no row of
        the softmax is empty (its output is never read)."""
        if self.kind == "2d":
            return self.valid[:, :self.width].long()
        causal = torch.ones((self.width, self.width), dtype=torch.bool).tril()
        allowed = causal[None] & self.valid[:, None, :self.width]
        allowed |= torch.eye(self.width, dtype=torch.bool)[None]
        return self._form(allowed[:, None])

    def decode(self, positions: int) -> torch.Tensor:
        """The mask of a one-token step that attends to `positions` positions (the new one included)."""
        return self._decode[..., :positions]

    def start_decoding(self) -> None:
        """Builds the decode masks once (after the prefill, before the first step)."""
        self._decode = self.valid.long() if self.kind == "2d" else self._form(self.valid, step=True)[:, None, None, :]

    def select_rows(self, indices: torch.Tensor) -> None:
        """Only the rows `indices` stay (finished ones dropped), in their order (repeats allowed)."""
        self.valid = self.valid.index_select(0, indices)
        if self._decode is not None:  # a fused rollout never builds them
            self._decode = self._decode.index_select(0, indices)
