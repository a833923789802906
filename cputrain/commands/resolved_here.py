"""The config `prepare` and `eval` read: resolved for one process on this machine, with what the
data is. Here, above cputrain.training.choices, which decides the data's keys."""

from __future__ import annotations

import logging

log = logging.getLogger("cputrain")


def resolved_here(config_path, overrides):
    """A config with its "auto" values resolved for one process on this machine, and what the data
    is (data.format, data.train_on: what prepare and eval need), each decision logged."""
    from cputrain.config.file import load_config
    from cputrain.hardware import detect
    from cputrain.config.resolve import resolve
    from cputrain.training.choices import decide_data
    from cputrain.training.objective_data_keys import objective_sets_data_keys

    res = resolve(objective_sets_data_keys(load_config(config_path, overrides)), detect(), world_size=1,
                  local_world_size=1)
    decided = decide_data(res)
    for key, value, why in decided.reasons[len(res.reasons):]:
        log.info("auto: %s = %s (%s)", key, value, why)
    return decided.config
