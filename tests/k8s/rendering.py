"""Representative renders shared by the k8s tests: the cases the golden files pin down."""

from __future__ import annotations

import functools
from pathlib import Path

from cputrain.config.file import load_config
from cputrain.k8s.options import ClusterOptions
from cputrain.k8s.render import render
from cputrain.plan.instances import builtin_instances

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]

# A ~100M-parameter Llama built from scratch: small enough to plan in a second, big enough
# that the plan, not the fixed overhead, decides the pod's memory.
ARCH = [
    "model.arch.hidden_size=768", "model.arch.intermediate_size=2048", "model.arch.num_hidden_layers=12",
    "model.arch.num_attention_heads=12", "model.arch.num_key_value_heads=4", "model.tokenizer_vocab_size=32000",
    "data.seq_len=1024", "train.micro_batch_size=4", "train.global_batch_size=64",
]

CASES = {
    "trainjob-fsdp-2x2": (
        ARCH + ["parallel.strategy=fsdp", "hardware.precision=bf16"],
        dict(name="llama-100m", image="registry.example.com/cputrain:0.1.0", nnodes=2, nproc_per_node=2,
             hf_token_secret="hf-token", placement_group="llama-100m-pg"),
        "trainjob",
    ),
    "job-ddp-4x1": (
        ARCH + ["parallel.strategy=ddp", "hardware.precision=fp32"],
        dict(name="llama-100m-ddp", image="registry.example.com/cputrain:0.1.0", nnodes=4, nproc_per_node=1,
             namespace="training", instance_type="c7i.16xlarge"),
        "job",
    ),
    "job-existing-pvc-no-karpenter": (
        ARCH + ["parallel.strategy=fsdp", "hardware.precision=bf16", "model.activation_checkpointing=true"],
        dict(name="ft", image="registry.example.com/cputrain@sha256:" + "0" * 64, nnodes=2, nproc_per_node=4,
             pvc="fsx-runs", karpenter=False, secret_env=[("WANDB_API_KEY", "wandb", "api-key")]),
        "job",
    ),
    "trainjob-zero3-recipe": (
        ARCH + ["parallel.strategy=zero3", "hardware.precision=bf16",
                f"parallel.deepspeed_config={REPO / 'configs' / 'deepspeed' / 'zero3-offload.json'}"],
        dict(name="llama-100m-zero3", image="registry.example.com/cputrain-deepspeed:0.1.0", nnodes=2,
             nproc_per_node=2, hf_token_secret="hf-token"),
        "trainjob",
    ),
}


def render_case(case: str, extra_overrides: tuple[str, ...] = (), **changes):
    """A case rendered as pinned, or with option `changes` and config overrides on top (later win)."""
    if not changes and not extra_overrides:
        return _render_cached(case)
    return _render(case, extra_overrides, **changes)


@functools.lru_cache(maxsize=None)
def _render_cached(name: str):
    return _render(name)


def _render(case: str, extra_overrides: tuple[str, ...] = (), **changes):
    overrides, opts, kind = CASES[case]
    cfg = load_config(None, [*overrides, *extra_overrides])
    return render(cfg, ClusterOptions(**{**opts, **changes}), builtin_instances(), kind=kind)
