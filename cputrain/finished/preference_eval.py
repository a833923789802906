"""`cputrain eval` on a run trained with a preference objective: its objective's loss and TRL's
figures on held-out data. DPO and SimPO on pairs (reward accuracy, mean margin, rewards and
log-probabilities of chosen and rejected), KTO on labelled answers (rewards and log-probabilities
of the desirable and undesirable ones, the KL estimate), a reward model on pairs (accuracy, mean
margin, mean reward).

The figures are the ones the trainer logs at validation (eval_…), computed the same way. DPO's
and KTO's reference is the run's starting model: the LoRA base with the adapters off (peft's
disable_adapter) or, for full weights, the model folder the run started from (model.name_or_path),
whose log-probabilities are computed first and the model freed before the trained one is loaded
(never two full models in memory); SimPO and the reward model need none.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import torch

from cputrain.errors import DataError, ModelError
from cputrain.objectives.objective import objective_class, objective_for


def require_reference(path: str, cfg) -> None:
    """Before any data or model is read: a full-weight DPO or KTO run's reference is the model
    folder it started from, which a run trained from random weights does not have."""
    from cputrain.finished.load import model_folder
    from cputrain.lora.adapter_folder import is_adapter_folder

    if not objective_class(cfg.train.objective).stores_reference or is_adapter_folder(Path(model_folder(path))):
        return  # no reference, or the LoRA base under the adapters (the adapter folder names it)
    if not cfg.model.name_or_path:
        raise ModelError(f"this {cfg.train.objective.upper()} run trained from random weights (model.name_or_path is "
                         "empty), so its reference cannot be loaded to score its data; evaluate a run that started "
                         "from a model folder")
    try:
        model_folder(cfg.model.name_or_path)
    except ModelError:
        raise ModelError(f"this {cfg.train.objective.upper()} run's reference is the model it started from, "
                         f"model.name_or_path='{cfg.model.name_or_path}', which holds no model on this machine; "
                         "put it back there, or name where it is now: cputrain eval "
                         f"{path} model.name_or_path=FOLDER") from None


def evaluate_pairs(path: str, cfg, rows, max_rows: int, equip=None) -> dict:
    """The objective's loss and TRL's figures, means over the pairs (KTO: examples) of the first
    `max_rows` rows (the caller has checked require_reference before reading the data).
    `equip(objective, tokenizer)`: what the caller hands the objective before it runs (online RL:
    its reward functions, built above this layer)."""
    from cputrain.finished.load import load_for_inference, model_folder
    from cputrain.lora.adapter_folder import is_adapter_folder

    n = min(len(rows), max_rows)
    if n == 0:
        raise DataError(f"the dataset has no {objective_class(cfg.train.objective).item_described} to evaluate; "
                        "use more records, a longer data.seq_len or --split train")
    indices, micro_batch = np.arange(n), cfg.train.micro_batch_size
    # the run's precision, as the trainer's validation: bf16 autocast over fp32 weights
    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.hardware.precision == "bf16")

    adapters = is_adapter_folder(Path(model_folder(path)))
    objective = objective_for(cfg.train, (lambda model: model.disable_adapter()) if adapters else None)
    reference = None
    rows.reference_logps = None
    if objective.stores_reference and not adapters:
        starting, _ = load_for_inference(cfg.model.name_or_path, cfg.model.trust_remote_code)
        rows.reference_logps = objective.reference_table(starting, rows, micro_batch, autocast, indices)
        reference = str(cfg.model.name_or_path)
        del starting
        gc.collect()
    policy, tokenizer = load_for_inference(path, cfg.model.trust_remote_code)
    if equip is not None:
        equip(objective, tokenizer)
    if objective.stores_reference and adapters:  # the base is under the adapters: run it with them off
        reference = "the LoRA base, adapters off"
        if not objective.live_reference:  # read from the rows' table (KTO: its KL sequences' too)
            with policy.disable_adapter():
                rows.reference_logps = objective.reference_table(policy, rows, micro_batch, autocast, indices)
    sums, items = objective.summed(policy, rows, indices, micro_batch, autocast)
    result = {"objective": cfg.train.objective, "loss": float(sums[0]) / max(items, 1)}
    result.update(objective.figures(sums[1:], items))
    result.update({objective.items_key: int(items), "rows": int(n), "reference": reference})
    return result
