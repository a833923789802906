"""This host's network addresses: the one on the route to another host, and all of them."""

from __future__ import annotations

import socket

import psutil


def route_address(host: str, port: int) -> str:
    """This host's address on the route to host:port (a UDP connect sends nothing), or the host
    name where there is no route. Other hosts reach this one there: the host name may resolve
    to an address they cannot reach (containers, several interfaces)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def host_addresses() -> tuple[str, ...]:
    """Every IPv4 and IPv6 address of this host's interfaces but loopback's: the address a peer
    connects from is one of them, whichever interface gloo chose."""
    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = entry.address.split("%", 1)[0]  # fe80::1%eth0: the zone is not part of the address
            if address.startswith("127.") or address == "::1":
                continue
            found.append(address)
    return tuple(dict.fromkeys(found))
