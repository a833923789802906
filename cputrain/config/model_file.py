"""A model's config.json, checked before anything relies on it.

transformers fills every size that a config.json leaves out with its class default (a Llama
without `hidden_size` gets 4096), so a file missing a field would plan or build a model it
does not describe. The sizes the planner and the trainer read must be in the file itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from cputrain.errors import ModelError

# What the planner reads from every config (model_shape.shape_of), under the transformers name;
# a model type may store them under its own (GPT-2: n_embd), as its attribute_map says.
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def read_config_json(path: Path, trust_remote_code: bool = False) -> dict:
    """The fields of `path`, refused with one line unless they describe a model transformers knows."""
    try:
        raw = json.loads(Path(path).read_bytes())
    except json.JSONDecodeError as exc:
        raise ModelError(f"'{path}' is not valid JSON (line {exc.lineno}): fix or re-export the config") from None
    except UnicodeDecodeError:
        raise ModelError(f"'{path}' is not valid JSON (not UTF-8 text): point at a model's config.json") from None
    except OSError as exc:
        raise ModelError(f"cannot read '{path}': {exc.strerror}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"'{path}' holds a JSON {type(raw).__name__}, not an object of config fields "
                         "(model_type, hidden_size, …): point at a model's config.json")
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        if trust_remote_code and "auto_map" in raw:
            return raw  # the model's own config class, which checks its own fields
        raise ModelError(f"'{path}' has model_type {model_type!r}, which transformers does not know")
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    names = REQUIRED_FIELDS + (("intermediate_size",) if hasattr(defaults, "intermediate_size") else ())
    stored_as = getattr(config_class, "attribute_map", {}) or {}
    missing = [n for n in names if n not in raw and stored_as.get(n) not in raw]
    if missing:
        first = missing[0]
        raise ModelError(
            f"'{path}' lacks {', '.join(missing)} (transformers would take its {model_type} default, "
            f"{first}={getattr(defaults, first, None)!r}, and describe another model); "
            "add the model's own values to the file"
        )
    return raw
