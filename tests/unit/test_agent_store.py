"""The ranks of a restarted round meet under their own keys in the torchrun agent's store."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from cputrain.distributed.process_group import agent_store_of_this_round

TIMEOUT = datetime.timedelta(seconds=10)


def _agent_env(port: int, restart: int) -> dict:
    return {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(restart),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_a_restarted_round_does_not_see_the_previous_rounds_keys():
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=TIMEOUT)  # what the agent hosts
    first = agent_store_of_this_round(2, TIMEOUT, _agent_env(agent.port, 0))
    first.set("rank_1", "address of a rank that was then killed")
    again = agent_store_of_this_round(2, TIMEOUT, _agent_env(agent.port, 1))
    assert again.check(["rank_1"]) is False  # the restarted group would have dialled the dead address
    again.set("rank_1", "new address")
    assert first.get("rank_1") == b"address of a rank that was then killed"
    assert agent_store_of_this_round(2, TIMEOUT, _agent_env(agent.port, 1)).get("rank_1") == b"new address"


def test_without_the_agents_store_torch_makes_its_own():
    assert agent_store_of_this_round(2, TIMEOUT, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}) is None
    assert agent_store_of_this_round(2, TIMEOUT, {"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
