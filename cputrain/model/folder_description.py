"""What a model folder says about the model it holds, beside its weights and tokenizer, so that the
tools a folder is taken to load it as they load a published model.

    config.json
        architectures           the transformers class of the weights (["LlamaForCausalLM"]).
                                transformers' Auto classes find it from model_type, but TRL's
                                DPOTrainer (model and reference), llama.cpp's convert_hf_to_gguf.py
                                and vLLM pick the class from this field: a folder without it loads
                                in transformers and stops there.
        dtype, torch_dtype      the type the weights are stored in, read from the files' headers
                                (transformers 5 reads dtype, 4.x torch_dtype)
        bos/eos/pad_token_id    the tokenizer's. A model built from model.arch would keep
                                LlamaConfig's defaults (1, 2), other tokens of the tokenizer
                                cputrain trains (<|pad|>, <|im_start|>).
    generation_config.json
        eos_token_id            where a generation ends (`generation_end_ids`: EOS, and the token
                                that ends a chat turn where the tokenizer has one; what `cputrain
                                generate` stops at), and any end the starting model's file
                                chose (not ids transformers copied there from its config.json)
        bos/pad_token_id        the tokenizer's
        the rest                the starting model's generation_config.json (its sampling
                                defaults), where it had one

A LoRA adapter folder holds no config.json: it names its base (adapter_config.json), whose folder
says the rest; it carries its own generation_config.json, as its run's tokenizer ends a turn.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cputrain.model.weights import safetensors_header

CONFIG_NAME = "config.json"
GENERATION_NAME = "generation_config.json"
# Tokens that end a chat turn: ChatML's (the built-in template; Qwen's), Llama 3's, Phi-3's.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")
# safetensors' names of the floating types a model's weights are stored in, as config.json names them
STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def generation_end_ids(tokenizer) -> list[int]:
    """Token ids at which a generation ends: EOS, and the end-of-turn tokens the tokenizer knows."""
    vocab = tokenizer.get_vocab()
    ids = [tokenizer.eos_token_id] + [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    return sorted({i for i in ids if i is not None})


def architecture_of(config: dict) -> str | None:
    """The class a config.json names, or the causal-LM class transformers' Auto classes build for
    its model_type (None for a type it does not know: trust_remote_code models name their own)."""
    named = config.get("architectures")
    if named:
        return named[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))


def stored_dtype(folder: Path) -> str | None:
    """The floating type that holds most of the folder's weight bytes (headers only read)."""
    held: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        for key, entry in safetensors_header(path).items():
            if key != "__metadata__" and entry["dtype"] in STORED_DTYPES:
                start, end = entry["data_offsets"]
                held[entry["dtype"]] = held.get(entry["dtype"], 0) + end - start
    return STORED_DTYPES[max(held, key=held.get)] if held else None


def _ids(value) -> list[int]:
    return [value] if isinstance(value, int) else [i for i in value or [] if isinstance(i, int)]


def _one_or_list(ids: list[int]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else ids


def generation_settings(tokenizer, started_from: Path | None = None) -> dict:
    """generation_config.json's fields: the starting model's, with the tokenizer's ids."""
    start = _read(started_from / GENERATION_NAME) if started_from is not None else {}
    if start.get("_from_model_config"):  # transformers copied config.json's ids there: nobody chose them
        start = {k: v for k, v in start.items() if k not in TOKEN_IDS}
    # not settings: the version that wrote the file, and transformers' own markers (_from_model_config)
    settings = {k: v for k, v in start.items() if k != "transformers_version" and not k.startswith("_")}
    settings["eos_token_id"] = _one_or_list(sorted(set(_ids(start.get("eos_token_id"))) |
                                                   set(generation_end_ids(tokenizer))))
    if tokenizer.bos_token_id is not None:
        settings["bos_token_id"] = tokenizer.bos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings["pad_token_id"] = pad
    return settings


def write_generation_config(folder: Path, tokenizer, started_from: Path | None = None) -> list[str]:
    """Write folder/generation_config.json unless it already says the same; what was written."""
    from transformers import GenerationConfig

    # through transformers' own class: it checks the values, and writes (and so compares) only
    # those that differ from its defaults
    new = GenerationConfig(**generation_settings(tokenizer, started_from))
    path = folder / GENERATION_NAME
    if path.is_file() and _settings_of(GenerationConfig(**_read(path))) == _settings_of(new):
        return []
    new.save_pretrained(str(folder))
    settings = new.to_dict()
    ends = settings["eos_token_id"]
    return [f"{GENERATION_NAME} (ends at {ends}, bos {settings.get('bos_token_id')}, pad {settings['pad_token_id']})"]


def describe_model_folder(folder: Path, tokenizer, started_from: Path | None = None) -> list[str]:
    """Complete folder/config.json (class, stored dtype, the tokenizer's ids) and write its
    generation_config.json (`started_from`: the folder of the model training started from). No
    weight is touched. Returns what was added or changed, [] when the folder already said it all."""
    path = folder / CONFIG_NAME
    config = _read(path)
    changed = []

    def put(key: str, value) -> None:
        if value is not None and config.get(key) != value:
            changed.append(f"{key} {value}" if key not in config or config[key] is None else
                           f"{key} {value} (was {config[key]})")
            config[key] = value

    architecture = architecture_of(config)
    put("architectures", [architecture] if architecture else None)
    dtype = stored_dtype(folder)
    put("dtype", dtype)
    put("torch_dtype", dtype)
    put("bos_token_id", tokenizer.bos_token_id)
    eos = config.get("eos_token_id")
    if tokenizer.eos_token_id not in _ids(eos):  # a list that holds it (Llama 3.1's three) is kept
        put("eos_token_id", tokenizer.eos_token_id)
    put("pad_token_id", tokenizer.pad_token_id)
    if changed:
        _write(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return changed + write_generation_config(folder, tokenizer, started_from)


def _settings_of(generation) -> dict:
    return {k: v for k, v in generation.to_diff_dict().items() if k != "transformers_version"}


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write(path: Path, text: str) -> None:
    """Replace the file whole: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
