"""What the suite's test processes build once and share: the data and tokenizer cache, the tiny
model folders, the reference runs. Under pytest-xdist each worker is a process of its own, and a
session fixture would build its folder once per worker; here the first worker to ask builds it,
under a file lock, in a folder of the whole run, and the other reads it.

The folder of the run is the parent of the workers' base temp folders (xdist gives each worker
`<the run's base>/popen-gwN`), or the session's own base folder with one process. The session
that started the workers removes it at its end (`remove_shared_root`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

SHARED_FOLDER = "shared-builds"


def shared_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / SHARED_FOLDER
    root.mkdir(exist_ok=True)
    return root


def built_once(root: Path, kind: str, key, build: Callable[[Path], None]) -> Path:
    """The folder `root/kind/<key's hash>`, made by `build(folder)` in the first process to ask
    (the others wait on its lock). A build that raised leaves no folder behind, and the next
    caller tries again."""
    from filelock import FileLock

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = root / kind / digest
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        done = folder.with_name(digest + ".done")
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


def remove_shared_root(config) -> None:
    """At the end of the session that started the workers (or of a one-process session)."""
    if hasattr(config, "workerinput"):
        return
    # pytest keeps the factory and its base folder under private names: where a version renames
    # them, the folder stays (pytest removes base folders older than its last three)
    base = getattr(getattr(config, "_tmp_path_factory", None), "_basetemp", None)
    if base is not None:
        shutil.rmtree(base / SHARED_FOLDER, ignore_errors=True)
