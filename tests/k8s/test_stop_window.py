"""A pod stopped by a drain gets the time to finish its step and save (terminationGracePeriodSeconds
from the plan), and a pod stopped on purpose is not counted as a failed one (podFailurePolicy)."""

from __future__ import annotations

import math

import pytest
import yaml

from cputrain.config.file import load_config
from cputrain.errors import Stopped
from cputrain.k8s import pod
from cputrain.k8s.options import ClusterOptions
from cputrain.k8s.render import render
from cputrain.plan.instances import builtin_instances
from cputrain.plan.time import ASSUMED_CLOCK_GHZ, ASSUMED_MFU, EXIT_MARGIN_S, checkpoint_bytes, step_flops

from .rendering import REPO, render_case
from .test_consistency import _pod_spec


def _job(out):
    return next(o for o in out.objects if o["kind"] in ("Job", "TrainJob"))


def _stop_timeout_in_config(out) -> int:
    cm = next(o for o in out.objects if o["kind"] == "ConfigMap")
    return yaml.safe_load(cm["data"]["train.yaml"])["launch"]["stop_timeout_s"]


@pytest.mark.parametrize("case", ["trainjob-fsdp-2x2", "job-ddp-4x1"])
def test_grace_period_is_a_step_plus_a_save_and_the_agent_waits_as_long(case):
    out = render_case(case)
    spec, _ = _pod_spec(_job(out))
    grace = spec["terminationGracePeriodSeconds"]
    assert grace == out.options.grace_period_s > 30  # the kubelet's default would kill the save
    assert _stop_timeout_in_config(out) == grace - EXIT_MARGIN_S
    # The save term, recomputed from the plan: trained parameters × (weights + AdamW's two moments).
    ckpt = checkpoint_bytes(out.plan.shape, out.plan.inputs.strategy, out.plan.inputs.precision)
    assert ckpt == out.plan.shape.trainable_params * 12
    slower = render_case(case, storage_write_mib_s=out.options.storage_write_mib_s / 2)
    extra_s = ckpt / (out.options.storage_write_mib_s / 2 * 2**20) - ckpt / (out.options.storage_write_mib_s * 2**20)
    assert abs(slower.options.grace_period_s - grace - extra_s) <= 1  # half the rate: the save takes twice as long


def test_an_8b_run_gets_minutes_not_the_kubelets_30_seconds():
    cfg = load_config(str(REPO / "configs" / "llama3-8b-fsdp.yaml"), [])
    opts = ClusterOptions(name="llama3-8b", image="registry.example.com/cputrain:0.1.0", nnodes=4, nproc_per_node=2)
    out = render(cfg, opts, builtin_instances(), kind="job")
    grace = out.options.grace_period_s
    ckpt = checkpoint_bytes(out.plan.shape, "fsdp", out.plan.inputs.precision)
    assert 90e9 < ckpt < 100e9  # 8.0B parameters × 12 bytes
    save_s = ckpt / (200 * 2**20)
    assert grace > save_s > 400  # ~450 s at FSx's smallest baseline rate
    # The step term: the same FLOPs the trainer's MFU counts, on four nodes at the stated share of their peak.
    step = step_flops(out.plan.shape, cfg.data.seq_len, cfg.train.global_batch_size, cfg.model.activation_checkpointing)
    assert step > 6 * 7.0e9 * cfg.data.seq_len * cfg.train.global_batch_size
    inst = out.options.instance_type
    cores = next(i for i in builtin_instances() if i.name == inst).physical_cores
    peak = 4 * cores * ASSUMED_CLOCK_GHZ * 1e9 * 1024  # four nodes of AMX bf16 tiles
    assert grace == math.ceil(step / (peak * ASSUMED_MFU) + save_s) + EXIT_MARGIN_S


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_step_flops_count_what_the_trainers_mfu_counts(tied, lora):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.metrics.flops import flops_per_token
    from cputrain.model import parameter_counts
    from cputrain.plan.model_shape import shape_of

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                         tie_word_embeddings=tied))
    if lora:
        for name, p in model.named_parameters():
            p.requires_grad_("q_proj" in name)  # as if only these were adapters
    counts = parameter_counts(model)
    expected = flops_per_token(counts["non_embedding"], 2, 64, 32, trained_params=counts["trained_non_embedding"])
    assert step_flops(shape_of(model), seq_len=32, global_batch=3, activation_checkpointing=False) == expected * 32 * 3


def test_a_grace_period_given_by_flag_is_used_as_given():
    out = render_case("job-ddp-4x1", grace_period_s=900)
    spec, _ = _pod_spec(_job(out))
    assert spec["terminationGracePeriodSeconds"] == 900
    assert _stop_timeout_in_config(out) == 900 - EXIT_MARGIN_S
    tj = render_case("trainjob-fsdp-2x2", grace_period_s=900)
    spec, _ = _pod_spec(_job(tj))
    assert spec["terminationGracePeriodSeconds"] == 900


def test_the_job_does_not_count_a_drained_or_stopped_pod_as_failed():
    job = _job(render_case("job-ddp-4x1"))
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # the API requires it for the policy
    disruption = next(r for r in rules if "onPodConditions" in r)
    assert disruption == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    stopped = next(r for r in rules if "onExitCodes" in r)
    assert stopped["action"] == "Ignore"
    assert stopped["onExitCodes"]["values"] == [Stopped.exit_code]  # what `cputrain train` exits with after a save
    assert stopped["onExitCodes"]["containerName"] == pod.CONTAINER
    assert job["spec"]["template"]["spec"]["containers"][0]["name"] == pod.CONTAINER
