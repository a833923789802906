"""config.yaml, the resolved config of the run: the only module that reads or writes it in a run
folder. Its identity keys decide whether the folder's checkpoints may continue this run.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from cputrain.run_folder.layout import RunFolder
from cputrain.config import Config
from cputrain.config.sections import DATA_FORMAT_RENAMED
from cputrain.errors import RunFolderError

NAME = "config.yaml"

# Keys that define what is being trained. A run folder's checkpoints only continue a run whose
# values here are the same; everything else (steps, logging, ranks, threads) may change.
IDENTITY_KEYS = (
    "seed",
    "model.name_or_path",
    "model.arch",
    "model.tokenizer",
    "model.tokenizer_vocab_size",
    "data.source",
    "data.hf_config",
    "data.text_field",
    # what is trained of it: a resumed run trains the same tokens (docs/guides/sft.md: "A resumed run trains what it trained before")
    "data.format",
    "data.train_on",
    "data.chat_template",
    "data.messages_field",
    "data.prompt_field",
    "data.completion_field",
    "data.chosen_field",
    "data.rejected_field",
    "data.label_field",
    "data.margin_field",
    "data.truncation",
    "data.seq_len",
    "data.val_fraction",
    "data.max_documents",
    # a shared prompt puts more pairs in a row: the rows, and so each step's pairs, change
    "data.shared_prompt",
    "train.global_batch_size",
    # what a step minimises: a resumed run keeps its objective and the objective's constants
    "train.objective",
    "train.dpo_beta",
    "train.dpo_label_smoothing",
    "train.simpo_beta",
    "train.simpo_gamma",
    "train.kto_beta",
    "train.kto_desirable_weight",
    "train.kto_undesirable_weight",
    "train.center_rewards_coefficient",
    "model.lora.enabled",  # checked first below: adapters-only checkpoints cannot continue a full fine-tune
    "model.lora.rank",
    "model.lora.alpha",
    "model.lora.target_modules",
)

# Identity keys added after run folders existed: a config.yaml without one was written when the
# key's value was this (what every run trained then), so it continues under it.
ADDED_KEYS = {"data.chosen_field": "chosen", "data.rejected_field": "rejected", "train.objective": "lm",
              "train.dpo_beta": 0.1, "train.dpo_label_smoothing": 0.0, "train.simpo_beta": 2.0,
              "train.simpo_gamma": 0.5, "data.shared_prompt": False, "data.label_field": "label",
              "data.margin_field": None, "train.kto_beta": 0.1, "train.kto_desirable_weight": 1.0,
              "train.kto_undesirable_weight": 1.0, "train.center_rewards_coefficient": None}


# Values renamed since run folders existed: a recorded config.yaml's old name is the new one.
RENAMED_VALUES = {"data.format": DATA_FORMAT_RENAMED}


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


@dataclass(frozen=True)
class RecordedConfig:
    """What a run folder holds to resume: whether it has complete checkpoints, and its config.yaml
    (None: no checkpoints, or checkpoints without the file). Read once per rank (read_recorded)
    and handed to every rule that reads a recorded value, and to the folder's identity check."""

    has_checkpoints: bool
    values: dict | None

    def value(self, dotted: str):
        """The value of `dotted` in the recorded config.yaml, or None."""
        return _get(self.values, dotted) if self.values is not None else None


def read_recorded(run: RunFolder) -> RecordedConfig:
    if not run.complete_steps():
        return RecordedConfig(False, None)
    text = run.read_text(NAME)
    return RecordedConfig(True, (yaml.safe_load(text) or {}) if text is not None else None)


def check_compatible(run: RunFolder, cfg: Config, recorded: RecordedConfig | None = None) -> None:
    """Refuse to touch a run folder whose checkpoints belong to a different run. `recorded`: the
    folder as read_recorded read it (read here when not given)."""
    if run.fs.exists(run.root) and not run.fs.isdir(run.root):
        raise RunFolderError(f"output_dir '{run.url}' is a file, not a folder; choose another output_dir")
    recorded = recorded if recorded is not None else read_recorded(run)
    if not recorded.has_checkpoints:
        return
    if recorded.values is None:
        raise RunFolderError(
            f"output_dir '{run.url}' holds checkpoints but no config.yaml; choose another output_dir"
        )
    old, new = recorded.values, cfg.model_dump(mode="json")
    was_lora = bool(_get(old, "model.lora.enabled"))
    if was_lora != cfg.model.lora.enabled:
        held, now = ("LoRA adapters", "full fine-tuning") if was_lora else ("a full fine-tune", "LoRA")
        raise RunFolderError(
            f"output_dir '{run.url}' holds checkpoints of {held}, and this config asks for {now}; set "
            f"model.lora.enabled={str(was_lora).lower()} to resume that run, or choose a new output_dir"
        )
    for key in IDENTITY_KEYS:
        there, now = _get(old, key), _get(new, key)
        if there is None and key in ADDED_KEYS:
            there = ADDED_KEYS[key]
        if key in RENAMED_VALUES and isinstance(there, str):  # recorded before the value's rename
            there = RENAMED_VALUES[key].get(there, there)
        # A folder written before these keys were decided at the start of a run recorded "auto";
        # it continues under the value auto gives now (checked again where it matters: the base
        # model's fingerprint, the cache key of the data).
        if there == "auto" and now != "auto":
            continue
        if there != now:
            if isinstance(there, dict) and isinstance(now, dict):  # name the one entry that differs
                sub = next(k for k in sorted(set(there) | set(now), key=str) if there.get(k) != now.get(k))
                key, there, now = f"{key}.{sub}", there.get(sub), now.get(sub)
            raise RunFolderError(
                f"output_dir '{run.url}' holds checkpoints of another run ({key}: {there!r} there, "
                f"{now!r} now); choose a new output_dir or set {key} back to resume it"
            )


def recorded_identity(recorded: dict, key: str) -> tuple[object, bool]:
    """An identity key's value in a recorded config, and whether the file holds it: a key added
    since the file was written gives the value every run had before it existed (ADDED_KEYS)."""
    value = _get(recorded, key)
    if value is None and key in ADDED_KEYS:
        return ADDED_KEYS[key], False
    return value, value is not None


def write_run_config(run: RunFolder, cfg: Config, reasons: list) -> None:
    """The resolved config, with the reason for each "auto" choice as a comment above it (rank 0)."""
    header = "".join(f"# {key} = {value}: {why}\n" for key, value, why in reasons)
    run.write_text(header + cfg.dump_yaml(), NAME)
