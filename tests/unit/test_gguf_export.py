"""`cputrain export RUN --gguf TYPE`, in this process, read back through the gguf package's own
reader: metadata, every tensor's name, shape, type and values (Q and K with their rows put back),
the tokenizer rebuilt from the file's tokens and merges encoding as the model's own, the chat
template, a LoRA run merged, and the refusals. llama.cpp itself loads the file in
benchmarks/export/gguf_vs_transformers.py (too heavy for the suite)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.run_cli_here import run_cli_here

gguf = pytest.importorskip("gguf")

from cputrain.errors import ModelError  # noqa: E402
from cputrain.finished.gguf.llama import permute_for_llama_cpp  # noqa: E402
from cputrain.finished.gguf.vocab import LLAMA3_SPLIT, pre_tokenizer_name  # noqa: E402

# llama.cpp's tensor names for one block of the tiny model, and what each is in transformers.
BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
TEXTS = ["The list is a mutable sequence.", "  def f(x):\n\treturn x ** 2  # café, 東京 ✓",
         "<|im_start|>user\nWhat is a dict?<|im_end|>\n<|im_start|>assistant\n", "don't 'll 12345 ..."]


@pytest.fixture
def run(tmp_path, tiny_model_dir) -> Path:
    """A run folder whose model/ is the tiny Llama (the shared fixture stays untouched)."""
    shutil.copytree(tiny_model_dir, tmp_path / "run" / "model")
    return tmp_path / "run"


def export(*args) -> Path:
    proc = run_cli_here("export", *args, check=True)
    return Path(proc.stdout.strip().split(": ", 1)[1])


def fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, block, part, _ = gguf_name.split(".")
    return f"model.layers.{block}.{BLOCK[part]}.weight"


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """permute_for_llama_cpp undone: row (h, i, half) back to (h, half, i)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def as_model_layout(name: str, values: np.ndarray, config) -> torch.Tensor:
    """A file's tensor in transformers' row order (Q and K permuted back)."""
    tensor = torch.from_numpy(np.array(values, dtype=np.float32))
    if name.endswith("attn_q.weight"):
        return unpermute(tensor, config.num_attention_heads)
    if name.endswith("attn_k.weight"):
        return unpermute(tensor, config.num_key_value_heads)
    return tensor


def test_f32_file_holds_the_model_and_its_metadata(run):
    from transformers import AutoConfig

    out = export(run, "--gguf", "f32")
    assert out == run / "model-f32.gguf" and not Path(str(out) + ".tmp").exists()
    config = AutoConfig.from_pretrained(run / "model")
    reader = gguf.GGUFReader(out)
    meta = fields(reader)
    assert meta["general.architecture"] == "llama"
    assert meta["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert meta["llama.context_length"] == config.max_position_embeddings == 256
    assert meta["llama.embedding_length"] == 64 and meta["llama.block_count"] == 2
    assert meta["llama.feed_forward_length"] == 128
    assert meta["llama.attention.head_count"] == 4 and meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.rope.freq_base"] == pytest.approx(config.rope_parameters["rope_theta"])
    assert meta["llama.rope.dimension_count"] == 16
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config.rms_norm_eps)
    assert meta["llama.vocab_size"] == config.vocab_size == len(meta["tokenizer.ggml.tokens"])

    expected = model_tensors(run / "model")
    # Tied embeddings: no output.weight (llama.cpp reads token_embd as the head).
    names = {t.name for t in reader.tensors}
    assert names == {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{b}.{part}.weight" for b in range(2) for part in BLOCK}
    for t in reader.tensors:
        want = expected[hf_name(t.name)]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        assert tuple(int(n) for n in reversed(t.shape)) == tuple(want.shape), t.name  # GGUF lists dims innermost first
        got = as_model_layout(t.name, t.data.reshape(want.shape), config)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=t.name)


@pytest.mark.parametrize("type_name,matrix_type", [("bf16", "BF16"), ("f16", "F16"), ("q8_0", "Q8_0")])
def test_each_type_stores_matrices_so_and_norms_in_f32(run, type_name, matrix_type):
    from transformers import AutoConfig

    out = export(run, "--gguf", type_name)
    assert out.name == f"model-{type_name}.gguf"
    config = AutoConfig.from_pretrained(run / "model")
    expected = model_tensors(run / "model")
    reader = gguf.GGUFReader(out)
    assert fields(reader)["general.file_type"] == getattr(gguf.LlamaFileType, f"MOSTLY_{matrix_type}")
    for t in reader.tensors:
        want = expected[hf_name(t.name)]
        if want.dim() == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        else:
            assert t.tensor_type == getattr(gguf.GGMLQuantizationType, matrix_type), t.name
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        got = as_model_layout(t.name, values, config)
        if type_name == "q8_0" and want.dim() == 2:
            # Q8_0: blocks of 32 values, one f16 scale each (max |w| / 127): an error of at most half a
            # step, plus the scale's f16 rounding (2^-11 of it) times up to 127 steps
            step = want.reshape(-1, 32).abs().amax(dim=1, keepdim=True) / 127
            err = (got - want).reshape(-1, 32).abs()
            assert bool((err <= step * (0.5 + 127 * 2**-11) + 1e-9).all()), t.name
            assert float(err.max()) > 0  # quantized for real, not stored as it was
        elif want.dim() == 2:
            torch.testing.assert_close(got, want.to(getattr(torch, "bfloat16" if type_name == "bf16" else "float16"))
                                       .float(), rtol=0, atol=0, msg=t.name)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=t.name)


