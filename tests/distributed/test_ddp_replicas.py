"""DDP starts without broadcasting the weights, and refuses ranks whose weights differ.

Two real processes on gloo (loopback) build the ddp strategy as a run does: wrap the skeleton,
then load the model folder. Nothing is broadcast at wrap; ranks that read the same files agree
by fingerprint; a rank that reads another copy (one weight changed) stops both ranks with one
line naming that rank and the tensor.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from dist_helpers import free_port

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, folders: list[str], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    from cputrain.config.file import load_config
    from cputrain.errors import ModelError
    from cputrain.parallel.base import StrategyContext
    from cputrain.parallel.ddp import DDPStrategy

    broadcast_bytes = []
    original = dist._broadcast_coalesced
    dist._broadcast_coalesced = lambda pg, tensors, *a, **k: (  # what DDP's start-up sync goes through
        broadcast_bytes.append(sum(t.numel() * t.element_size() for t in tensors)), original(pg, tensors, *a, **k))[1]
    try:
        cfg = load_config(None, [f"model.name_or_path={folders[0]}", "parallel.strategy=ddp"])
        strategy = DDPStrategy(StrategyContext(cfg=cfg, rank=rank, world_size=2, compute_dtype=torch.float32))
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders[rank]))
        model = strategy.wrap(skeleton)
        try:
            strategy.load_weights(model, Path(folders[rank]))
            strategy.check_weights(model)
            outcome = "agreed"
        except ModelError as err:
            outcome = str(err)
        results[rank] = (outcome, sum(broadcast_bytes))
    finally:
        dist._broadcast_coalesced = original
        dist.destroy_process_group()


def _run(folders) -> dict:
    results = mp.Manager().dict()
    mp.start_processes(_rank, args=(free_port(), [str(f) for f in folders], results), nprocs=2, start_method="spawn")
    return dict(results)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    same = tiny_model_dir
    other = tmp_path_factory.mktemp("copy") / "base"
    shutil.copytree(same, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3  # one value of another copy differs
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    return same, other


def test_ranks_that_read_the_same_files_start_without_a_broadcast(folders):
    same, _ = folders
    results = _run([same, same])
    assert results == {0: ("agreed", 0), 1: ("agreed", 0)}  # no byte broadcast while the model was wrapped


def test_a_rank_with_other_weights_stops_every_rank_naming_it(folders):
    same, other = folders
    results = _run([same, other])
    for rank in (0, 1):
        message, broadcast = results[rank]
        assert broadcast == 0
        assert message.startswith("rank 1 (host ") and "1 tensor(s) differ (first: 'model.layers.1.mlp.up_proj.weight')" \
            in message, message
