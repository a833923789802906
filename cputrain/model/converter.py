"""What a run does to the model beyond building it and loading its weights: one object, chosen
once from the config (cputrain.lora.converter.converter_for), asked at fixed points of setup and
at the export. The trainer calls it the same way for every kind of fine-tuning.

This class is the identity: full fine-tuning trains every parameter the files hold, exports a
plain Hugging Face model, and has nothing to record about the weights it started from.
LoRA's converter (cputrain.lora.converter) overrides each point. Under both, a reward model's
score head that the files do not hold (a causal LM's folder: model.score_head) is in no file and
filled from its seeded initial value, as LoRA's adapters are.

What a checkpoint holds needs no say here: it is the trained parameters and their optimizer
state under both (cputrain.run_folder.dcp_state leaves frozen parameters out).
"""

from __future__ import annotations

from torch import nn


class ModelConverter:
    name = "full"  # summary.json's "lora" is false

    def __init__(self, seed: int = 0):
        self.seed = seed  # a new score head's draw
        self.new_head = None  # model.score_head.NewScoreHead: a head the files lack, from convert() until fill()

    def check_run_folder(self, run) -> None:
        """Before any tokenizing: refuse a run folder whose state does not belong to this model."""

    def convert(self, skeleton: nn.Module, source) -> None:
        """Change the meta skeleton in place, before any strategy wraps it: here, only note a
        reward model's head that the files do not hold."""
        from cputrain.model.score_head import new_score_head

        self.new_head = new_score_head(skeleton, source.folder, self.seed)

    def file_name_of(self, param_name: str) -> str | None:
        """The name under which `param_name` is stored in the base model's files; None: not there
        (the converter fills it). Strategies load through this (StrategyContext.file_name_of)."""
        return None if self.new_head is not None and param_name == self.new_head.name else param_name

    def fill(self, model: nn.Module) -> None:
        """Give what `convert` added its values, once the strategy has materialized `model`."""
        if self.new_head is not None:
            self.new_head.fill(model)
            self.new_head = None

    def record(self, run, source) -> None:
        """Rank 0, at the start of a session: what the run folder keeps about the base weights."""

    # DPO's reference, as a context in which the model computes as the reference: full weights
    # keep none (the objective computes the reference's log-probabilities before training).
    reference = None

    def export(self, strategy, model: nn.Module, hf_config, tokenizer, target: str, is_writer: bool) -> None:
        """Write model/ at `target` (every rank takes part in the gathers; the writer writes)."""
        from cputrain.model.export import export_hf

        export_hf(strategy.full_state_dict(model), hf_config, tokenizer, target, is_writer=is_writer)
