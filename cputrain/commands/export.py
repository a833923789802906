"""`cputrain export PATH`: a LoRA run's adapters folded into a plain Hugging Face model (--merge),
or a run's model as one GGUF file (--gguf TYPE). Nothing is overwritten."""

from __future__ import annotations

import argparse
from pathlib import Path

from cputrain.errors import UserError


def add_parser(sub) -> argparse.ArgumentParser:
    exp = sub.add_parser(
        "export", help="write a LoRA run as a plain Hugging Face model (--merge), or any run as GGUF (--gguf TYPE)",
        description="A LoRA run exports its adapters (model/: a peft adapter folder on its base). --merge loads the "
        "base, folds the adapters into its weights and writes a plain Hugging Face model folder that transformers "
        "loads without peft. --gguf TYPE writes a run's model (a LoRA run's merged), or a Hugging Face Llama folder, "
        "with its tokenizer and chat template as one GGUF file for llama.cpp and Ollama. "
        "Nothing is overwritten: the output must not exist.")
    exp.add_argument("path", help="run folder (its model/ is used), a peft adapter folder, or (--gguf) a Hugging "
                     "Face Llama folder")
    exp.add_argument("--merge", action="store_true", help="merge the adapters into the base weights")
    exp.add_argument("--gguf", metavar="TYPE", help="write one .gguf file: f32, f16, bf16 or q8_0 (K-quants such as "
                     "q4_k_m: the llama-quantize command that makes one from the bf16 file is printed)")
    exp.add_argument("--out", help="output folder (default: <run>/model-merged) or, with --gguf, file "
                     "(default: <run>/model-TYPE.gguf)")
    return exp


def run(args) -> int:
    from cputrain.finished.load import is_reward_model, model_folder
    from cputrain.lora.adapter_folder import is_adapter_folder, merge_into_base

    folder = Path(model_folder(args.path))
    if args.gguf is not None:
        if is_reward_model(str(folder)):
            raise UserError(f"'{folder}' is a reward model (a score head, no language-model head), which a GGUF file "
                            "for llama.cpp does not hold; use its folder with transformers, or `cputrain score`")
        return _export_gguf(args, folder)
    if not is_adapter_folder(folder):
        raise UserError(f"'{folder}' is already a plain Hugging Face model (no LoRA adapter to merge); use it as it is")
    if not args.merge:
        raise UserError(f"'{folder}' holds LoRA adapters, which peft loads onto their base; "
                        "add --merge to write them folded into a plain model")
    run_dir = folder.parent if folder.name == "model" else folder
    out = Path(args.out) if args.out else run_dir / "model-merged"
    print(f"merged model: {merge_into_base(folder, out)}")
    return 0


def _export_gguf(args, folder) -> int:
    """`export RUN --gguf TYPE`: a LoRA run's adapters are merged in memory (--merge is implied)."""
    from cputrain.finished.gguf.types import check_type
    from cputrain.finished.gguf.write import default_out, export_gguf

    check_type(args.gguf, args.path, str(default_out(folder, "bf16")))
    out = Path(args.out) if args.out else default_out(folder, args.gguf)
    print(f"gguf ({args.gguf}): {export_gguf(folder, args.gguf, out)}")
    return 0
