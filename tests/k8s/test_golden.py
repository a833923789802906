"""Rendered manifests match the reviewed golden files (regenerate: CPUTRAIN_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import copy
import os

import pytest
import yaml

from cputrain.config import Config
from cputrain.k8s.output import to_stream
from cputrain.k8s.storage import pod_config

from .rendering import CASES, GOLDEN, render_case

CONFIG_PLACEHOLDER = "<the training config: checked by test_configmap_holds_the_run_config>"


def _without_config_text(objects):
    # The config text lists every config key; it is checked on its own, so that adding a key
    # to the config does not turn every golden file stale.
    objects = copy.deepcopy(objects)
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            obj["data"] = {k: CONFIG_PLACEHOLDER for k in obj["data"]}
    return objects


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_golden(case):
    text = to_stream(_without_config_text(render_case(case).objects))
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("CPUTRAIN_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"{path} missing; run with CPUTRAIN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_configmap_holds_the_run_config(case):
    out = render_case(case)
    cm = next(o for o in out.objects if o["kind"] == "ConfigMap")
    loaded = Config.model_validate(yaml.safe_load(cm["data"]["train.yaml"]))
    overrides, _, _ = CASES[case]
    from cputrain.config.file import load_config

    assert loaded == pod_config(load_config(None, overrides), out.options)
    assert loaded.output_dir == f"/output/{out.options.name}"
