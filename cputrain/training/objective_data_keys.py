"""The data keys an objective decides where the user left them unset, and those it cannot read,
read on the config as loaded (train, prepare, eval): only there is it known which keys the user set.

- data.format left at its default (text) under an objective that trains on another format (its
  class's data_format: DPO, SimPO and reward models on pairs, KTO on feedback): the records decide
  it, as data.format=auto does, so `train.objective=kto` over thumbs-up/down records needs no
  second word.
- data.margin_field is read by the loss of a reward model (the objective whose head is a score):
  unset there, a local file's `margin` column is taken, by TRL's name for it; set under any other
  objective it would do nothing, and is refused.
"""

from __future__ import annotations

import logging

from cputrain.config import Config, DataConfig
from cputrain.errors import ConfigError, DataError
from cputrain.model.score_head import SCORE

log = logging.getLogger("cputrain")

DEFAULT_FORMAT = DataConfig.model_fields["format"].default
TRL_MARGIN = "margin"  # TRL's RewardTrainer reads a column of this name


def objective_sets_data_keys(cfg: Config) -> Config:
    """`cfg` with the data keys its objective decides; a key that cannot act is refused."""
    from cputrain.objectives.objective import objective_class

    objective = objective_class(cfg.train.objective)
    data = cfg.data
    if "format" not in data.model_fields_set and objective.data_format != DEFAULT_FORMAT:
        log.info("auto: data.format = auto (left at its default, %s, but train.objective=%s trains on %s: the records "
                 "decide, as under data.format=auto)", DEFAULT_FORMAT, cfg.train.objective, objective.data_format)
        data = data.model_copy(update={"format": "auto"})
    if objective.head != SCORE:
        if data.margin_field is not None:
            raise ConfigError(f"data.margin_field={data.margin_field} is read by a reward model's loss only "
                              f"(train.objective=reward; here {cfg.train.objective}), where it would do nothing; "
                              "leave data.margin_field empty")
    elif "margin_field" not in data.model_fields_set and TRL_MARGIN in _local_fields(data):
        resumed = _resumed_without_margin(cfg)
        if resumed:
            log.info("data.margin_field left empty: %s", resumed)
        else:
            log.info("auto: data.margin_field = %s (the records have TRL's '%s' column, which a reward model "
                     "subtracts in its loss; data.margin_field=null leaves it out)", TRL_MARGIN, TRL_MARGIN)
            data = data.model_copy(update={"margin_field": TRL_MARGIN})
    return cfg if data is cfg.data else cfg.model_copy(update={"data": data})


def _local_fields(data: DataConfig) -> list[str]:
    """The first record's fields of a local or built-in source; none for a hub dataset (not opened
    before the ranks: name its margin column with data.margin_field) or one that cannot be read (the
    data's own checks say why, later)."""
    from cputrain.data.sources import HF_PREFIX, first_record_fields

    if data.source.startswith(HF_PREFIX):
        return []
    try:
        return first_record_fields(data)
    except (DataError, OSError):
        return []


def _resumed_without_margin(cfg: Config) -> str:
    """Why a run folder's checkpoints keep the margin out ("" where none do): a reward run started
    before the margin column was taken by its name trained without it, and resumes so."""
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import read_recorded

    try:
        recorded = read_recorded(RunFolder(cfg.output_dir))
    except Exception:  # an output_dir that cannot be read is refused by preflight, with its reason
        return ""
    if not recorded.has_checkpoints or recorded.values is None or recorded.value("data.margin_field") is not None:
        return ""
    return f"the checkpoints in '{cfg.output_dir}' trained without a margin (config.yaml), and the run resumes so"
