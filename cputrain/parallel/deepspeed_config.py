"""The DeepSpeed config for strategy zero3: generated from cputrain's config, or a user's file.

cputrain's trainer drives the batches, the accumulation loop, the optimizer, the learning-rate
schedule and the precision choice, so on those keys cputrain's config wins. A user's file keeps
everything that is DeepSpeed's own (offload, buckets, overlap, logging); its "auto" values are
filled from cputrain's config (as the Hugging Face Trainer does), and every value that
contradicts cputrain's config is reported before training starts, with the value used and why.

This module does not import deepspeed: reading and checking a config must work (and fail
clearly) on a machine without the extra installed.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from cputrain.config import Config

from cputrain.config.file import named_file_text
from cputrain.errors import ConfigError, UserError

# 0.16 is the oldest release whose CPU accelerator, zero.Init and consolidated ZeRO-3
# state dict this strategy has been run against.
MIN_DEEPSPEED = "0.16.0"
INSTALL_HINT = "pip install 'cputrain[deepspeed]' (scripts/install.sh deepspeed)"

# Measured on an AMD EPYC without AMX or AVX512-BF16 (see cputrain.config.resolve): bf16 matmuls are
# emulated there.
EMULATED_BF16_REASON = (
    "this CPU has no AMX or AVX512-BF16, so bf16 matmuls are emulated "
    "(measured 0.3 vs 116–127 GFLOP/s in fp32 for a 2048² matmul); set hardware.precision=bf16 to force it"
)


class DeepSpeedMissing(UserError):
    """zero3 was asked for but DeepSpeed is not installed or too old."""


def require_deepspeed() -> str:
    """The installed DeepSpeed version, or a one-line error saying how to install a good one."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        raise DeepSpeedMissing(f"parallel.strategy=zero3 needs DeepSpeed, which is not installed: {INSTALL_HINT}") from None
    return check_version(version)


def check_version(version: str) -> str:
    if Version(version) < Version(MIN_DEEPSPEED):
        raise DeepSpeedMissing(
            f"DeepSpeed {version} is too old for parallel.strategy=zero3, which needs deepspeed>={MIN_DEEPSPEED}: "
            f"pip install -U 'deepspeed>={MIN_DEEPSPEED}'"
        )
    return version


def read_user_config(path: str | Path) -> dict:
    """A DeepSpeed JSON file, or a one-line error naming the file, line and column."""
    text = named_file_text(path, f"parallel.deepspeed_config '{path}' not found; point it at a DeepSpeed JSON file")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"parallel.deepspeed_config '{path}' is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"parallel.deepspeed_config '{path}' must hold a JSON object, not {type(doc).__name__}")
    stage = doc.get("zero_optimization", {}).get("stage", 3) if isinstance(doc.get("zero_optimization"), dict) else 3
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"parallel.deepspeed_config '{path}': zero_optimization.stage is {stage!r}; DeepSpeed has stages 0, 1, 2 and 3"
        )
    return doc


@dataclass
class DeepSpeedPlan:
    """The config handed to DeepSpeed, and what was changed in the user's file and why."""

    config: dict
    notes: list[str] = field(default_factory=list)  # one line each, reported before start

    @property
    def offload_optimizer(self) -> bool:
        return _offloaded(self.config["zero_optimization"].get("offload_optimizer"))

    @property
    def offload_param(self) -> bool:
        return _offloaded(self.config["zero_optimization"].get("offload_param"))

    @property
    def fetch_granularity_set(self) -> bool:
        """Whether the config says which modules DeepSpeed fetches whole (its leaf modules, by
        name or by a granularity threshold); if not, the zero3 strategy fetches each decoder block whole."""
        zero = self.config["zero_optimization"]
        return "leaf_module" in zero or float(zero.get("stage3_module_granularity_threshold", 0) or 0) > 0


def _offloaded(section) -> bool:
    return isinstance(section, dict) and section.get("device", "none") not in (None, "none")