def interleaved_rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """llama.cpp's `llama` RoPE (its normal mode): each head's pairs (2i, 2i+1) turned by
    position · theta^(-2i/d). x: (heads, head_dim)."""
    d = x.shape[-1]
    angle = position * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * torch.cos(angle) - odd * torch.sin(angle)
    out[..., 1::2] = even * torch.sin(angle) + odd * torch.cos(angle)
    return out


def test_permuted_rows_under_llama_cpp_s_rope_give_transformers_attention_scores():
    """Why the rows are permuted: Q and K of permuted weights, turned as llama.cpp turns them, give
    the scores transformers' rotate-half RoPE gives with the model's own weights."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    heads, kv_heads, d, hidden, theta = 4, 2, 16, 64, 10000.0
    wq, wk = torch.randn(heads * d, hidden, dtype=torch.float64), torch.randn(kv_heads * d, hidden, dtype=torch.float64)
    x = torch.randn(2, hidden, dtype=torch.float64)  # two tokens, at positions 3 and 7
    positions = torch.tensor([3, 7])
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions[:, None].double() * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    q = (x @ wq.T).reshape(2, heads, d).transpose(0, 1)[None]  # (1, heads, tokens, d)
    k = (x @ wk.T).reshape(2, kv_heads, d).transpose(0, 1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    scores_hf = q_hf[0, :, 1] @ k_hf[0].repeat_interleave(heads // kv_heads, dim=0)[:, 0].T

    q_cpp = [interleaved_rope((x[i] @ permute_for_llama_cpp(wq, heads).T).reshape(heads, d), int(p), theta)
             for i, p in enumerate(positions)]
    k_cpp = [interleaved_rope((x[i] @ permute_for_llama_cpp(wk, kv_heads).T).reshape(kv_heads, d), int(p), theta)
             for i, p in enumerate(positions)]
    scores_cpp = q_cpp[1] @ k_cpp[0].repeat_interleave(heads // kv_heads, dim=0).T
    torch.testing.assert_close(torch.diagonal(scores_cpp), torch.diagonal(scores_hf))
    # Without the permutation the scores differ: the test would see a missing one.
    q_raw = interleaved_rope((x[1] @ wq.T).reshape(heads, d), 7, theta)
    k_raw = interleaved_rope((x[0] @ wk.T).reshape(kv_heads, d), 3, theta)
    raw = torch.diagonal(q_raw @ k_raw.repeat_interleave(heads // kv_heads, dim=0).T)
    assert not torch.allclose(raw, torch.diagonal(scores_hf))


def tokenizer_from_file(meta: dict):
    """A tokenizer built from the file alone, as llama.cpp's "gpt2" model with pre "gpt-2" reads it:
    the tokens and merges, GPT-2's byte-level split, the CONTROL tokens kept whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types)
                            if ty == gguf.TokenType.CONTROL])
    return tok


