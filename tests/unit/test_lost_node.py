"""A lost node, in one line: which node a failed collective lost (gloo names only an address, or
nothing when it timed out), what the agent says when that node does not come back, and the
watch that ends a node whose rendezvous host is gone. The cases on two hosts are
tests/distributed/test_node_loss.py."""

from __future__ import annotations

import json

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from cputrain.config import Config
from cputrain.distributed.agent import _failure_message, _lost_before, _not_back
from cputrain.distributed.group_nodes import GroupNodes, RankHost
from cputrain.distributed.host_watch import HostWatch
from cputrain.distributed.lost_peer import lost_node_named, lost_peer_error

RESET = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:41234: Connection reset by peer. "
                     "This is typically caused by a remote worker hanging")
TIMED_OUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation "
                         "to complete")


def _two_nodes(this_node: int = 0, per_node: int = 1) -> GroupNodes:
    hosts = tuple(RankHost(node * per_node + local, node, f"10.0.0.{node + 1}", (f"10.0.0.{node + 1}", "172.17.0.1"))
                  for node in (0, 1) for local in range(per_node))
    return GroupNodes(this_node, hosts)


def test_a_reset_names_the_node_at_the_address_gloo_gives():
    lost = lost_peer_error(RESET, rank=0, nodes=_two_nodes())
    assert str(lost).startswith("rank 0 stopped: node 1 (10.0.0.2, rank 1) is gone, its collective failed (")
    assert lost_node_named(str(lost)) == (1, "node 1 (10.0.0.2, rank 1)")


def test_an_address_every_node_shares_names_no_node():
    shared = RuntimeError("Connection closed by peer [172.17.0.1]:5000")  # docker0 on both hosts
    assert "rank 0 stopped: another rank is gone" in str(lost_peer_error(shared, rank=0, nodes=_two_nodes()))
    assert "another rank is gone" in str(lost_peer_error(RESET, rank=0))  # one node: no table


def test_a_timeout_is_a_lost_peer_and_names_the_one_place_it_can_be():
    lost = lost_peer_error(TIMED_OUT, rank=1, nodes=_two_nodes(this_node=1))
    assert str(lost).startswith("rank 1 stopped: node 0 (10.0.0.1, rank 0) did not answer for 20 s (parallel.timeout_s)")
    # With a second rank on this node the silent one may be here too: both places are said.
    two_here = lost_peer_error(TIMED_OUT, rank=0, nodes=_two_nodes(per_node=2))
    assert "another rank (of node 1 (10.0.0.2, ranks 2–3) or this node) did not answer" in str(two_here)
    assert "another rank did not answer for 20 s" in str(lost_peer_error(TIMED_OUT, rank=0))


def test_the_line_says_the_group_restarts_while_restarts_are_left():
    assert "the group restarts once every node has rejoined (restart 1 of 2" in str(
        lost_peer_error(RESET, rank=0, nodes=_two_nodes(), restarts=(0, 2)))
    assert "restarts" not in str(lost_peer_error(RESET, rank=0, nodes=_two_nodes(), restarts=(2, 2)))


def _error_file(path, error: Exception, timestamp: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"message": {"message": f"{type(error).__name__}: {error}",
                                            "extraInfo": {"py_callstack": "", "timestamp": str(timestamp)}}}))
    return path


def test_without_restarts_the_agent_names_the_node_and_says_to_run_again(tmp_path):
    lost = lost_peer_error(RESET, rank=0, nodes=_two_nodes())
    failure = ProcessFailure(local_rank=0, pid=1000, exitcode=1,
                             error_file=str(_error_file(tmp_path / "error.json", lost, 100)))
    err = _failure_message(ChildFailedError("cputrain", {0: failure}))
    assert str(err).startswith("1 rank(s) failed; rank 0 first: rank 0 stopped: node 1 (10.0.0.2, rank 1) is gone")
    assert "run the same command on every node to resume from the newest checkpoint" in str(err)
    assert err.exit_code == 1


def test_a_restart_whose_node_does_not_come_back_names_it(tmp_path):
    # torchrun keeps each rank's error file under its log folder, one folder per restart.
    _error_file(tmp_path / "run_x" / "attempt_0" / "0" / "error.json",
                lost_peer_error(TIMED_OUT, rank=0, nodes=_two_nodes()), 100)
    lost = _lost_before(str(tmp_path))
    err = _not_back(lost, Config.model_validate({"launch": {"rdzv_timeout_s": 20}}))
    assert str(err).startswith("node 1 (10.0.0.2, rank 1) was lost (rank 0 stopped) and did not rejoin within 20s "
                               "(launch.rdzv_timeout_s) of the restart")
    assert "--node-rank 1" in str(err) and err.exit_code == 2
    assert _lost_before(str(tmp_path / "nothing-here")) is None


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_host_watch_ends_a_node_only_after_its_ranks_ran_and_the_host_stayed_silent():
    clock, running, answers = _Clock(), [False], [False]
    watch = HostWatch("10.0.0.1", 29500, patience_s=20, answers=lambda: answers[0], running=lambda: running[0],
                      clock=clock)
    clock.now = 100
    assert not watch.lost()  # no rank has run yet: the first rendezvous is torch's to time out
    running[0] = True
    assert not watch.lost()
    running[0] = False
    clock.now = 110
    assert not watch.lost()  # silent since 110
    clock.now = 125
    answers[0] = True
    assert not watch.lost()  # it answered: a restart's rendezvous, waiting
    answers[0] = False
    clock.now = 126
    assert not watch.lost()
    clock.now = 146
    assert watch.lost()  # silent for 20 s with no rank here
    assert "the rendezvous host 10.0.0.1:29500 (node 0) has not answered for 20 s" in watch.message()
