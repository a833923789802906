"""Two nodes that start together on a shared output_dir that does not exist yet both pass
preflight's check of it (cputrain.training.preflight.check_output_dir).

Each node's check creates the missing folder, writes a probe file in it and removes both again.
The race: node A removes the folder it created after node B's mkdir (which found it there) and
before B's probe write, so B's write fails on a folder that is gone. Two real processes on one
file system meet exactly there, every time: A's clean-up waits until B has made the folder, and
B's write until A is done. That is the namespace cluster's case without its network (the nodes
share the run folder's file system, and nothing else of preflight's check crosses between them),
in about a second instead of two agents' start."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes (forked, no cputrain command)


def _node_a(folder: str, b_has_made_it, a_done, errors) -> None:
    from cputrain.training import preflight

    rmdir = Path.rmdir

    def rmdir_after_b(self):
        b_has_made_it.wait(10)
        rmdir(self)

    Path.rmdir = rmdir_after_b
    try:
        preflight.check_output_dir(folder)
    except Exception as exc:  # reported to the test: it runs in its own process
        errors.put(f"node A: {exc}")
    finally:
        a_done.set()


def _node_b(folder: str, a_made_it, b_has_made_it, a_done, errors) -> None:
    from cputrain.training import preflight

    a_made_it.wait(10)  # A found it missing and made it: B's mkdir finds it there
    write_bytes, first = Path.write_bytes, [True]

    def write_after_a(self, data):
        if first[0]:
            first[0] = False
            b_has_made_it.set()
            a_done.wait(10)  # A has removed it by now
        return write_bytes(self, data)

    Path.write_bytes = write_after_a
    try:
        preflight.check_output_dir(folder)
    except Exception as exc:
        errors.put(f"node B: {exc}")


def _a_makes_it_then_signals(folder: str, a_made_it, *rest) -> None:
    mkdir = Path.mkdir

    def mkdir_and_signal(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if str(self) == folder:
            a_made_it.set()

    Path.mkdir = mkdir_and_signal
    _node_a(folder, *rest)


def test_two_nodes_creating_one_missing_output_dir_at_once_both_pass(tmp_path):
    ctx = multiprocessing.get_context("fork")
    folder = str(tmp_path / "shared" / "run")
    a_made_it, b_has_made_it, a_done, errors = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    nodes = [ctx.Process(target=_a_makes_it_then_signals, args=(folder, a_made_it, b_has_made_it, a_done, errors)),
             ctx.Process(target=_node_b, args=(folder, a_made_it, b_has_made_it, a_done, errors))]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join(30)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == [] and [node.exitcode for node in nodes] == [0, 0], found
    assert not (tmp_path / "shared").exists()  # and neither leaves a folder behind
