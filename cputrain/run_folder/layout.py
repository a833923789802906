"""The run folder's checkpoint layout and its completion rule.

    checkpoints/step-000100/        complete: renamed from .tmp only after every file is written
    checkpoints/step-000200.tmp/    being written (or abandoned by a kill): never loaded

Paths may be fsspec URLs (s3://…, a mounted FSx path, file://…), so the same code serves a
laptop and a cluster with shared storage. A rename on object stores is a copy + delete, but a
folder without the `.tmp` suffix is still only ever one that was complete.
"""

from __future__ import annotations

import re

import fsspec

STEP_RE = re.compile(r"step-(\d{6,})$")


class RunFolder:
    def __init__(self, url: str):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.url = url

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def url_of(self, path: str) -> str:
        """A path of this folder as a full URL, for code that opens it by URL (DCP, DeepSpeed):
        without the protocol, `bucket/run/...` would be written to the local disk."""
        return self.fs.unstrip_protocol(path)

    @property
    def checkpoints(self) -> str:
        return self.path("checkpoints")

    def step_path(self, step: int, tmp: bool = False) -> str:
        return self.path("checkpoints", f"step-{step:06d}" + (".tmp" if tmp else ""))

    def complete_steps(self) -> list[int]:
        if not self.fs.exists(self.checkpoints):
            return []
        steps = []
        for entry in self.fs.ls(self.checkpoints, detail=False):
            m = STEP_RE.search(entry.rstrip("/"))
            if m and self.fs.exists(f"{entry.rstrip('/')}/trainer_state.json"):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def newest_complete(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def commit(self, step: int) -> None:
        """Publish a fully written step folder under its final name."""
        tmp, final = self.step_path(step, tmp=True), self.step_path(step)
        if self.fs.exists(final):  # the same step saved again after a restart
            self.fs.rm(final, recursive=True)
        self.fs.mv(tmp, final, recursive=True)

    def set_aside(self, step: int, why: str = "damaged") -> str:
        """Rename a step folder to step-N.damaged (or .diverged; …-2, … if taken): never loaded,
        never pruned, kept for whoever wants to look at it. Returns the new path."""
        base = self.step_path(step) + f".{why}"
        target, n = base, 1
        while self.fs.exists(target):
            n += 1
            target = f"{base}-{n}"
        self.fs.mv(self.step_path(step), target, recursive=True)
        return target

    def prune(self, keep_last: int, keep: int | None = None) -> None:
        """Remove all but the last `keep_last` complete step folders, and never step `keep`."""
        for step in self.complete_steps()[:-keep_last]:
            if step != keep:
                self.fs.rm(self.step_path(step), recursive=True)
        # Leftovers of a save that was killed mid-write are never loaded; tidy them away.
        if self.fs.exists(self.checkpoints):
            for entry in self.fs.ls(self.checkpoints, detail=False):
                if entry.rstrip("/").endswith(".tmp"):
                    self.fs.rm(entry, recursive=True)

    def read_text(self, *parts: str) -> str | None:
        p = self.path(*parts)
        return self.fs.cat_file(p).decode() if self.fs.exists(p) else None

    def write_text(self, text: str, *parts: str) -> None:
        p = self.path(*parts)
        self.fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(p, "w") as f:
            f.write(text)

    def replace_text(self, text: str, *parts: str) -> None:
        """Write a file whole under a temporary name, then rename it over the old one: a kill
        leaves the old content or the new (a rename is atomic on a local or NFS/Lustre path)."""
        tmp = self.path(*parts) + ".tmp"
        self.write_text(text, *parts[:-1], parts[-1] + ".tmp")
        self.fs.mv(tmp, self.path(*parts))

    def local_path(self) -> str | None:
        """The plain directory behind the URL, when it is on this machine."""
        return self.root if "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)) else None
