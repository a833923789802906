"""Unpaired feedback: one answer with a thumbs-up or a thumbs-down, each a sequence with its answer trained."""
