"""From a run, a LoRA run or a Hugging Face Llama folder to one .gguf file.

The file is written as `<out>.tmp` and renamed once whole: a killed export leaves no file that
llama.cpp would take for a model, and an existing file is never overwritten. Memory: the model as
its files hold it, plus the converted tensors (GGUFWriter writes them once all are added): for
Llama-3-8B in bf16 to q8_0, about 16 + 8.5 GB.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cputrain.errors import ModelError

log = logging.getLogger("cputrain")


def default_out(folder: Path, type_name: str) -> Path:
    """RUN/model-TYPE.gguf beside RUN/model/ (a model folder named otherwise: inside it)."""
    run = folder.parent if folder.name == "model" else folder
    return run / f"model-{type_name}.gguf"


def load_source(folder: Path):
    """(state dict, config, tokenizer folder): a LoRA adapter folder merged onto its base in memory
    (`export --merge`'s own merge), any other folder as transformers loads it, in its files' dtype.
    Without transformers' progress bar: a refusal after loading is then still one line on stderr."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return _load_source(folder)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _load_source(folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from cputrain.errors import one_line
    from cputrain.finished.gguf.llama import check_llama
    from cputrain.lora.adapter_folder import base_of, is_adapter_folder, merged_model

    config_folder = base_of(folder) if is_adapter_folder(folder) else folder
    try:
        config = AutoConfig.from_pretrained(config_folder)
    except Exception as exc:
        raise ModelError(f"could not read the model config in '{config_folder}': {one_line(exc)}") from None
    check_llama(config, config_folder)
    if is_adapter_folder(folder):
        model = merged_model(folder)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
        except Exception as exc:
            raise ModelError(f"could not load the model in '{folder}': {one_line(exc)}") from None
    return model.state_dict(), model.config, folder


def export_gguf(folder: Path, type_name: str, out: Path) -> Path:
    """Write `out` (which must not exist): the model in `folder` with its tokenizer as GGUF."""
    import gguf

    from cputrain.finished.gguf.llama import ARCH, add_hyperparameters, gguf_tensors
    from cputrain.finished.gguf.types import convert, file_type
    from cputrain.finished.gguf.vocab import add_tokenizer

    if out.exists():
        raise ModelError(f"'{out}' already exists; remove it or name another file with --out")
    if not out.parent.is_dir():
        raise ModelError(f"folder '{out.parent}' does not exist; create it or name another file with --out")
    state_dict, config, tokenizer_folder = load_source(folder)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        writer.add_name(folder.parent.name if folder.name == "model" else folder.name)
        add_hyperparameters(writer, config)
        writer.add_file_type(file_type(type_name))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(writer, tokenizer_folder, config.vocab_size)
        kept_f32 = []
        for name, tensor in gguf_tensors(state_dict, config):
            data, raw_dtype = convert(name, tensor, type_name)
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
            if tensor.dim() == 2 and type_name != "f32" and raw_dtype is None and data.dtype == "float32":
                kept_f32.append(f"{name} (rows of {tensor.shape[-1]})")
        if kept_f32:
            log.warning("gguf: %d matri%s kept in f32, rows not a multiple of q8_0's 32-value block: %s",
                        len(kept_f32), "x" if len(kept_f32) == 1 else "ces", ", ".join(kept_f32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    os.rename(tmp, out)
    return out