def test_tokenizer_and_chat_template_round_trip(run):
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(export(run, "--gguf", "q8_0"))
    meta = fields(reader)
    hf = AutoTokenizer.from_pretrained(run / "model")
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.eos_token_id"] == hf.eos_token_id
    assert meta["tokenizer.ggml.bos_token_id"] == hf.bos_token_id
    assert meta["tokenizer.ggml.padding_token_id"] == hf.pad_token_id
    assert meta["tokenizer.ggml.add_bos_token"] is False  # cputrain's tokenizer adds none
    control = {t for t, ty in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])
               if ty == gguf.TokenType.CONTROL}
    assert control == {"<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"}
    assert meta["tokenizer.chat_template"] == hf.chat_template
    assert meta["tokenizer.ggml.eot_token_id"] == hf.convert_tokens_to_ids("<|im_end|>")  # a chat turn ends there
    rebuilt = tokenizer_from_file(meta)
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert rebuilt.encode(text).ids == ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == text


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft asks transformers 5 for it
def test_lora_run_is_exported_merged(tmp_path, tiny_model_dir):
    """An adapter folder (peft's, on the tiny base) as a LoRA run's model/: the file holds
    W + (alpha / r) · B · A, computed here by hand."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                        base_model_name_or_path=str(tiny_model_dir))
    peft_model = get_peft_model(base, config)
    torch.manual_seed(1)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: a merge would change nothing
            p.data.normal_(0, 0.1)
    adapters = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}
    run = tmp_path / "lora-run"
    peft_model.save_pretrained(run / "model")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(run / "model")
    assert json.loads((run / "model" / "adapter_config.json").read_text())["base_model_name_or_path"]

    reader = gguf.GGUFReader(export(run, "--gguf", "f32"))
    base_sd = model_tensors(tiny_model_dir)
    tensors = {t.name: t for t in reader.tensors}
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    for block in range(2):
        for part, proj in (("attn_q", "q_proj"), ("attn_v", "v_proj"), ("attn_k", "k_proj")):
            name = f"model.layers.{block}.self_attn.{proj}.weight"
            want = base_sd[name]
            if proj != "k_proj":  # k has no adapter: it stays the base's
                a = adapters[f"base_model.model.model.layers.{block}.self_attn.{proj}.lora_A.default.weight"]
                b = adapters[f"base_model.model.model.layers.{block}.self_attn.{proj}.lora_B.default.weight"]
                want = want + (8 / 4) * b @ a
                assert not torch.allclose(want, base_sd[name])
            t = tensors[f"blk.{block}.{part}.weight"]
            got = as_model_layout(t.name, t.data.reshape(want.shape), hf_config)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def refused(*args, outputs=()) -> str:
    """The command fails with one line on stderr and leaves none of `outputs` (nor a .tmp)."""
    proc = run_cli_here("export", *args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cputrain: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for path in outputs:
        assert not Path(path).exists() and not Path(str(path) + ".tmp").exists()
    return lines[0]


def test_unknown_type_and_k_quants_are_one_line_and_write_nothing(run):
    line = refused(run, "--gguf", "q9", outputs=[run / "model-q9.gguf"])
    assert "unknown type" in line and "q8_0" in line
    line = refused(run, "--gguf", "q4_k_m", outputs=[run / "model-q4_k_m.gguf", run / "model-bf16.gguf"])
    assert f"llama-quantize {run}/model-bf16.gguf {run}/model-q4_k_m.gguf Q4_K_M" in line
    assert f"cputrain export {run} --gguf bf16" in line


def test_a_model_that_is_not_a_llama_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    line = refused(tmp_path / "gpt2", "--gguf", "f32", outputs=[tmp_path / "gpt2" / "model-f32.gguf"])
    assert "gpt2" in line and "Llama" in line


def test_an_existing_output_is_never_overwritten(run):
    target = run / "model-q8_0.gguf"
    target.write_text("kept")
    line = refused(run, "--gguf", "q8_0")
    assert "already exists" in line and target.read_text() == "kept"
    elsewhere = run / "elsewhere.gguf"
    elsewhere.write_text("kept too")
    refused(run, "--gguf", "f32", "--out", elsewhere)
    assert elsewhere.read_text() == "kept too" and not (run / "model-f32.gguf").exists()


def test_f16_is_refused_where_a_weight_overflows_it(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = 1e5
    folder = tmp_path / "big"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    line = refused(folder, "--gguf", "f16", outputs=[folder / "model-f16.gguf"])
    assert "blk.1.ffn_up.weight" in line and "bf16" in line
    assert export(folder, "--gguf", "bf16").is_file()  # bf16 has float32's range


def test_q8_0_keeps_in_f32_a_matrix_whose_rows_are_not_whole_blocks(tmp_path, tiny_model):
    """Rows of 48 values are not a whole number of q8_0's 32-value blocks: such matrices stay exact
    in f32 (one warning line names them), the others are quantized."""
    folder = tmp_path / "narrow"
    shutil.copytree(tiny_model(hidden=48), folder)  # intermediate 96: ffn_down's rows are whole blocks
    proc = run_cli_here("export", folder, "--gguf", "q8_0", check=True)
    assert "kept in f32" in proc.stderr and "blk.0.attn_q.weight (rows of 48)" in proc.stderr
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(folder / "model-q8_0.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up.weight"] == types["token_embd.weight"] == "F32"


def test_pre_tokenizer_is_named_from_tokenizer_json():
    """GPT-2's byte-level split (cputrain's tokenizers) is llama.cpp's gpt-2; Llama 3's split
    regex then a byte-level step without one is llama-bpe; anything else is refused, not guessed."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert pre_tokenizer_name({"pre_tokenizer": byte_level}, "f") == "gpt-2"
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        dict(byte_level, use_regex=False)]}
    assert pre_tokenizer_name({"pre_tokenizer": llama3}, "f") == "llama-bpe"
    for other in ({"type": "Metaspace", "replacement": "▁"}, dict(byte_level, add_prefix_space=True),
                  {"type": "Sequence", "pretokenizers": [dict(llama3["pretokenizers"][0], pattern={"Regex": r"\s+"}),
                                                         dict(byte_level, use_regex=False)]}):
        with pytest.raises(ModelError, match="pre-tokenizer"):
            pre_tokenizer_name({"pre_tokenizer": other}, "f")
