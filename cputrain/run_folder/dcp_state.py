"""Model and optimizer state through torch.distributed.checkpoint (DCP).

DCP writes each rank's shards once and re-shards on load, so a checkpoint saved by 2 ranks
loads on 1 or 4, and the same calls serve the single, DDP and FSDP strategies.
get_state_dict/set_state_dict turn any of those models into plain fully-qualified names.
"""

from __future__ import annotations

from typing import Protocol

import fsspec
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


def _storage(path: str, write: bool):
    protocol = fsspec.core.url_to_fs(path)[0].protocol
    protocol = protocol[0] if isinstance(protocol, tuple) else protocol
    if protocol in ("file", "local"):
        local = fsspec.core.url_to_fs(path)[1]
        return dcp.FileSystemWriter(local) if write else dcp.FileSystemReader(local)
    # Not re-exported from torch.distributed.checkpoint in torch 2.13: the module is the API.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter(path) if write else FsspecReader(path)


# Frozen parameters are never saved: they are the base model's weights, read again from its
# files when a run resumes (a LoRA checkpoint is then the adapters and their optimizer state).
# With every parameter trained this changes nothing.
SAVED = StateDictOptions(ignore_frozen_params=True)


def _trained_state(model, optimizer) -> tuple[dict, dict]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=SAVED)
    # ignore_frozen_params knows each parameter by one name; a tied one (Llama's lm_head.weight is
    # the frozen input embedding when tie_word_embeddings) comes back under its other name.
    module = getattr(model, "module", model)  # DDP's wrapper; FSDP2 and compile keep the names
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def save_dcp(model, optimizer, path: str) -> None:
    model_sd, optim_sd = _trained_state(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_storage(path, write=True))


def read_dcp_metadata(path: str):
    """The checkpoint's DCP Metadata (which file holds which bytes of which tensor), read without
    loading a tensor."""
    return _storage(path, write=False).read_metadata()


def load_dcp(model, optimizer, path: str) -> None:
    model_sd, optim_sd = _trained_state(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    # dcp.load fails on any key of `state` the checkpoint lacks (its planner allows no partial
    # load), so every trained parameter is checked there; set_state_dict then must not ask for
    # the frozen ones, which were never saved.
    dcp.load(state, storage_reader=_storage(path, write=False))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False, ignore_frozen_params=True),
    )


class CheckpointState(Protocol):
    """What a strategy hands the checkpoint object: state it can save to and load from a folder."""

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...


class DCPState:
    """Model and optimizer state of the single, DDP and FSDP strategies, through DCP."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def save(self, path: str) -> None:
        save_dcp(self.model, self.optimizer, path)

    def load(self, path: str) -> None:
        load_dcp(self.model, self.optimizer, path)
