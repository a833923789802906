"""The products a training step's ceiling is timed from (benchmarks/vs_hf_trainer/step_ceiling.py) are the model's:
one forward, input-grad and weight-grad product per linear layer of the transformers model built
from the same arch, of that layer's shape, adding up to 6 × its matrix parameters × tokens."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from cputrain.metrics.step_gemms import step_gemms, total_flops
from cputrain.model.skeleton import parameter_counts

# Every dimension different (hidden 48, intermediate 80, key/value width 2 × 12 = 24, vocabulary
# 120, 3 × 12 = 36 tokens), so a product with two sides swapped has a shape no layer has.
ARCH = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
VOCAB, MICRO_BATCH, SEQ_LEN = 120, 3, 12


def meta_model(arch: dict, vocab_size: int):
    """The model as benchmarks/vs_hf_trainer/vs_hf_trainer.py builds it, on the meta device (shapes, no storage)."""
    config = CONFIG_MAPPING[arch["model_type"]](**{k: v for k, v in arch.items() if k != "model_type"},
                                                vocab_size=vocab_size, pad_token_id=0)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_products_are_the_models_linear_layers(tied):
    arch = {**ARCH, "tie_word_embeddings": tied}
    model = meta_model(arch, VOCAB)
    tokens = MICRO_BATCH * SEQ_LEN
    expected = Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            assert module.bias is None
            fan_out, fan_in = module.weight.shape
            expected.update([(tokens, fan_in, fan_out), (tokens, fan_out, fan_in), (fan_in, tokens, fan_out)])
    listed = Counter()
    for gemm in step_gemms(arch, VOCAB, MICRO_BATCH, SEQ_LEN):
        listed[(gemm.m, gemm.k, gemm.n)] += gemm.count
    assert listed == expected

    # 6·N·T with N cputrain's non-embedding count less the norm weights (vectors: no product)
    counts = parameter_counts(model)
    norm_weights = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert norm_weights == (2 * arch["num_hidden_layers"] + 1) * arch["hidden_size"]
    matrix_parameters = counts["non_embedding"] - norm_weights
    assert total_flops(step_gemms(arch, VOCAB, MICRO_BATCH, SEQ_LEN)) == 6 * matrix_parameters * tokens
