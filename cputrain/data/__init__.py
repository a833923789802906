"""Text in, packed token sequences out: sources → tokenizer → tokens (cached) → packed → rank shares."""
