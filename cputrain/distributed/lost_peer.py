"""A collective that failed because another rank is gone.

When a rank dies (SIGKILL, the OOM killer, its node lost), the kernel closes its sockets and
every other rank's next gloo collective fails with a connection error. Those ranks did nothing
wrong: they print one line instead of a traceback, and the agent's message names the rank that
failed first (distributed.agent). Recognised by gloo's own error text, since the exception type
is a plain RuntimeError (or DistBackendError) whatever the cause.
"""

from __future__ import annotations

from cputrain.errors import PeerLost

# What gloo's TCP transport says when the other end of a pair has gone away.
LOST_PEER_PHRASES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
)


def lost_peer_error(exc: BaseException, rank: int) -> PeerLost | None:
    """A one-line PeerLost for a collective that failed on a vanished peer, else None."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not any(phrase in text.lower() for phrase in LOST_PEER_PHRASES):
        return None
    detail = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return PeerLost(f"rank {rank} stopped: another rank is gone, its collective failed ({detail[:200]})")
