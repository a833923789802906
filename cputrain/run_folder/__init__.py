"""Step folders that count only once complete, sharded state through DCP, the final HF export."""
