"""Every shipped config in configs/ loads, validates and resolves on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from cputrain.config import Config, load_config, read_yaml
from cputrain.hardware import detect
from cputrain.resolve import resolve

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_example_configs():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # Every key written in the file survives validation (none silently dropped).
    raw = read_yaml(path)
    dumped = cfg.model_dump(mode="json")
    for section, values in raw.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert dumped[section][key] == value, f"{path.name}: {section}.{key}"
        else:
            assert dumped[section] == values
    world = cfg.launch.nproc_per_node * cfg.launch.nnodes
    resolved = resolve(cfg, detect(), world_size=world, local_world_size=cfg.launch.nproc_per_node).config
    assert resolved.hardware.precision in ("fp32", "bf16")
    assert isinstance(resolved.hardware.threads, int)


def test_demo_config_is_the_default_run():
    demo = load_config(CONFIGS[0].with_name("demo.yaml"))
    assert demo == Config()
