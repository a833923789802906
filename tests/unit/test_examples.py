"""Every shipped config in configs/ loads, validates and resolves on this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from cputrain.config import Config

from cputrain.config.file import load_config, read_yaml
from cputrain.hardware import detect
from cputrain.config.resolve import resolve

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
    def same(written, loaded, where):
        if isinstance(written, dict) and isinstance(loaded, dict) and not where.endswith("arch"):
            for key, value in written.items():  # a nested section (model.lora) written in part
                same(value, loaded[key], f"{where}.{key}")
        else:
            assert loaded == written, f"{path.name}: {where}"

    for section, values in raw.items():
        same(values, dumped[section], section)
    world = cfg.launch.nproc_per_node * cfg.launch.nnodes
    resolved = resolve(cfg, detect(), world_size=world, local_world_size=cfg.launch.nproc_per_node).config
    assert resolved.hardware.precision in ("fp32", "bf16")
    assert isinstance(resolved.hardware.threads, int)


def test_demo_config_is_the_default_run():
    demo = load_config(CONFIGS[0].with_name("demo.yaml"))
    assert demo == Config()
