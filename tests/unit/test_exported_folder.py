"""What an exported folder says about the model it holds, in this process: a run's model/ names its
transformers class, the dtype its weights are stored in and the tokenizer's special ids, and has a
generation_config.json that ends a generation where `cputrain generate` does (EOS, and the chat
template's end of turn); `cputrain export FOLDER` completes a folder an earlier version wrote
without them, touching no weight. The e2e runs load the folders in transformers' pipeline and TRL
(tests/e2e/test_train_cli.py, test_sft.py, test_preference.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from harness.run_cli_here import run_cli_here
from harness.tiny_run import TINY_ARCH

IM_END = "<|im_end|>"


def _arch() -> dict:
    """model.arch of the tiny runs, as a run built from scratch reads it."""
    arch = {}
    for item in TINY_ARCH:
        key, value = item.split("=", 1)
        if key.startswith("model.arch."):
            arch[key.removeprefix("model.arch.")] = value if key.endswith("model_type") else (
                value == "true" if value in ("true", "false") else int(value))
    return arch


def _json(path) -> dict:
    return json.loads(path.read_text())


def test_a_model_built_from_scratch_exports_its_class_dtype_and_where_generation_ends(tmp_path, tiny_model_dir):
    """A run from model.arch holds a config that never named a class (the Auto classes find it by
    model_type) and LlamaConfig's token ids (1 and 2: <|pad|> and <|im_start|> in the tokenizer
    cputrain trains). The export names the class, the weights' stored dtype, the tokenizer's ids."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from cputrain.model import config_from_arch
    from cputrain.model.export import export_hf

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = config_from_arch(_arch(), vocab_size=len(tokenizer))
    assert not getattr(config, "architectures", None) and config.eos_token_id != tokenizer.eos_token_id
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # weights as a bf16 model's files hold them
    out = tmp_path / "model"
    export_hf(model.state_dict().items(), config, tokenizer, str(out), is_writer=True)

    saved = _json(out / "config.json")
    assert saved["architectures"] == ["LlamaForCausalLM"]
    assert saved["dtype"] == saved["torch_dtype"] == "bfloat16"  # transformers 5 reads dtype, 4.x torch_dtype
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == \
        (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    generation = _json(out / "generation_config.json")
    # a chat model stops at the end of its turn as well as at EOS
    assert generation["eos_token_id"] == sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)})
    assert generation["bos_token_id"] == tokenizer.bos_token_id and generation["pad_token_id"] == tokenizer.pad_token_id
    assert (out / "chat_template.jinja").is_file() or "chat_template" in _json(out / "tokenizer_config.json")


def test_a_fine_tuned_model_keeps_the_generation_settings_it_started_from(tmp_path, tiny_model_dir):
    """Sampling defaults and extra end ids of the starting model's generation_config.json (Llama
    3.1 lists three) are kept; the tokenizer's ids are added to them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cputrain.model.export import export_hf

    start = tmp_path / "start"
    shutil.copytree(tiny_model_dir, start)
    (start / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7], "bos_token_id": 1}))
    config, tokenizer = AutoConfig.from_pretrained(start), AutoTokenizer.from_pretrained(start)
    out = tmp_path / "model"
    export_hf(AutoModelForCausalLM.from_pretrained(start).state_dict().items(), config, tokenizer, str(out), True)
    generation = _json(out / "generation_config.json")
    assert generation["do_sample"] is True and generation["temperature"] == 0.6 and generation["top_p"] == 0.9
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)}
    assert generation["eos_token_id"] == sorted(ends | {2, 7})
    assert _json(out / "config.json")["dtype"] == "float32"


def _as_an_earlier_version_wrote_it(folder) -> None:
    """config.json without architectures, dtype or the tokenizer's ids, and no generation_config.json."""
    config = _json(folder / "config.json")
    for key in ("architectures", "dtype", "torch_dtype"):
        config.pop(key, None)
    config.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").unlink(missing_ok=True)


def test_export_completes_a_folder_an_earlier_version_wrote_and_touches_no_weight(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    folder = tmp_path / "run" / "model"
    shutil.copytree(tiny_model_dir, folder)
    _as_an_earlier_version_wrote_it(folder)
    weights = (folder / "model.safetensors").read_bytes()
    proc = run_cli_here("export", folder.parent, check=True)
    assert "architectures" in proc.stdout and "generation_config.json" in proc.stdout, proc.stdout
    saved, tokenizer = _json(folder / "config.json"), AutoTokenizer.from_pretrained(folder)
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["dtype"] == "float32"
    assert saved["eos_token_id"] == tokenizer.eos_token_id
    assert _json(folder / "generation_config.json")["eos_token_id"] == \
        sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)})
    assert (folder / "model.safetensors").read_bytes() == weights
    again = run_cli_here("export", folder.parent, check=True)
    assert "nothing to add" in again.stdout, again.stdout


def test_export_completes_an_adapter_folder_of_an_earlier_version(tmp_path, tiny_model_dir):
    """An adapter folder names its base; what it lacked is where its run's tokenizer ends a generation."""
    from transformers import AutoTokenizer

    folder = tmp_path / "run" / "model"
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, folder / name)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM",
                                                            "base_model_name_or_path": str(tiny_model_dir)}))
    proc = run_cli_here("export", folder.parent, check=True)
    assert "added generation_config.json" in proc.stdout and "--merge writes them folded" in proc.stdout, proc.stdout
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)}
    assert ends <= set(_json(folder / "generation_config.json")["eos_token_id"])  # with the base's own
    assert "nothing to add (it names its base" in run_cli_here("export", folder.parent, check=True).stdout
    assert run_cli_here("export", folder.parent, "--out", tmp_path / "x").returncode == 2  # --out is --merge's


def test_merge_of_a_plain_folder_is_still_refused(tmp_path, tiny_model_dir):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    proc = run_cli_here("export", folder, "--merge")
    assert proc.returncode == 2 and "no LoRA adapter to merge" in proc.stderr and "Traceback" not in proc.stderr


def test_a_generation_ends_at_eos_and_at_the_turn_end_the_tokenizer_knows(tiny_model_dir):
    from transformers import AutoTokenizer

    from cputrain.model.folder_description import generation_end_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert generation_end_ids(tokenizer) == sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)})


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "llama"}, "LlamaForCausalLM"),
    ({"model_type": "qwen2"}, "Qwen2ForCausalLM"),
    ({"model_type": "llama", "architectures": ["MyLlamaForCausalLM"]}, "MyLlamaForCausalLM"),  # kept as named
])
def test_the_class_is_the_one_the_auto_classes_pick(config, expected):
    from cputrain.model.folder_description import architecture_of

    assert architecture_of(config) == expected