def _same(a, b) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def build(cfg: Config, world_size: int, grad_accum_steps: int, hidden_size: int | None = None,
          user: dict | None = None, source: str = "parallel.deepspeed_config") -> DeepSpeedPlan:
    """The DeepSpeed config for this run. `user` is the user's file, already read; None generates one."""
    ds = copy.deepcopy(user) if user is not None else {}
    notes: list[str] = []

    def force(key_path: str, value, why: str) -> None:
        """Set a key cputrain owns; report it when the user's file said something else."""
        *parents, leaf = key_path.split(".")
        node = ds
        for part in parents:
            node = node.setdefault(part, {})
        old = node.get(leaf, "auto")
        if user is not None and old != "auto" and not _same(old, value):
            notes.append(f"{source}: {key_path} is {old!r} in the file; using {value!r} ({why})")
        node[leaf] = value

    t = cfg.train
    force("train_micro_batch_size_per_gpu", t.micro_batch_size, "train.micro_batch_size")
    force("gradient_accumulation_steps", grad_accum_steps,
          f"train.global_batch_size {t.global_batch_size} ÷ (micro-batch {t.micro_batch_size} × {world_size} ranks)")
    force("train_batch_size", t.global_batch_size, "train.global_batch_size")
    force("gradient_clipping", float(t.grad_clip), "train.grad_clip")

    bf16 = cfg.hardware.precision == "bf16"
    file_bf16 = isinstance(ds.get("bf16"), dict) and ds["bf16"].get("enabled") is True
    if user is not None and file_bf16 and not bf16:
        notes.append(f"{source}: bf16.enabled is true in the file; training in fp32 because {EMULATED_BF16_REASON}")
    elif user is not None and isinstance(ds.get("bf16"), dict) and ds["bf16"].get("enabled") is False and bf16:
        notes.append(f"{source}: bf16.enabled is false in the file; using bf16 (hardware.precision=bf16)")
    ds["bf16"] = {**(ds.get("bf16") if isinstance(ds.get("bf16"), dict) else {}), "enabled": bf16}
    if isinstance(ds.get("fp16"), dict) and ds["fp16"].get("enabled") not in (False, "auto", None):
        notes.append(f"{source}: fp16.enabled is true in the file; turned off (CPUs train in fp32 or bf16, "
                     "and fp16 needs loss scaling that buys nothing here)")
    ds["fp16"] = {"enabled": False}

    # cputrain builds the AdamW and the warm-up + cosine schedule (train.*), and steps both.
    for section, why in (("optimizer", "train.lr, train.beta1/beta2, train.weight_decay"),
                         ("scheduler", "train.warmup_steps, train.min_lr_ratio")):
        if section in ds:
            notes.append(f"{source}: its '{section}' section is not used; cputrain's own is ({why})")
            del ds[section]

    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage", 3) != 3:
        notes.append(f"{source}: zero_optimization.stage is {zero['stage']} in the file; using 3 (parallel.strategy=zero3)")
    zero["stage"] = 3
    for key, flag in (("offload_optimizer", cfg.parallel.offload_optimizer), ("offload_param", cfg.parallel.offload_param)):
        # Either side can turn offload on: the file's setting stays unless parallel.* asks for more.
        if flag and not _offloaded(zero.get(key)):
            if user is not None:
                notes.append(f"{source}: zero_optimization.{key} is off in the file; parallel.{key}=true turns it on")
            zero[key] = {"device": "cpu", "pin_memory": False}
        elif isinstance(zero.get(key), dict) and zero[key].get("device") not in (None, "none", "cpu"):
            notes.append(f"{source}: zero_optimization.{key}.device is {zero[key]['device']!r}; using 'cpu' "
                         "(NVMe offload is not supported by cputrain)")
            zero[key]["device"] = "cpu"
        if isinstance(zero.get(key), dict) and zero[key].get("pin_memory") == "auto":
            zero[key]["pin_memory"] = False  # pinned host memory only matters with an accelerator

    # Bucket sizes scale with the hidden size, as the Hugging Face Trainer fills them.
    h = hidden_size or 1024
    defaults = {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    for key, value in defaults.items():
        if zero.get(key, "auto") == "auto":
            zero[key] = value
    zero.setdefault("stage3_gather_16bit_weights_on_model_save", False)

    ds.setdefault("steps_per_print", 10**9 if user is None else ds.get("steps_per_print", 10))
    ds.setdefault("wall_clock_breakdown", False)
    ds["zero_allow_untested_optimizer"] = True  # cputrain's AdamW: decay on matrices only

    left = sorted(_auto_keys(ds))
    if left:
        raise ConfigError(
            f"{source}: cputrain cannot fill \"auto\" for {', '.join(left)}; write a value there"
        )
    return DeepSpeedPlan(ds, notes)


def _auto_keys(node, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_keys(value, f"{prefix}{key}.")
    elif node == "auto":
        yield prefix.rstrip(".")


def plan_for(cfg: Config, world_size: int, grad_accum_steps: int, hidden_size: int | None = None) -> DeepSpeedPlan:
    """The plan for this run: from parallel.deepspeed_config when set, else generated."""
    path = cfg.parallel.deepspeed_config
    user = read_user_config(path) if path else None
    return build(cfg, world_size, grad_accum_steps, hidden_size, user,
                 source=f"DeepSpeed config '{path}'" if path else "generated DeepSpeed config")
