"""Rank variables that no launcher set: refused with one line before anything waits on them.

A WORLD_SIZE left over in a shell or a job spec makes a plain `cputrain train` wait forever for
ranks that never come; a RANK without the rest dials a rendezvous nobody hosts, and as rank 1
it logs nothing. torchrun (and cputrain's own agent) and mpirun set a complete set and mark
their processes; anything else is checked here: a process started by hand (or by a job spec)
as one of several ranks needs RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and
a rank other than 0 must reach MASTER_ADDR:MASTER_PORT, where rank 0 listens.
"""

from __future__ import annotations

import os
import socket
import time

from cputrain.distributed.env import _MPI_NAMES
from cputrain.errors import ConfigError

RANK_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
BY_HAND_NEEDS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
START_RANKS = "start the ranks with `cputrain train --nproc-per-node N` (or torchrun)"


def started_by_known_launcher(env) -> bool:
    """torchrun marks its ranks with TORCHELASTIC_RUN_ID; mpirun sets its own rank names."""
    return "TORCHELASTIC_RUN_ID" in env or any(r in env and s in env for r, s, _, _ in _MPI_NAMES)


def check_rank_variables(environ: dict | None = None) -> None:
    """Refuse rank variables that are partial, inconsistent or left over, naming each one."""
    env = os.environ if environ is None else environ
    if started_by_known_launcher(env):
        return
    given = {k: env[k] for k in RANK_NAMES if k in env}
    if not given:
        return  # plain `cputrain train`: one process
    for key, value in given.items():
        if not value.isdigit():
            raise ConfigError(f"{key}={value!r} must be a whole number (it is a rank variable; unset it for one process)")
    shown_names = [k for k in (*RANK_NAMES, "MASTER_ADDR", "MASTER_PORT") if k in env]
    shown = ", ".join(f"{k}={env[k]}" for k in shown_names) + (" is" if len(shown_names) == 1 else " are")
    world = int(given.get("WORLD_SIZE", "1"))
    if world <= 1:
        if int(given.get("RANK", "0")) == 0 and int(given.get("LOCAL_RANK", "0")) == 0:
            return  # the labels of one process, as torchrun would set them
        raise ConfigError(f"{shown} set but no launcher (torchrun, mpirun) started this process, and one "
                          f"process can only be rank 0: unset {', '.join(given)} to train in one process, "
                          f"or {START_RANKS}")
    missing = [k for k in BY_HAND_NEEDS if not env.get(k)]
    if missing:
        raise ConfigError(f"{shown} set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not, "
                          "and no launcher (torchrun, mpirun) started this process: unset "
                          f"{', '.join(given)} to train in one process, or {START_RANKS}")
    rank = int(env["RANK"])
    if rank >= world or int(env["LOCAL_RANK"]) > rank:
        raise ConfigError(f"{shown} set, but RANK must be below WORLD_SIZE and LOCAL_RANK at most RANK; "
                          f"fix the variables or {START_RANKS}")


def wait_for_master(timeout_s: float, environ: dict | None = None) -> None:
    """For a rank started by hand: MASTER_ADDR resolves and, from a rank other than 0, rank 0's
    port accepts within `timeout_s` (launch.rdzv_timeout_s) instead of the group's 10-minute wait."""
    env = os.environ if environ is None else environ
    if started_by_known_launcher(env) or int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    try:
        socket.getaddrinfo(addr, port)
    except OSError:
        raise ConfigError(f"MASTER_ADDR={addr} does not resolve to an address; set it to rank 0's host") from None
    if int(env["RANK"]) == 0:
        return  # rank 0 hosts the store there
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f"nothing answers at MASTER_ADDR:MASTER_PORT ({addr}:{port}) after {timeout_s:g}s "
                                  f"({exc.strerror or exc}); rank {env['RANK']} of {env['WORLD_SIZE']} was started "
                                  f"without a launcher: start rank 0 there, or {START_RANKS}") from None
            time.sleep(0.5)
