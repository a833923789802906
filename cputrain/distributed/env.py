"""Who started this process, and the rank variables every library expects.

Training code reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
torchrun sets them all; mpirun sets its own names; plain `python` sets none, which is where
recipes die with KeyError: 'LOCAL_RANK'. `normalize()` maps whatever launcher we find onto the
torchrun names, filling the single-process values when there is no launcher at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cputrain.errors import ConfigError

# (rank, world size, local rank, local world size) as each MPI flavour spells them
_MPI_NAMES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # Intel MPI / MPICH (hydra)
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "torchrun", "mpirun" or "python"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def started_by_launcher(environ: dict | None = None) -> bool:
    """True when torchrun, mpirun or another launcher already made this process one rank of a group."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    return any(rank_k in env and size_k in env for rank_k, size_k, _, _ in _MPI_NAMES)


def normalize(environ: dict | None = None) -> RankEnv:
    """Read the launcher's variables, write the torchrun names into `environ`, return the ranks."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env else "env"
    else:
        launcher = "python"
        for rank_k, size_k, local_k, local_size_k in _MPI_NAMES:
            if rank_k in env and size_k in env:
                launcher = "mpirun"
                env["RANK"], env["WORLD_SIZE"] = env[rank_k], env[size_k]
                env.setdefault("LOCAL_RANK", env.get(local_k, env[rank_k]))
                env.setdefault("LOCAL_WORLD_SIZE", env.get(local_size_k, env[size_k]))
                if int(env["WORLD_SIZE"]) > int(env["LOCAL_WORLD_SIZE"]) and "MASTER_ADDR" not in env:
                    # mpirun does not say where rank 0 listens; 127.0.0.1 would leave the other
                    # nodes waiting for the process-group timeout instead of failing now.
                    raise ConfigError(
                        f"mpirun started {env['WORLD_SIZE']} ranks on several nodes but MASTER_ADDR is not set; "
                        "pass node 0's address: mpirun -x MASTER_ADDR=<node 0's address> -x MASTER_PORT=29500 ..."
                    )
                break
    # The single-process defaults: what torchrun would set for one rank on one node.
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"] if launcher == "python" else "1")
    env.setdefault("GROUP_RANK", env.get("NODE_RANK", "0"))
    env.setdefault("NODE_RANK", env["GROUP_RANK"])
    env.setdefault("MASTER_ADDR", env.get("PET_MASTER_ADDR", "127.0.0.1"))
    env.setdefault("MASTER_PORT", env.get("PET_MASTER_PORT", "29500"))
    return RankEnv(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env["LOCAL_WORLD_SIZE"]),
        launcher=launcher,
    )
