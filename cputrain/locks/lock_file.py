"""The few atomic file operations a lock needs, on a local path and on an fsspec URL.

    create      make it only if it does not exist     local: O_CREAT|O_EXCL         fsspec: mode "xb"
    read        its bytes (None: no file)
    modified_s  its modification time (judges a record that names no heartbeat)
    replace     swap in new content whole             local: temp + rename          fsspec: one put
    remove_if   delete it only if it holds given bytes local: rename aside, check   fsspec: look, delete
    remove      delete it

O_CREAT|O_EXCL is atomic on a local disk, on NFSv3 and later and on Lustre (FSx for Lustre), so
of two runs creating the lock at once exactly one succeeds. On an object store there is no
rename and exclusive creation is the backend's: s3fs's "xb" is a conditional put
(If-None-Match), atomic; a backend that emulates "xb" by looking first leaves a window of one
round trip in which two runs can both create it. The lock reads its file back after creating
it, and the heartbeat keeps checking that the file is still its own, so the run that lost such
a race stops at its next heartbeat instead of writing beside the other.
"""

from __future__ import annotations

import os
import uuid


class LocalLockFile:
    def __init__(self, path: str):
        self.path = path
        self.made: list[str] = []  # folders this lock created, deepest first

    def create(self, data: bytes) -> bool:
        folder = os.path.abspath(os.path.dirname(self.path) or ".")
        missing = []
        while not os.path.exists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        # Only the creator of the lock owns the folders made for it (a loser of the race owns none).
        self.made = self.made or missing
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def modified_s(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None

    def replace(self, data: bytes, tag: str) -> None:
        tmp = f"{self.path}.{tag}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)  # a reader sees the old content or the new, never a part

    def remove_if(self, data: bytes) -> bool:
        """Remove the file only if it still holds `data` (a holder judged stale). The file is moved
        aside atomically first, so of several processes that judged it stale only one removes it;
        a fresh lock moved aside by a late one is put back."""
        aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        with open(aside, "rb") as f:
            moved = f.read()
        if moved != data:
            try:
                os.link(aside, self.path)  # back where it was, unless a newer lock is there already
            except FileExistsError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)
        self._remove_made_folders()
        return True

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._remove_made_folders()

    def _remove_made_folders(self) -> None:
        # A run refused before it wrote anything (bad data, say) leaves no empty run folder.
        for folder in self.made:
            try:
                os.rmdir(folder)
            except OSError:
                break  # the run wrote files there, or another run did
        self.made = []


class FsspecLockFile:
    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def create(self, data: bytes) -> bool:
        try:
            with self.fs.open(self.path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except (NotImplementedError, ValueError):  # no exclusive mode here: look, then write
            if self.fs.exists(self.path):
                return False
            self.fs.pipe_file(self.path, data)
        return True

    def read(self) -> bytes | None:
        try:
            return self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None

    def modified_s(self) -> float | None:
        try:
            return self.fs.modified(self.path).timestamp()
        except Exception:  # not every backend keeps a time
            return None

    def replace(self, data: bytes, tag: str) -> None:
        self.fs.pipe_file(self.path, data)  # one object put: whole or not at all

    def remove_if(self, data: bytes) -> bool:
        """Remove the file only if it still holds `data`. An object store has no rename: this looks,
        then deletes, leaving a window of one round trip (the heartbeat catches what slips through)."""
        if self.read() != data:
            return False
        self.remove()
        return True

    def remove(self) -> None:
        try:
            self.fs.rm(self.path)
        except FileNotFoundError:
            pass

