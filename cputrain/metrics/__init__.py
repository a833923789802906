"""What a run reports: tokens/s, MFU, memory, communication; as JSONL, a progress bar, plots."""
