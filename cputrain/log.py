"""One logger for the whole tool; only rank 0 speaks unless something goes wrong."""

from __future__ import annotations

import logging
import os
import sys
import warnings

log = logging.getLogger("cputrain")


def setup_logging(rank: int = 0, verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    log.handlers[:] = [handler]
    log.propagate = False
    # Rank 0 tells the story; other ranks report only warnings and errors.
    log.setLevel(logging.DEBUG if verbose else logging.INFO if rank == 0 else logging.WARNING)
    logging.captureWarnings(True)
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.handlers[:] = [handler]
    py_warnings.propagate = False
    warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {msg}"
    # Libraries' own chatter (tokenizers fork warning, HF hub notices) is noise in training logs.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("datasets").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)
