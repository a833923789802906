"""One process, the whole model: the baseline every other strategy must agree with."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from cputrain.model import load_into, materialize, random_init, safetensors_files
from cputrain.parallel.base import Strategy, StrategyContext
from cputrain.parallel.file_reads import PlainReads


class SingleStrategy(Strategy):
    name = "single"

    def load_weights(self, model: nn.Module, folder: Path | None) -> None:
        materialize(model)
        if folder is None:
            random_init(model, self.ctx.cfg.seed)
        else:
            with PlainReads(safetensors_files(folder)) as files:  # no mapped second copy (file_reads)
                load_into(model, folder, copy_fn=files.copy_whole, file_name_of=self.ctx.file_name_of)


def build(ctx: StrategyContext) -> Strategy:
    return SingleStrategy(ctx)
