"""Launcher variables mapped onto RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE."""

from __future__ import annotations

import pytest

from cputrain.distributed.env import normalize, started_by_launcher
from cputrain.distributed.agent import pet_overrides
from cputrain.errors import ConfigError


def test_plain_python_gets_every_variable_a_library_reads():
    env: dict = {}
    ranks = normalize(env)
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.launcher) == (0, 1, 0, "python")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        assert key in env
    assert not started_by_launcher({})


def test_openmpi_variables_become_torchrun_names():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    assert started_by_launcher(env)
    ranks = normalize(env)
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.local_world_size, ranks.launcher) == (3, 4, 1, 2, "mpirun")
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1"


def test_mpirun_over_several_nodes_needs_master_addr():
    """Without MASTER_ADDR the ranks of other nodes would dial 127.0.0.1 and hang until the timeout."""
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set.*-x MASTER_ADDR="):
        normalize(env)
    one_node = {**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    assert normalize(one_node).world_size == 4 and one_node["MASTER_ADDR"] == "127.0.0.1"


def test_intel_mpi_variables():
    ranks = normalize({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.launcher) == (1, 2, 1, "mpirun")


def test_pet_variables_as_kubeflow_sets_them():
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "trainer-0",
           "PET_MASTER_PORT": "29400"}
    assert pet_overrides(env) == ["launch.nnodes=2", "launch.nproc_per_node=4", "launch.node_rank=1",
                                  "launch.rdzv_endpoint=trainer-0:29400"]
    with pytest.raises(ConfigError, match="PET_NNODES"):
        pet_overrides({"PET_NNODES": "1:4"})


def test_rank_variables_no_launcher_set_are_named():
    from cputrain.distributed.env_check import check_rank_variables

    check_rank_variables({})  # plain python
    check_rank_variables({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})  # one process, labelled
    check_rank_variables({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})  # torchrun's own ranks
    check_rank_variables({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "WORLD_SIZE": "2"})
    complete = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    check_rank_variables(complete)  # started by hand, every variable there
    for env, expected in [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"),
        ({**complete, "LOCAL_RANK": ""}, "LOCAL_RANK='' must be a whole number"),
        ({k: v for k, v in complete.items() if k != "LOCAL_RANK"}, "but LOCAL_RANK is not"),
        ({"RANK": "1"}, "one process can only be rank 0"),
        ({"LOCAL_RANK": "3"}, "LOCAL_RANK=3 is set"),
        ({**complete, "RANK": "2"}, "RANK must be below WORLD_SIZE"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' must be a whole number"),
    ]:
        with pytest.raises(ConfigError) as err:
            check_rank_variables(env)
        assert expected in str(err.value), (env, str(err.value))
