"""Is a complete-looking step folder whole? What a resume checks before it loads one.

A step folder is published by a rename once every file is written, so a killed save never
looks complete. What still happens is damage afterwards: a disk or a sync that lost a shard, a
truncated file, an emptied state file. Each is found here from the files alone, without
loading a tensor: DCP's .metadata names every shard file and the byte range of each tensor in
it; DeepSpeed's (zero3) state is checked for present, non-empty files.
"""

from __future__ import annotations

import json

from cputrain.run_folder.layout import RunFolder


def damage_of(run: RunFolder, step: int) -> str | None:
    """What is wrong with checkpoint `step`, in a few words; None when it is whole."""
    fs, folder = run.fs, run.step_path(step)
    try:
        state = json.loads(fs.cat_file(f"{folder}/trainer_state.json"))
    except (OSError, ValueError):
        return "trainer_state.json is unreadable"
    if not isinstance(state, dict) or state.get("step") != step:
        return "trainer_state.json does not name this step"
    state_dir = f"{folder}/state"
    if not fs.exists(state_dir):
        return "state/ is missing"
    if state.get("strategy") == "zero3":
        return _deepspeed_damage(fs, state_dir)
    return _dcp_damage(run, state_dir)


def _dcp_damage(run: RunFolder, state_dir: str) -> str | None:
    from cputrain.run_folder.dcp_state import read_dcp_metadata

    fs = run.fs
    if not fs.exists(f"{state_dir}/.metadata"):
        return "state/.metadata is missing"
    try:
        metadata = read_dcp_metadata(run.url_of(state_dir))
    except Exception as exc:  # a truncated or emptied pickle: EOFError, UnpicklingError, ...
        return f"state/.metadata is unreadable ({type(exc).__name__})"
    needed: dict[str, int] = {}  # shard file → bytes its tensors reach
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = f"{state_dir}/{name}"
        if not fs.exists(path):
            return f"state/{name} is missing"
        size = fs.size(path)
        if size < end:
            return f"state/{name} is truncated ({size:,} of at least {end:,} bytes)"
    return None


def _deepspeed_damage(fs, state_dir: str) -> str | None:
    files = [p for p in fs.find(state_dir) if not p.endswith("/")]
    if not files:
        return "state/ is empty"
    for path in files:
        if fs.size(path) == 0:
            return f"{path.rsplit('/state/', 1)[-1]} is empty"
    return None
