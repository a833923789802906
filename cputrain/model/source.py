"""Which model a run trains: a Hugging Face folder (config.json + safetensors) or a skeleton built
from model.arch, its config read and checked against the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cputrain.config import ModelConfig
from cputrain.errors import ModelError, first_line, one_line


@dataclass
class ModelSource:
    """Where weights come from: a folder with config.json + *.safetensors, or nothing (random init)."""

    folder: Path | None
    hf_config: object  # transformers PretrainedConfig


def config_from_arch(arch: dict, vocab_size: int | None):
    """The transformers config that `model.arch` describes; the library validates every key
    (integers, heads dividing the hidden size) and its whole message is reported."""
    from transformers import CONFIG_MAPPING

    arch = dict(arch)
    model_type = arch.pop("model_type", "llama")
    if model_type not in CONFIG_MAPPING:
        raise ModelError(f"model.arch.model_type '{model_type}' is not a transformers model type")
    try:
        return CONFIG_MAPPING[model_type](**arch, vocab_size=vocab_size)
    except Exception as exc:
        raise ModelError(f"model.arch does not make a valid {model_type} config: {one_line(exc)}") from None


def folder_config(cfg: ModelConfig, folder: Path):
    """The transformers config of a model folder, after its config.json was checked for the sizes."""
    from transformers import AutoConfig

    from cputrain.config.model_file import read_config_json

    read_config_json(folder / "config.json", trust_remote_code=cfg.trust_remote_code)
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise ModelError(f"could not read the model config in '{cfg.name_or_path}': {one_line(exc)}") from None


def resolve_source(cfg: ModelConfig, vocab_size: int | None) -> ModelSource:
    if cfg.name_or_path is None:
        return ModelSource(None, config_from_arch(cfg.arch, vocab_size))
    folder = local_folder(cfg.name_or_path)
    return ModelSource(folder, folder_config(cfg, folder))


def local_folder(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder '{path}' has no config.json; point model.name_or_path at a Hugging Face model folder")
        return path
    if path.exists():
        raise ModelError(f"model.name_or_path '{path}' is a file; it must be a model folder")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise ModelError(f"model folder '{name_or_path}' not found; check model.name_or_path")
    # A hub id ("org/name"): fetch only the config, tokenizer and safetensors into the HF cache.
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:
        raise ModelError(f"model '{name_or_path}' is not a local folder and could not be fetched: {first_line(exc)}") from None


def check_vocab(model_config, tokenizer) -> None:
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ModelError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}; "
            "use the tokenizer that belongs to the model (model.tokenizer)"
        )
