"""`cputrain eval` on a dataset: a finished model's loss per trained target and perplexity, or,
for a run with a preference objective (DPO, SimPO, KTO, reward model), its objective's loss and
figures on held-out pairs or feedback."""

from __future__ import annotations


def evaluate_on_data(path: str, cfg, split: str, max_sequences: int, equip=None) -> dict:
    """The figures over the first `max_sequences` rows of `split` (the train split where the data
    has no validation rows), with the model folder, the data source and the split they came from.
    `cfg` is resolved for this machine, with what the data is (data.format, data.train_on);
    `equip(objective, tokenizer)`: what the objective is handed before it runs (evaluate_pairs)."""
    from cputrain.data.prepare import prepare, rows_of
    from cputrain.finished.load import load_for_inference, model_folder
    from cputrain.objectives.objective import objective_class
    from cputrain.objectives.validation_loss import evaluate_loss

    preference = not objective_class(cfg.train.objective).perplexity
    if preference:  # the models are loaded by evaluate_pairs, one after the other
        from cputrain.data.tokenizer import load_tokenizer
        from cputrain.finished.preference_eval import require_reference

        require_reference(path, cfg)
        model, tokenizer = None, load_tokenizer(model_folder(path), cfg.model.trust_remote_code)
    else:
        model, tokenizer = load_for_inference(path, cfg.model.trust_remote_code)
    _, data = prepare(cfg, tokenizer)
    rows = rows_of(data, "val")
    if split != "val" or len(rows) == 0:
        rows = rows_of(data, "train")
    if preference:  # held-out pairs or feedback: the objective's loss and figures (TRL's names)
        from cputrain.finished.preference_eval import evaluate_pairs

        result = evaluate_pairs(path, cfg, rows, max_sequences, equip)
    else:
        result = evaluate_loss(model, rows, max_sequences, cfg.train.micro_batch_size)
    result.update({"model": model_folder(path), "data": cfg.data.source, "split": split})
    return result
