"""Examples: chat, prompt/completion and Alpaca records, each a sequence with its answers trained."""
