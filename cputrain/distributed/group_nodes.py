"""Which node each rank of a group spanning several nodes runs on, learnt once the group forms.

gloo's error for a lost peer names an address ("Read error [10.0.0.2]:41234: Connection reset
by peer") and its timeout names nothing; the user knows their nodes by `--node-rank`. Each rank
tells the others its node and its host's addresses in one small all-gather right after the
process group forms; a collective that fails later (distributed.lost_peer) names the node from
that. A process belongs to one group: the table is kept for it here, read on the error path.
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.distributed.addresses import host_addresses, route_address


@dataclass(frozen=True)
class RankHost:
    rank: int
    node_rank: int  # launch.node_rank of the node that started this rank
    address: str  # the host's address on the route to MASTER_ADDR: where the other nodes reach it
    addresses: tuple[str, ...]  # every address of the host's interfaces


@dataclass(frozen=True)
class GroupNodes:
    this_node: int
    hosts: tuple[RankHost, ...]

    def nodes(self) -> list[int]:
        return sorted({h.node_rank for h in self.hosts})

    def other_nodes(self) -> list[int]:
        return [n for n in self.nodes() if n != self.this_node]

    def ranks_of(self, node_rank: int) -> list[int]:
        return sorted(h.rank for h in self.hosts if h.node_rank == node_rank)

    def address_of(self, node_rank: int) -> str:
        return next(h.address for h in self.hosts if h.node_rank == node_rank)

    def node_at(self, address: str) -> int | None:
        """The one other node with this address, or None: unknown, or held by several nodes (this
        one included, whose own ranks may be the peer), as a bridge every host has."""
        found = {h.node_rank for h in self.hosts if address == h.address or address in h.addresses}
        return found.pop() if len(found) == 1 and self.this_node not in found else None

    def describe(self, node_rank: int) -> str:
        """"node 1 (10.0.0.2, rank 1)": the user's node number, where it is and what ran there."""
        ranks = self.ranks_of(node_rank)
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}–{ranks[-1]}"
        return f"node {node_rank} ({self.address_of(node_rank)}, {which})"


_known: GroupNodes | None = None


def learn(node_rank: int, master_addr: str, master_port: int) -> GroupNodes:
    """Every rank's node and addresses, gathered once (a collective: every rank calls it)."""
    global _known
    import torch.distributed as dist

    from cputrain.distributed.process_group import all_gather_objects

    mine = RankHost(dist.get_rank(), node_rank, route_address(master_addr, master_port), host_addresses())
    _known = GroupNodes(node_rank, tuple(all_gather_objects(mine)))
    return _known


def known() -> GroupNodes | None:
    """The table of this process's group, if it spans several nodes and has formed."""
    return _known
