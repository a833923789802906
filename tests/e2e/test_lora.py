"""LoRA through the CLI: a run stopped and resumed gives the very same losses and adapters as a
straight one; checkpoints hold the adapters alone; model/ is an adapter folder peft loads; the
merged export loads in transformers; generate and eval work on both; bad input is one line and
leaves the run folder as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from harness.run_cli import run_cli
from harness.run_metrics import losses_by_step
from harness.tiny_model import make_tiny_model
from harness.tiny_run import tiny_overrides

LORA = {"model.lora.enabled": "true", "model.lora.rank": 4, "train.lr": 1e-2}


def _overrides(out, cache_dir, base, **extra):
    return tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **LORA, **extra})


def _files(folder) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir, base):
    out = tmp_path_factory.mktemp("lora") / "straight"
    run_cli("train", *_overrides(out, cache_dir, base), check=True)
    return out


def test_stop_and_resume_equals_straight_run(straight, tmp_path, cache_dir, base):
    split = tmp_path / "split"
    run_cli("train", *_overrides(split, cache_dir, base, **{"train.stop_at_step": 5}), check=True)
    second = run_cli("train", *_overrides(split, cache_dir, base), check=True)
    assert "resumed from" in second.stderr and "(step 5)" in second.stderr
    a, b = losses_by_step(straight), losses_by_step(split)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    assert a[10] < a[1]  # the adapters learned something

    from safetensors.torch import load_file

    wa = load_file(straight / "model" / "adapter_model.safetensors")
    wb = load_file(split / "model" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoint_holds_the_adapters_only(straight, base):
    from torch.distributed.checkpoint import FileSystemReader

    state = straight / "checkpoints" / "step-000010" / "state"
    keys = list(FileSystemReader(str(state)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    assert any(k.startswith("optim.state.") for k in keys)
    summary = json.loads((straight / "summary.json").read_text())
    trained = summary["trained_parameters"]
    # the tensors saved: fp32 adapters, AdamW's two fp32 moments and one 4-byte step per adapter
    metadata = FileSystemReader(str(state)).read_metadata().state_dict_metadata
    tensor_bytes = sum(m.size.numel() * m.properties.dtype.itemsize for m in metadata.values() if hasattr(m, "size"))
    assert tensor_bytes == 4 * trained + 8 * trained + 4 * len(model_keys)
    recorded = json.loads((straight / "base_model.json").read_text())
    assert recorded["path"] == str(base) and recorded["fingerprint"].startswith("sha256:")
    assert summary["lora"] is True and 0 < summary["trained_parameters"] < summary["parameters"] / 2


def test_adapter_folder_loads_in_peft_and_merges(straight, tmp_path, base):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = straight / "model"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    assert not (model_dir / "model.safetensors").exists()  # the base is not copied
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(model_dir)).eval()
    trained_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert trained_b and all(p.abs().sum() > 0 for p in trained_b)  # loaded, and moved off their zero init
    ids = torch.randint(0, 300, (2, 16))
    base_logits = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-4)

    merged_dir = tmp_path / "merged"
    proc = run_cli("export", straight, "--merge", "--out", merged_dir, check=True)
    assert str(merged_dir) in proc.stdout
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted, atol=1e-4)

    before = _files(merged_dir)
    again = run_cli("export", straight, "--merge", "--out", merged_dir)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    assert _files(merged_dir) == before

    for path in (straight, merged_dir):
        gen = run_cli("generate", path, "--max-new-tokens", "5", "--temperature", "0", check=True)
        assert gen.stdout.strip()
        ev = run_cli("eval", path, *_overrides(straight, straight.parent, base)[:0], "--max-sequences", "8",
                     "data.max_documents=400", "data.seq_len=32", check=True)
        assert json.loads(ev.stdout)["sequences"] == 8
    # greedy text from the adapter on its base and from the merged model is the same
    a = run_cli("generate", straight, "--max-new-tokens", "8", "--temperature", "0", check=True).stdout
    b = run_cli("generate", merged_dir, "--max-new-tokens", "8", "--temperature", "0", check=True).stdout
    assert a == b


def test_bad_input_is_one_line_and_leaves_the_folder(straight, tmp_path, cache_dir, base):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = _files(run)

    def refused(*overrides, expect):
        proc = run_cli("train", *overrides)
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("cputrain: error:") and expect in last, last
        assert "Traceback" not in proc.stderr
        assert _files(run) == before  # nothing written, nothing lost

    refused(*_overrides(run, cache_dir, base, **{"model.lora.enabled": "false", "train.max_steps": 20}),
            expect="holds checkpoints of LoRA adapters")
    refused(*_overrides(run, cache_dir, base, **{"model.lora.rank": 8, "train.max_steps": 20}),
            expect="model.lora.rank: 4 there, 8 now")
    refused(*_overrides(tmp_path / "new", cache_dir, base, **{"model.lora.target_modules": "[q_proj,qkv]"}),
            expect="'qkv' names no linear layer")
    refused(*_overrides(tmp_path / "new", cache_dir, base, **{"model.lora.rank": 0}), expect="model.lora.rank must be")

    # the same base folder with other weights in it: the adapters do not belong to them
    other_base = tmp_path / "other-base"
    shutil.copytree(base, other_base)
    moved = tmp_path / "moved"
    shutil.copytree(straight, moved)
    cfg = (moved / "config.yaml").read_text().replace(str(base), str(other_base))
    (moved / "config.yaml").write_text(cfg)
    (moved / "base_model.json").write_text((moved / "base_model.json").read_text().replace(str(base), str(other_base)))
    make_tiny_model(tmp_path / "reseeded", seed=7)
    shutil.copy(tmp_path / "reseeded" / "model.safetensors", other_base / "model.safetensors")
    proc = run_cli("train", *_overrides(moved, cache_dir, other_base, **{"train.max_steps": 20}))
    assert proc.returncode == 2 and "trained on other base weights" in proc.stderr.strip().splitlines()[-1]

    # a full fine-tune's folder resumed as LoRA
    full = tmp_path / "full"
    run_cli("train", *tiny_overrides(full, cache_dir, **{"model.name_or_path": base, "train.max_steps": 2,
                                                         "train.checkpoint_every": 2}), check=True)
    proc = run_cli("train", *_overrides(full, cache_dir, base, **{"train.max_steps": 4}))
    assert proc.returncode == 2 and "holds checkpoints of a full fine-tune" in proc.stderr
