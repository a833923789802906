"""Strategies: how ranks share the model. One small protocol (base.Strategy), one module each.

`get_strategy(name)` imports only the module asked for, so DeepSpeed is never imported unless
strategy zero3 is chosen.
"""

from __future__ import annotations

import importlib

from cputrain.errors import ConfigError

_MODULES = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "zero3": "zero3"}


def needs_process_group(name: str) -> bool:
    """Whether a strategy runs collectives even with one rank (all but single); asked before the
    strategy's module is imported, so DeepSpeed is not loaded ahead of the process group."""
    return name != "single"


def get_strategy(name: str, **kwargs):
    if name not in _MODULES:
        raise ConfigError(f"unknown parallel.strategy '{name}'; choose one of {sorted(_MODULES)}")
    module = importlib.import_module(f"cputrain.parallel.{_MODULES[name]}")
    return module.build(**kwargs)
