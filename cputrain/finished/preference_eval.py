"""`cputrain eval` on a preference run: its objective's loss and TRL's figures (reward accuracy,
mean margin, rewards and log-probabilities of chosen and rejected) on held-out pairs.

The figures are the ones the trainer logs at validation (eval_rewards/…), computed the same way:
DPO's reference is the run's starting model, the LoRA base with the adapters off (peft's
disable_adapter) or, for full weights, the model folder the run started from (model.name_or_path),
whose log-probabilities are computed first and the model freed before the trained one is loaded
(never two full models in memory); SimPO needs none.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import torch

from cputrain.errors import DataError, ModelError
from cputrain.objectives.objective import PreferenceObjective, reference_table
from cputrain.objectives.preference_loss import STAT_NAMES


def require_reference(path: str, cfg) -> None:
    """Before any data or model is read: a full-weight DPO run's reference is the model folder it
    started from, which a run trained from random weights does not have."""
    from cputrain.finished.load import model_folder
    from cputrain.lora.adapter_folder import is_adapter_folder

    if cfg.train.objective == "dpo" and not cfg.model.name_or_path and not is_adapter_folder(Path(model_folder(path))):
        raise ModelError("this DPO run trained from random weights (model.name_or_path is empty), so its reference "
                         "cannot be loaded to score pairs; evaluate a run that started from a model folder")


def evaluate_pairs(path: str, cfg, rows, max_rows: int) -> dict:
    """The objective's loss and TRL's figures, means over the pairs of the first `max_rows` rows
    (the caller has checked require_reference before reading the data)."""
    from cputrain.finished.load import load_for_inference, model_folder
    from cputrain.lora.adapter_folder import is_adapter_folder

    n = min(len(rows), max_rows)
    if n == 0:
        raise DataError("the dataset has no preference pair to evaluate; use more pairs, a longer data.seq_len or "
                        "--split train")
    indices, micro_batch = np.arange(n), cfg.train.micro_batch_size
    # the run's precision, as the trainer's validation: bf16 autocast over fp32 weights
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.hardware.precision == "bf16")

    adapters = is_adapter_folder(Path(model_folder(path)))
    dpo = cfg.train.objective == "dpo"
    reference = None
    rows.reference_logps = None
    if dpo and not adapters:
        starting, _ = load_for_inference(cfg.model.name_or_path, cfg.model.trust_remote_code)
        rows.reference_logps = reference_table(starting, rows, micro_batch, autocast, indices)
        reference = str(cfg.model.name_or_path)
        del starting
        gc.collect()
    policy, _ = load_for_inference(path, cfg.model.trust_remote_code)
    if dpo and adapters:  # the base is under the adapters: run it with them off, pair by pair
        reference = "the LoRA base, adapters off"
    objective = PreferenceObjective(cfg.train, (lambda model: model.disable_adapter()) if adapters else None)
    sums, pairs = objective.summed(policy, rows, indices, micro_batch, autocast)
    result = {"objective": cfg.train.objective, "loss": float(sums[0]) / max(pairs, 1)}
    result.update({name: float(v) / max(pairs, 1) for name, v in zip(STAT_NAMES, sums[1:])})
    result.update({"pairs": int(pairs), "rows": int(n), "reference": reference})
    return result
