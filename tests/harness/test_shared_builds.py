"""built_once: the first caller builds, the others wait on its lock and read the same folder; a
build that raised leaves nothing behind, and the next caller builds again."""

from __future__ import annotations

import threading
import time

import pytest

from harness.shared_builds import built_once


def test_two_callers_at_once_build_once(tmp_path):
    builds: list[int] = []

    def build(folder):
        builds.append(1)
        time.sleep(0.2)  # long enough that the other caller arrives while this one holds the lock
        (folder / "made").write_text("x")

    folders = []
    callers = [threading.Thread(target=lambda: folders.append(built_once(tmp_path, "kind", {"a": 1}, build)))
               for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert len(builds) == 1 and len(folders) == 2 and folders[0] == folders[1]
    assert (folders[0] / "made").read_text() == "x"
    assert built_once(tmp_path, "kind", {"a": 2}, build) != folders[0] and len(builds) == 2  # another key


def test_a_failed_build_leaves_nothing_and_is_tried_again(tmp_path):
    def broken(folder):
        (folder / "half").write_text("x")
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError, match="build failed"):
        built_once(tmp_path, "kind", "k", broken)
    assert [p.name for p in (tmp_path / "kind").iterdir() if not p.name.endswith(".lock")] == []
    folder = built_once(tmp_path, "kind", "k", lambda f: (f / "whole").write_text("y"))
    assert sorted(p.name for p in folder.iterdir()) == ["whole"]
