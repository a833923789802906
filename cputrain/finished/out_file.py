"""A file a command writes its result to (`score --out`): checked before any work (its folder
exists, it is no folder itself), then written beside itself and renamed once whole, so a failure
leaves neither a partial file nor a temporary one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from cputrain.errors import UserError


def check_out_file(out: Path, flag: str) -> None:
    """Refuse, in one line, a path that cannot take the file: before the work that fills it."""
    if out.is_dir():
        raise UserError(f"{flag} '{out}' is a folder; name a file, e.g. {flag} {out / 'out.jsonl'}")
    if not out.parent.is_dir():
        refuse_under_a_file(out, flag)
        raise UserError(f"{flag} '{out}': folder '{out.parent}' does not exist; create it or name another file")
    probe = _tmp_beside(out)
    try:  # a file made and removed: what os.access cannot tell (a read-only mount, a pseudo file system)
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"{flag} '{out}': folder '{out.parent}' cannot be written ({err.strerror}); name another "
                        "file") from None


def refuse_under_a_file(out: Path, flag: str) -> None:
    """A path whose nearest existing ancestor is a file: no folder can be made there."""
    existing = next(p for p in out.parents if p.exists())  # the last, '.' or '/', always does
    if existing.exists() and not existing.is_dir():
        raise UserError(f"{flag} '{out}': '{existing}' is a file, not a folder; name a path in a folder")


def _tmp_beside(out: Path) -> Path:
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def written_whole(out: Path) -> Iterator[TextIO]:
    """A text stream whose content becomes `out` only if the block ends without an error."""
    tmp = _tmp_beside(out)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yield f
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
