"""A collective that failed because another rank is gone, or silent for the group's timeout.

When a rank dies (SIGKILL, the OOM killer, its pod deleted), the kernel closes its sockets and
every other rank's next gloo collective fails with a connection error. When its node vanishes
(powered off, its network gone), nothing closes: the others wait in the collective until
parallel.timeout_s and gloo gives up with a timeout. Either way those ranks did nothing wrong:
they print one line instead of a traceback, naming the lost node where the group spans several
(distributed.group_nodes), and the agent's message names the rank that failed first
(distributed.agent). Recognised by gloo's own error text, since the exception type is a plain
RuntimeError (or DistBackendError) whatever the cause.
"""

from __future__ import annotations

import re

from cputrain.distributed.group_nodes import GroupNodes
from cputrain.errors import PeerLost

# What gloo's TCP transport says when the other end of a pair has gone away.
LOST_PEER_PHRASES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
)
# gloo's unbound_buffer.cc: "Timed out waiting 20000ms for recv operation to complete".
TIMED_OUT = re.compile(r"timed out waiting (\d+)\s*ms for (?:send|recv) operation", re.IGNORECASE)
# How a PeerLost line names a node (GroupNodes.describe): "node 1 (10.0.0.2, rank 1)".
NODE_NAMED = re.compile(r"node (\d+) \([^()]*\)")
# gloo's pair.cc names the peer as "[10.0.0.2]:41234" (an IPv6 address inside the brackets too).
PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_peer_error(exc: BaseException, rank: int, nodes: GroupNodes | None = None,
                    restarts: tuple[int, int] | None = None) -> PeerLost | None:
    """A one-line PeerLost for a collective that failed on a vanished or silent peer, else None.
    `nodes` (the group's table, where it spans several nodes) lets the line name the node;
    `restarts` (the agent's restarts made, and allowed: launch.max_restarts) lets it say that the
    group restarts."""
    text = str(exc)
    if not isinstance(exc, RuntimeError):
        return None
    timed_out = TIMED_OUT.search(text)
    if not timed_out and not any(phrase in text.lower() for phrase in LOST_PEER_PHRASES):
        return None
    detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if timed_out:
        seconds = int(timed_out.group(1)) / 1000
        what = (f"{_silent_peer(nodes)} did not answer for {seconds:g} s (parallel.timeout_s): it is gone, its "
                f"network is down, or it is slower than that ({detail[:200]})")
    else:
        what = f"{_gone_peer(text, nodes)} is gone, its collective failed ({detail[:200]})"
    after = ""
    if restarts is not None and restarts[0] < restarts[1]:
        after = (f"; the group restarts once every node has rejoined (restart {restarts[0] + 1} of {restarts[1]}, "
                 "launch.max_restarts) and resumes from the newest checkpoint")
    return PeerLost(f"rank {rank} stopped: {what}{after}")


def lost_node_named(message: str) -> tuple[int, str] | None:
    """The node a PeerLost line names, as (its node rank, "node 1 (10.0.0.2, rank 1)"), or None."""
    found = NODE_NAMED.search(message)
    return (int(found.group(1)), found.group(0)) if found else None


def _gone_peer(text: str, nodes: GroupNodes | None) -> str:
    if nodes is not None:
        for address in PEER_ADDRESS.findall(text):
            node = nodes.node_at(address)
            if node is not None:
                return nodes.describe(node)
    return "another rank"


def _silent_peer(nodes: GroupNodes | None) -> str:
    """gloo's timeout does not say whom it waited for: the one place the silent rank can be, or
    every place it can."""
    if nodes is None:
        return "another rank"
    places = [nodes.describe(n) for n in nodes.other_nodes()]
    if len(nodes.ranks_of(nodes.this_node)) > 1:
        places.append("this node")
    if len(places) == 1 and places[0] != "this node":
        return places[0]
    return f"another rank (of {' or '.join(places)})"
