"""A finished model found and loaded: a run folder's exported model/, or a model folder as it is;
a LoRA adapter folder on its base, unmerged. A reward model (a sequence classifier, or a LoRA
reward model's adapters and head) loads as the classifier it is."""

from __future__ import annotations

from pathlib import Path

import torch

from cputrain.errors import ModelError


def _is_model(folder: Path) -> bool:
    """A Hugging Face model folder, or a LoRA adapter folder (which names its base)."""
    from cputrain.lora.adapter_folder import is_adapter_folder

    return (folder / "config.json").is_file() or is_adapter_folder(folder)


def model_folder(path: str) -> str:
    """A run folder means its exported model/; a model folder is used as it is."""
    p = Path(path)
    if _is_model(p / "model"):
        return str(p / "model")
    if _is_model(p):
        return str(p)
    if (p / "checkpoints").is_dir():
        raise ModelError(f"run '{path}' has no exported model yet (it exports model/ when training ends)")
    raise ModelError(f"'{path}' is neither a run folder nor a model folder (no config.json)")


def is_reward_model(folder: str) -> bool:
    """Whether a model folder (model_folder's) holds a reward model."""
    import json

    from cputrain.lora.adapter_folder import is_adapter_folder, is_reward_adapter
    from cputrain.model.score_head import is_score_config

    path = Path(folder)
    if is_adapter_folder(path):
        return is_reward_adapter(path)
    config = json.loads((path / "config.json").read_text())
    return is_score_config(type("Config", (), {"architectures": config.get("architectures")}))


def load_for_inference(path: str, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from cputrain.data.tokenizer import load_tokenizer

    from cputrain.lora.adapter_folder import is_adapter_folder, load_adapted

    folder = model_folder(path)
    tokenizer = load_tokenizer(folder, trust_remote_code)
    if is_adapter_folder(Path(folder)):  # adapters on their base, unmerged
        return load_adapted(Path(folder), trust_remote_code=trust_remote_code).eval(), tokenizer
    auto = AutoModelForSequenceClassification if is_reward_model(folder) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"could not load the model in '{folder}': {first}") from None
    return model.eval(), tokenizer
