"""The environment a `cputrain` command starts with in the tests: the test's own, without a
launcher's rank variables, unbuffered and offline."""

from __future__ import annotations

import os

# What torchrun, mpirun or a pod set for a rank: a command a test starts is no rank of the test's.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    for key in LAUNCHER_VARIABLES:
        env.pop(key, None)
    env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    if "PYTEST_XDIST_WORKER" in os.environ:
        # Two tests share the 2 cores: OpenMP threads that spin while they wait (libgomp's default)
        # would take turns burning each other's time slices. Passive waiting changes no result.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update({k: str(v) for k, v in extra.items()})
    return env
