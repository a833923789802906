"""data.format where the user left it at its default: an objective that trains on other data than
text (its class's data_format: DPO, SimPO and reward models on pairs, KTO on feedback) has the
records decide it, as data.format=auto does, so `train.objective=kto` over thumbs-up/down records
needs no second word. Read on the config as loaded (train, prepare, eval): only there is it known
which keys the user set."""

from __future__ import annotations

import logging

from cputrain.config import Config, DataConfig

log = logging.getLogger("cputrain")

DEFAULT_FORMAT = DataConfig.model_fields["format"].default


def objective_sets_format(cfg: Config) -> Config:
    """`cfg` with data.format=auto where it was left at its default and the objective trains on
    another format than that default; else `cfg` itself."""
    from cputrain.objectives.objective import objective_class

    if "format" in cfg.data.model_fields_set:
        return cfg
    trains_on = objective_class(cfg.train.objective).data_format
    if trains_on == DEFAULT_FORMAT:
        return cfg
    log.info("auto: data.format = auto (left at its default, %s, but train.objective=%s trains on %s: the records "
             "decide, as under data.format=auto)", DEFAULT_FORMAT, cfg.train.objective, trains_on)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"format": "auto"})})
