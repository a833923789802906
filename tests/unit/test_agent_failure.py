"""The agent's one line names the rank that failed first, not one that only lost its peers."""

from __future__ import annotations

import json
import signal

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from cputrain.distributed.agent import _failure_message
from cputrain.distributed.lost_peer import lost_peer_error
from cputrain.errors import ConfigError


def _failure(tmp_path, rank: int, exitcode: int, error: Exception | None = None, timestamp: int = 100):
    error_file = tmp_path / f"error-{rank}.json"
    if error is not None:  # what ErrorHandler.record_exception writes in a rank
        error_file.write_text(json.dumps({"message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {"py_callstack": "", "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def _message(*failures):
    return _failure_message(ChildFailedError("cputrain", dict(enumerate(failures))))


def test_a_killed_rank_is_named_not_the_survivor_whose_collective_failed(tmp_path):
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40123")
    survivor = _failure(tmp_path, 0, 1, lost_peer_error(gloo, rank=0), timestamp=90)  # recorded before the kill was seen
    killed = _failure(tmp_path, 1, -signal.SIGKILL)
    err = _message(survivor, killed)
    assert str(err).startswith("2 rank(s) failed; rank 1 first: exited with SIGKILL (killed from outside")
    assert err.exit_code == 1


def test_a_cputrain_error_comes_before_a_rank_the_agent_terminated(tmp_path):
    stopped = _failure(tmp_path, 0, -signal.SIGTERM)
    bad = _failure(tmp_path, 1, 2, ConfigError("data.source 'x' not found; pass a file"))
    err = _message(stopped, bad)
    assert str(err) == "2 rank(s) failed; rank 1 first: data.source 'x' not found; pass a file"
    assert err.exit_code == 2


def test_among_ranks_that_failed_by_themselves_the_earliest_is_named(tmp_path):
    late = _failure(tmp_path, 0, 1, ValueError("late"), timestamp=200)
    early = _failure(tmp_path, 1, 1, ValueError("early"), timestamp=150)
    assert "rank 1 first: ValueError: early" in str(_message(late, early))


def test_lost_peer_is_recognised_only_for_connection_errors():
    assert lost_peer_error(RuntimeError("Connection reset by peer"), rank=3) is not None
    assert "rank 3 stopped: another rank is gone" in str(lost_peer_error(RuntimeError("Broken pipe"), rank=3))
    assert lost_peer_error(RuntimeError("shape mismatch: [4, 8] vs [8, 4]"), rank=0) is None
    assert lost_peer_error(ValueError("connection closed by peer"), rank=0) is None  # not a collective's error
