"""Loading a Hugging Face folder: meta skeleton + safetensors fill gives exactly from_pretrained's
weights, without a second full copy of the model in memory; bad folders give ModelError."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cputrain import model as models
from cputrain.config import ModelConfig
from cputrain.errors import ModelError


def _load(folder: Path):
    source = models.resolve_source(ModelConfig(name_or_path=str(folder)), vocab_size=None)
    skeleton = models.build_skeleton(source, ModelConfig())
    assert all(p.is_meta for p in skeleton.parameters())  # structure only, no storage yet
    models.materialize(skeleton)
    models.load_into(skeleton, source.folder)
    return skeleton


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_fill_matches_from_pretrained(tmp_path, tie):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "m"
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(folder)
    ours = _load(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert set(ours_sd) == set(ref_sd)
    for name, tensor in ref_sd.items():
        assert torch.equal(ours_sd[name], tensor), name
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 300, (2, 12))
    assert torch.equal(ours(input_ids=ids).logits, ref(input_ids=ids).logits)  # buffers (RoPE) too


# One subprocess per measurement. Anonymous memory (RssAnon) is what a copy of the weights costs;
# the memory-mapped safetensors file also shows in RSS while it is read, but as page cache
# (RssFile), shared and reclaimable, so it is left out. Linux keeps no high-water mark for
# RssAnon alone, so a thread samples it while the weights load.
RSS_SCRIPT = r"""
import gc, json, sys, threading
from pathlib import Path
import torch
from cputrain import model as models
from cputrain.config import ModelConfig

def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

folder, how = Path(sys.argv[1]), sys.argv[2]
source = models.resolve_source(ModelConfig(name_or_path=str(folder)), vocab_size=None)
skeleton = models.build_skeleton(source, ModelConfig())
gc.collect()
peak, done = [0], threading.Event()
def sample():
    while not done.wait(0.0005):
        peak[0] = max(peak[0], rss_anon())
sys.setswitchinterval(1e-4)  # let the sampler in between tensor copies
before = rss_anon()
sampler = threading.Thread(target=sample)
sampler.start()
models.materialize(skeleton)
if how == "cputrain":
    models.load_into(skeleton, folder)
else:  # the pattern to avoid: the whole state dict in memory, then copied into the model
    from safetensors.torch import load_file
    state = {k: v.clone() for k, v in load_file(folder / "model.safetensors").items()}
    skeleton.load_state_dict(state, strict=False)
    del state
done.set()
sampler.join()
peak[0] = max(peak[0], rss_anon())
print(json.dumps({"peak_growth": peak[0] - before}))
"""


def _peak_growth(folder: Path, how: str) -> int:
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(folder), how], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth"]


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    """A ~14M-parameter (≈55 MB fp32) Llama: large enough that a second copy shows in RSS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("mid") / "m"
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_loading_keeps_one_copy_of_the_weights(mid_model):
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc/self/status to read RssAnon")
    model_bytes = (mid_model / "model.safetensors").stat().st_size
    ours = _peak_growth(mid_model, "cputrain")
    naive = _peak_growth(mid_model, "state-dict")
    print(f"model {model_bytes / 2**20:.0f} MiB; anonymous growth: cputrain {ours / 2**20:.0f} MiB, "
          f"state dict first {naive / 2**20:.0f} MiB")
    # The parameters themselves (1×) and one tensor in flight (the largest is the 16 MiB
    # embedding, under 0.3×); a second full copy would add another 1×.
    budget = 1.5 * model_bytes
    assert model_bytes * 0.9 < ours < budget, (
        f"anonymous memory grew {ours / 2**20:.0f} MiB loading a {model_bytes / 2**20:.0f} MiB model"
    )
    # The measurement does see a second copy: a whole state dict in memory goes over the budget.
    assert naive > budget, f"a state-dict load grew only {naive / 2**20:.0f} MiB; the measurement is blind"


# --- bad model folders ---------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_folder_and_missing_config(tmp_path):
    with pytest.raises(ModelError, match="not found; check model.name_or_path"):
        models.resolve_source(ModelConfig(name_or_path=str(tmp_path / "nope")), None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        models.resolve_source(ModelConfig(name_or_path=str(tmp_path / "empty")), None)


def test_no_safetensors_is_refused(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelError, match="no .safetensors weights"):
        _load(folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(tiny_model_dir, tmp_path, damage):
    folder = _copy(tiny_model_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 100)
    with pytest.raises(ModelError, match="corrupt or truncated") as err:
        _load(folder)
    assert "\n" not in str(err.value)


def test_weights_of_another_shape(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="do not belong to this model config"):
        _load(folder)


def test_vocab_mismatch(tiny_model_dir):
    from transformers import AutoConfig

    from cputrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    models.check_vocab(config, tok)  # its own tokenizer fits
    config.vocab_size = len(tok) - 10
    with pytest.raises(ModelError, match="tokenizer has .* tokens but the model's vocabulary is"):
        models.check_vocab(config, tok)


def test_remote_code_stays_off():
    assert ModelConfig().trust_remote_code is False


def test_parameter_counts_count_the_tied_head_as_compute(tiny_model_dir):
    m = _load(tiny_model_dir)
    counts = models.parameter_counts(m)
    assert counts["total"] == sum(p.numel() for p in m.parameters())
    assert counts["non_embedding"] == counts["total"]  # tied: the lm_head matmul still runs
