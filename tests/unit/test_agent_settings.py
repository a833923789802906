"""The torchrun agent hands its resolved "auto" values to the ranks; a rank that resolves otherwise stops."""

from __future__ import annotations

import json

import pytest

from cputrain.config.file import load_config
from cputrain.errors import ConfigError
from cputrain.config.resolve import AGENT_SETTINGS_VAR, check_agent_agrees, settings_of


def _resolved(**values):
    return load_config(None, [f"{k}={v}" for k, v in values.items()])


def test_a_rank_that_agrees_with_its_agent_runs():
    cfg = _resolved(**{"hardware.threads": 2, "hardware.precision": "fp32", "parallel.strategy": "ddp",
                       "parallel.backend": "gloo", "data.num_proc": 2})
    check_agent_agrees(cfg, {AGENT_SETTINGS_VAR: json.dumps(settings_of(cfg))})
    check_agent_agrees(cfg, {})  # not started by cputrain's agent: nothing to compare


def test_a_rank_that_resolves_otherwise_names_the_key():
    agent = _resolved(**{"hardware.threads": 2})
    rank = _resolved(**{"hardware.threads": 1})
    with pytest.raises(ConfigError, match=r"hardware.threads resolved to 1 in this rank but to 2 in the agent"):
        check_agent_agrees(rank, {AGENT_SETTINGS_VAR: json.dumps(settings_of(agent))})
