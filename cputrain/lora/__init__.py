"""Low-rank adapters (LoRA) through the peft library: adding them to the model skeleton, and the
adapter folder a finished run exports (which peft.PeftModel.from_pretrained loads)."""
