"""The pieces fit together: pool taint ↔ job toleration, pool labels ↔ job nodeSelector, PET_* env."""

from __future__ import annotations

import pytest
import yaml

from cputrain.plan.instances import SIZES_VCPUS

from .rendering import render_case


def _pod_spec(obj):
    if obj["kind"] == "Job":
        return obj["spec"]["template"]["spec"], obj["spec"]["template"]["metadata"]
    tpl = obj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    return tpl["template"]["spec"]["template"]["spec"], tpl["template"]["spec"]["template"]["metadata"]


@pytest.mark.parametrize("case", ["trainjob-fsdp-2x2", "job-ddp-4x1"])
def test_pool_and_job_agree(case):
    objs = {o["kind"]: o for o in render_case(case).objects}
    pool, job = objs["NodePool"], objs.get("TrainJob") or objs["Job"]
    spec, meta = _pod_spec(job)
    tpl = pool["spec"]["template"]
    for taint in tpl["spec"]["taints"]:
        assert any(t["key"] == taint["key"] and t.get("value") == taint.get("value") and t["effect"] == taint["effect"]
                   for t in spec["tolerations"]), taint
    requirement = {r["key"]: r["values"] for r in tpl["spec"]["requirements"]}
    for key, value in spec["nodeSelector"].items():
        if key == "karpenter.sh/nodepool":
            assert value == pool["metadata"]["name"]
        elif key == "node.kubernetes.io/instance-type":
            family, size = value.split(".")
            assert family in requirement["karpenter.k8s.aws/instance-family"]
            assert size in requirement["karpenter.k8s.aws/instance-size"]
        else:
            assert tpl["metadata"]["labels"].get(key) == value, key
    assert objs["EC2NodeClass"]["metadata"]["name"] == tpl["spec"]["nodeClassRef"]["name"]
    assert meta["annotations"]["karpenter.sh/do-not-disrupt"] == "true"


def test_requirement_values_are_separate_items():
    pool = next(o for o in render_case("trainjob-fsdp-2x2").objects if o["kind"] == "NodePool")
    sizes = next(r for r in pool["spec"]["template"]["spec"]["requirements"]
                 if r["key"] == "karpenter.k8s.aws/instance-size")["values"]
    assert sizes == list(SIZES_VCPUS)  # ["8xlarge", "16xlarge", "24xlarge", "48xlarge"], never "24xlarge, 48xlarge"
    assert all("," not in v and " " not in v for r in pool["spec"]["template"]["spec"]["requirements"] for v in r["values"])


def test_trainjob_is_explicit_and_sized_by_the_plan():
    out = render_case("trainjob-fsdp-2x2")
    tj = next(o for o in out.objects if o["kind"] == "TrainJob")
    trainer = tj["spec"]["trainer"]
    assert tj["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 2 and isinstance(trainer["numProcPerNode"], int)
    assert trainer["command"] == ["cputrain", "train", "/config/train.yaml"]
    res = trainer["resourcesPerNode"]
    assert res["requests"] == res["limits"]
    peak = max(r.total_bytes for r in out.plan.ranks)
    from cputrain.k8s.checks import quantity_value

    assert quantity_value(res["limits"]["memory"], "memory") >= 2 * peak  # two ranks per pod
    spec, _ = _pod_spec(tj)
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(v.get("persistentVolumeClaim") for v in spec["volumes"])


def test_indexed_job_sets_pet_variables_like_the_runtime():
    job = next(o for o in render_case("job-ddp-4x1").objects if o["kind"] == "Job")
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PET_NNODES"]["value"] == "4" and env["PET_NPROC_PER_NODE"]["value"] == "1"
    assert "job-completion-index" in env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert env["PET_MASTER_ADDR"]["value"] == "llama-100m-ddp-0.llama-100m-ddp"
    assert job["spec"]["template"]["spec"]["subdomain"] == "llama-100m-ddp"
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 4


def test_without_karpenter_the_pods_ask_for_nothing_only_karpenter_provides():
    """--no-karpenter: no pool objects, and no selector, taint toleration or annotation that only a
    Karpenter pool satisfies; the plan's instance type (a label every provider sets) places the pods."""
    out = render_case("job-existing-pvc-no-karpenter")
    assert not [o for o in out.objects if o["kind"] in ("NodePool", "EC2NodeClass")]
    spec, meta = _pod_spec(next(o for o in out.objects if o["kind"] == "Job"))
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": out.options.instance_type}
    assert not spec.get("tolerations") and not meta.get("annotations")
    assert "karpenter" not in yaml.safe_dump([spec, meta])


def test_a_users_deepspeed_file_travels_in_the_configmap():
    """The zero3 recipe's DeepSpeed file is a path on the rendering machine: the pods read the
    ConfigMap's copy, byte for byte, through the config's pointer to it."""
    from .rendering import REPO

    out = render_case("trainjob-zero3-recipe")
    cm = next(o for o in out.objects if o["kind"] == "ConfigMap")
    ds_file = REPO / "configs" / "deepspeed" / "zero3-offload.json"
    assert cm["data"]["deepspeed.json"] == ds_file.read_text()
    pod_cfg = yaml.safe_load(cm["data"]["train.yaml"])
    assert pod_cfg["parallel"]["deepspeed_config"] == "/config/deepspeed.json"
    spec, _ = _pod_spec(next(o for o in out.objects if o["kind"] == "TrainJob"))
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["config"] == "/config"


def test_a_broken_deepspeed_file_stops_the_render(tmp_path):
    from cputrain.errors import ConfigError

    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        render_case("trainjob-zero3-recipe", extra_overrides=(f"parallel.deepspeed_config={bad}",))


def test_trainjob_leaves_the_progress_endpoint_to_the_controller():
    """The controller's TrainJobStatus plugin upserts its variables, its volume and its mount into
    the trainer container (cputrain.k8s.trainjob): the rendered pods must not take those names."""
    from cputrain.metrics import trainjob_progress

    tj = next(o for o in render_case("trainjob-fsdp-2x2").objects if o["kind"] == "TrainJob")
    spec, _ = _pod_spec(tj)
    assert "kubeflow-trainer-token" not in {v["name"] for v in spec["volumes"]}
    mounts = [m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])]
    assert not any(path.startswith("/var/run/secrets/kubeflow") for path in mounts)
    ours = {e["name"] for e in tj["spec"]["trainer"]["env"]}
    assert not ours & {trainjob_progress.ENV_URL, trainjob_progress.ENV_CA_CERT, trainjob_progress.ENV_TOKEN}


def test_a_placement_group_only_where_asked_and_the_plan_counts_it():
    """--placement-group puts the EC2NodeClass's nodes in that cluster placement group, and the plan
    that sized the pods counts EC2's per-flow cap in one (10 Gbit/s, not 5)."""
    def node_class(out):
        return next(o for o in out.objects if o["kind"] == "EC2NodeClass")

    asked = render_case("trainjob-fsdp-2x2")
    assert node_class(asked)["spec"]["placementGroupSelector"] == {"name": "llama-100m-pg"}
    assert "in a cluster placement group" in next(n for n in asked.plan.notes if n.startswith("parallel.layout="))
    without = render_case("trainjob-fsdp-2x2", placement_group=None)
    assert "placementGroupSelector" not in node_class(without)["spec"]
    assert "placement group" not in next(n for n in without.plan.notes if n.startswith("parallel.layout="))
