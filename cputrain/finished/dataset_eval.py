"""`cputrain eval` on a dataset: a finished model's loss per trained target and perplexity, or,
for a run with a preference objective (DPO, SimPO, KTO, reward model), its objective's loss and
figures on held-out pairs or feedback."""

from __future__ import annotations

import logging

log = logging.getLogger("cputrain")


def evaluate_on_data(path: str, cfg, split: str, max_sequences: int, equip=None) -> dict:
    """The figures over the first `max_sequences` rows of `split` (the train split where the data
    has no validation rows), with the model folder, the data source and the split they came from.
    `cfg` is resolved for this machine, with what the data is (data.format, data.train_on);
    `equip(objective, tokenizer)`: what the objective is handed before it runs (evaluate_pairs)."""
    from cputrain.data.prepare import prepare, rows_of
    from cputrain.finished.load import load_for_inference, model_folder
    from cputrain.objectives.objective import objective_class
    from cputrain.objectives.validation_loss import evaluate_loss

    objective = objective_class(cfg.train.objective)
    _check_objective_fits(path, cfg, objective)
    preference = not objective.perplexity
    if preference:  # the models are loaded by evaluate_pairs, one after the other
        from cputrain.data.tokenizer import load_tokenizer
        from cputrain.finished.preference_eval import require_reference

        require_reference(path, cfg)
        model, tokenizer = None, load_tokenizer(model_folder(path), cfg.model.trust_remote_code)
    else:
        model, tokenizer = load_for_inference(path, cfg.model.trust_remote_code)
    _, data = prepare(cfg, tokenizer)
    used, note = split, None
    rows = rows_of(data, split)
    if split == "val" and len(rows) == 0:  # said in the result: figures on training rows are no validation
        used, rows = "train", rows_of(data, "train")
        note = ("the data has no validation rows (data.val_fraction, or every held-out record left out): these "
                "figures are on the training rows")
        log.warning("eval: %s", note)
    if preference:  # held-out pairs or feedback: the objective's loss and figures (TRL's names)
        from cputrain.finished.preference_eval import evaluate_pairs

        result = evaluate_pairs(path, cfg, rows, max_sequences, equip)
    else:
        result = evaluate_loss(model, rows, max_sequences, cfg.train.micro_batch_size)
    result.update({"model": model_folder(path), "data": cfg.data.source, "split": used})
    if note:
        result["note"] = note
    return result


def _check_objective_fits(path: str, cfg, objective) -> None:
    """Before any data or model is read: the objective (the run's, or a train.objective override)
    takes this data's format and this model's head, as training would refuse them."""
    from cputrain.errors import ModelError
    from cputrain.finished.load import is_reward_model, model_folder
    from cputrain.model.score_head import SCORE

    if not objective.perplexity:  # pairs or feedback read as the objective's own kind (the LM loss reads any)
        objective.check_data(cfg.data.format)
    folder = model_folder(path)
    if (objective.head == SCORE) != is_reward_model(folder):
        what = "a reward model (a score head)" if objective.head == SCORE else "a language model"
        raise ModelError(f"train.objective={cfg.train.objective} evaluates {what}, and the model in '{folder}' is "
                         f"{'not one' if objective.head == SCORE else 'a reward model'}; evaluate it under the "
                         "objective it was trained with (its run's config.yaml)")
