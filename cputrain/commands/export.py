"""`cputrain export PATH`: a LoRA run's adapters folded into a plain Hugging Face model (--merge),
or a run's model as one GGUF file (--gguf TYPE); neither overwrites anything. Without either, the
folder is completed in place where an earlier version left out what tools other than transformers
read (its class, the dtype of its weights, generation_config.json); no weight file is touched."""

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
        "with its tokenizer and chat template as one GGUF file for llama.cpp and Ollama; neither overwrites "
        "anything: the output must not exist. Without --merge or --gguf, the folder is completed in place where an "
        "earlier version of cputrain left out what TRL, llama.cpp's converter and vLLM read (config.json's "
        "architectures and dtype, the tokenizer's ids, generation_config.json); no weight file is touched.")
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
    from cputrain.finished.out_file import refuse_under_a_file
    from cputrain.lora.adapter_folder import is_adapter_folder, merge_into_base

    folder = Path(model_folder(args.path))
    if args.gguf is not None:
        if is_reward_model(str(folder)):
            raise UserError(f"'{folder}' is a reward model (a score head, no language-model head), which a GGUF file "
                            "for llama.cpp does not hold; use its folder with transformers, or `cputrain score`")
        return _export_gguf(args, folder)
    if not args.merge:
        return _complete(args, folder)
    if not is_adapter_folder(folder):
        raise UserError(f"'{folder}' is already a plain Hugging Face model (no LoRA adapter to merge); use it as it is")
    run_dir = folder.parent if folder.name == "model" else folder
    out = Path(args.out) if args.out else run_dir / "model-merged"
    refuse_under_a_file(out, "--out")  # before the merge, which loads the base and its adapters
    print(f"merged model: {merge_into_base(folder, out)}")
    return 0


def _complete(args, folder: Path) -> int:
    """`export PATH` alone: what a folder of an earlier version lacks, written into it."""
    from cputrain.data.tokenizer import load_tokenizer
    from cputrain.lora.adapter_folder import complete_adapter_folder, is_adapter_folder
    from cputrain.model.folder_description import describe_model_folder

    if args.out:
        raise UserError("--out names what --merge or --gguf writes; without them, export completes the folder in "
                        "place and writes nothing elsewhere")
    adapters = is_adapter_folder(folder)
    if adapters:
        added = complete_adapter_folder(folder)
    else:
        added = describe_model_folder(folder, load_tokenizer(str(folder)), started_from=folder)
    said = "its base and where a generation ends" if adapters else \
        "its class, the dtype of its weights and where a generation ends"
    print(f"{folder}: added {'; '.join(added)}; no weight file was touched" if added else
          f"{folder}: nothing to add (it names {said})")
    if adapters:
        print("its LoRA adapters load onto their base with peft; --merge writes them folded into a plain model")
    return 0


def _export_gguf(args, folder) -> int:
    """`export RUN --gguf TYPE`: a LoRA run's adapters are merged in memory (--merge is implied)."""
    from cputrain.finished.gguf.types import check_type
    from cputrain.finished.gguf.write import default_out, export_gguf

    check_type(args.gguf, args.path, str(default_out(folder, "bf16")))
    out = Path(args.out) if args.out else default_out(folder, args.gguf)
    print(f"gguf ({args.gguf}): {export_gguf(folder, args.gguf, out)}")
    return 0
