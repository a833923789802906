"""The adapter folder a LoRA run exports as model/, and the two ways to use it.

    model/  adapter_config.json, adapter_model.safetensors (peft's format and key names, so
            peft.PeftModel.from_pretrained loads it onto the base, and transformers' Auto classes
            and pipeline load it through the base it names), the tokenizer's files (the run's
            chat template), generation_config.json (where the run's tokenizer ends a generation)

load_adapted puts it on its base for generate and eval; merge_into_base writes a plain Hugging
Face model with the adapters folded into the weights (`cputrain export RUN --merge`); merged_model
is that model in memory (`cputrain export RUN --gguf TYPE` writes it as GGUF). The merged folder
says what it holds as a run's model/ does (cputrain.model.folder_description).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from cputrain.errors import ModelError, one_line
from cputrain.lora.adapters import ADAPTER
from cputrain.model.folder_description import describe_model_folder, write_generation_config
from cputrain.model.score_head import SCORE

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# PeftModel's own prefix: its state dict names the wrapped model `base_model.model`.
PEFT_PREFIX = "base_model.model."


def is_adapter_folder(folder: Path) -> bool:
    return (folder / CONFIG_NAME).is_file()


def write_adapter_folder(tensors: Iterable[tuple[str, torch.Tensor]], model, tokenizer, out_dir: str,
                         is_writer: bool) -> None:
    """Write `out_dir` from the (name, full tensor) pairs of the adapters. Every rank iterates
    (under FSDP each tensor is a collective gather); only the writer keeps and writes them."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from cputrain.model.export import fresh_staging, swap_in

    if not is_writer:
        for _ in tensors:  # take part in each gather; keep nothing
            pass
        return
    gathered = {name: tensor.detach().contiguous() for name, tensor in tensors}
    head = gathered.pop(f"{SCORE}.weight", None)  # a reward model's score head
    # peft's own conversion: drops the adapter's name from every key, as its save_pretrained does
    adapter_sd = get_peft_model_state_dict(model, state_dict=gathered, adapter_name=ADAPTER)
    config = model.peft_config[ADAPTER]
    if head is not None:  # saved as peft saves a module_to_save of its sequence classification
        adapter_sd[f"{SCORE}.weight"] = head
        config = copy.copy(config)
        config.modules_to_save = [SCORE]
    out = Path(out_dir)
    tmp = fresh_staging(out)
    save_file({PEFT_PREFIX + k: v for k, v in adapter_sd.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(tmp)
    base = model.peft_config[ADAPTER].base_model_name_or_path
    write_generation_config(tmp, tokenizer, started_from=Path(base) if base else None)
    swap_in(tmp, out)


def complete_adapter_folder(folder: Path) -> list[str]:
    """The generation_config.json an adapter folder of an earlier version lacks (what was written)."""
    from cputrain.data.tokenizer import load_tokenizer

    base = json.loads((folder / CONFIG_NAME).read_text()).get("base_model_name_or_path")
    return write_generation_config(folder, load_tokenizer(str(folder)),
                                   started_from=Path(base) if base and Path(base).is_dir() else None)


def base_of(folder: Path) -> str:
    """The base model folder an adapter folder was trained on (its adapter_config.json says)."""
    base = json.loads((folder / CONFIG_NAME).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ModelError(
            f"the LoRA adapter in '{folder}' was trained on base model '{base}', which is not on this machine; "
            "copy the base there, or merge on a machine that has it (cputrain export RUN --merge)"
        )
    return base


def is_reward_adapter(folder: Path) -> bool:
    """Whether the adapter folder is a reward model's (peft's sequence classification: adapters and a score head)."""
    return json.loads((folder / CONFIG_NAME).read_text()).get("task_type") == "SEQ_CLS"


def load_adapted(folder: Path, dtype: torch.dtype | str = torch.float32, trust_remote_code: bool = False):
    """The base model with the adapter folder's adapters on it (a peft PeftModel); a reward
    model's base as a sequence classifier with one output whose pooling skips the pad token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    base = base_of(folder)
    try:
        if is_reward_adapter(folder):
            from cputrain.data.tokenizer import load_tokenizer

            _require_score_head(folder)
            tok = load_tokenizer(str(folder), trust_remote_code)
            # the base has no score head: transformers' load report would call it newly
            # initialized, though the adapter folder's trained head replaces it below (checked above)
            with _quiet_load_report():
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    base, dtype=dtype, trust_remote_code=trust_remote_code, num_labels=1, output_loading_info=True,
                    pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            others = sorted(k for k in info["missing_keys"] if not k.startswith(SCORE + "."))
            if others:
                raise ModelError(f"the base model '{base}' lacks weights the reward model needs: "
                                 f"{', '.join(others[:3])}{' …' if len(others) > 3 else ''}")
        else:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code)
        with warnings.catch_warnings():  # peft asks transformers 5 for a renamed attribute; nothing to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            return PeftModel.from_pretrained(model, str(folder))
    except Exception as exc:
        raise ModelError(f"could not load the LoRA adapter in '{folder}' onto '{base}': {one_line(exc)}") from None


def _require_score_head(folder: Path) -> None:
    """A reward adapter folder holds its trained score head (peft's modules_to_save): without it
    the base would score through a random one."""
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS_NAME), "pt") as f:
        if not any(key.split(".")[-2:-1] == [SCORE] or f".{SCORE}." in key for key in f.keys()):
            raise ModelError(f"the reward model's adapters in '{folder}' hold no trained score head ({SCORE}.weight "
                             f"in {WEIGHTS_NAME}); it would score with a random one: export the run again")


@contextlib.contextmanager
def _quiet_load_report():
    """transformers' load report (logged as a warning by modeling_utils) held back for one load."""
    # a filter, not the logger's level: transformers runs a check of its own, with a warning of its
    # own, where that level is WARNING or above
    def not_the_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(not_the_report)
    try:
        yield
    finally:
        logger.removeFilter(not_the_report)


def merged_model(folder: Path):
    """The base with the adapters merged into its weights, in memory, in the base's own dtype
    (bf16 bases stay bf16: 16 GB for Llama-3-8B, not 32): a plain transformers model."""
    return load_adapted(folder, dtype="auto").merge_and_unload()


def merge_into_base(folder: Path, out: Path) -> Path:
    """Write `out`: the base with the adapters merged into its weights, in the base's own dtype,
    as a plain Hugging Face model folder (with the tokenizer). `out` must not exist yet."""
    from cputrain.model.export import fresh_staging, swap_in
    from cputrain.data.tokenizer import load_tokenizer

    if out.exists():
        raise ModelError(f"'{out}' already exists; remove it or name another folder with --out")
    merged = merged_model(folder)
    tmp = fresh_staging(out)
    merged.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer = load_tokenizer(str(folder))  # the run's: its chat template and where a turn ends
    tokenizer.save_pretrained(str(tmp))
    describe_model_folder(tmp, tokenizer, started_from=Path(base_of(folder)))
    swap_in(tmp, out)
    return out
