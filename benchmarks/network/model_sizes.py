"""The models the network page's runs train, as `cputrain train` overrides: one size for the
figures, one tiny for --quick."""

from __future__ import annotations

# ~34M parameters: 8 blocks of hidden 512 (25M) and a tied 16k × 512 embedding (8M).
MODEL_34M = ["model.arch.hidden_size=512", "model.arch.intermediate_size=1376", "model.arch.num_hidden_layers=8",
             "model.arch.num_attention_heads=8", "model.arch.num_key_value_heads=8",
             "model.tokenizer_vocab_size=16384"]
MODEL_TINY = ["model.arch.hidden_size=64", "model.arch.intermediate_size=128", "model.arch.num_hidden_layers=2",
              "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=2", "model.tokenizer_vocab_size=512"]
