"""One process, the whole model: the baseline every other strategy must agree with."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from cputrain.model import load_into, materialize, random_init
from cputrain.parallel.base import Strategy, StrategyContext


class SingleStrategy(Strategy):
    name = "single"

    def load_weights(self, model: nn.Module, folder: Path | None) -> None:
        materialize(model)
        if folder is None:
            random_init(model, self.ctx.cfg.seed)
        else:
            load_into(model, folder, file_name_of=self.ctx.file_name_of)


def build(ctx: StrategyContext) -> Strategy:
    return SingleStrategy(ctx)
