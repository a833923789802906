"""cputrain: train and fine-tune Hugging Face causal language models on CPUs."""

__version__ = "0.1.0"
