"""base_model.json: which pretrained weights a LoRA run's adapters were trained on.

A LoRA checkpoint holds the adapters only; they mean something only on top of the base they
were trained with. The run folder records that base's fingerprint, and a resume against other
weights (another model, or the same folder after its files changed) is refused.

The fingerprint hashes, for every safetensors file, its name, size and header (every tensor's
name, dtype, shape and offsets), and 16 evenly spaced 1 MiB samples of its data. Reading all
16 GB of Llama-3-8B would take tens of seconds per start; the samples catch a fine-tuned
variant of the same architecture (fine-tuning changes every weight) in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cputrain.run_folder.layout import RunFolder
from cputrain.errors import RunFolderError

NAME = "base_model.json"
SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 2**20


def fingerprint(folder: Path) -> str:
    from cputrain.model import safetensors_files

    digest = hashlib.sha256()
    for path in safetensors_files(folder):
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f"{path.name}:{size}:".encode())
            digest.update(f.read(header_len))
            data_start, data_len = 8 + header_len, size - 8 - header_len
            if data_len <= SAMPLES_PER_FILE * SAMPLE_BYTES:  # a small model: all of it
                digest.update(f.read())
                continue
            for i in range(SAMPLES_PER_FILE):  # first and last MiB, and evenly between
                f.seek(data_start + (data_len - SAMPLE_BYTES) * i // (SAMPLES_PER_FILE - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return "sha256:" + digest.hexdigest()


def record(run: RunFolder, folder: Path) -> None:
    """Rank 0, when the run starts: the base's path and fingerprint."""
    run.write_text(json.dumps({"path": os.path.abspath(folder), "fingerprint": fingerprint(folder)}, indent=1) + "\n", NAME)


def check_same_base(run: RunFolder, name_or_path: str) -> None:
    """Refuse to continue a run folder's adapters on weights other than those they were trained
    on. Called before any data is prepared, so a refused resume costs no tokenizing."""
    text = run.read_text(NAME)
    if text is None or not run.complete_steps():
        return
    from cputrain.model import local_folder

    folder = local_folder(name_or_path)
    there = json.loads(text)
    now = fingerprint(folder)
    if there.get("fingerprint") != now:
        raise RunFolderError(
            f"output_dir '{run.url}' holds LoRA adapters trained on other base weights ({there.get('path')}, "
            f"{there.get('fingerprint', '?')[:19]}…; '{folder}' is {now[:19]}…); point model.name_or_path at the "
            "base they were trained on or choose a new output_dir"
        )
