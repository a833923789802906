"""metrics.jsonl and summary.json hold only JSON: a non-finite float is written as null."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cputrain.metrics.finite_json import dumps


def test_non_finite_floats_become_null_at_any_depth():
    row = {"step": 3, "loss": float("nan"), "val": [1.0, float("inf"), -math.inf], "x": {"y": np.float64("nan")}}
    text = dumps(row)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"step": 3, "loss": None, "val": [1.0, None, None], "x": {"y": None}}
    assert dumps({"a": 1.5}, indent=2) == json.dumps({"a": 1.5}, indent=2)


def test_a_value_it_cannot_map_is_an_error_not_an_invalid_file():
    with pytest.raises(ValueError):
        dumps({"loss": np.array([np.nan])}, default=lambda a: a.tolist()[0])
