"""Every rendered object validates: built-in kinds with kubernetes-validate, CRDs with jsonschema."""

from __future__ import annotations

import pytest
import yaml

from .rendering import CASES, render_case

K8S_VERSION = "1.33.0"
CRD_FILES = {
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjobs.yaml",
    ("karpenter.sh/v1", "NodePool"): "nodepools.yaml",
    ("karpenter.k8s.aws/v1", "EC2NodeClass"): "ec2nodeclasses.yaml",
}


def _all_objects():
    return [(case, obj) for case in sorted(CASES) for obj in render_case(case).objects]


def crd_schema(shared_dir, api_version: str, kind: str) -> dict:
    crd = yaml.safe_load((shared_dir / "k8s-schemas" / CRD_FILES[(api_version, kind)]).read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def test_builtin_kinds_validate():
    import kubernetes_validate

    checked = set()
    for case, obj in _all_objects():
        if (obj["apiVersion"], obj["kind"]) in CRD_FILES:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any schema error
        checked.add(obj["kind"])
    assert checked == {"ConfigMap", "PersistentVolumeClaim", "Service", "Job"}


def test_custom_resources_validate_against_crds(shared_dir):
    import jsonschema

    checked = set()
    for case, obj in _all_objects():
        key = (obj["apiVersion"], obj["kind"])
        if key not in CRD_FILES:
            continue
        schema = crd_schema(shared_dir, *key)
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, f"{case} {obj['kind']}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
        checked.add(obj["kind"])
    assert checked == {"TrainJob", "NodePool", "EC2NodeClass"}


def test_the_validators_catch_a_broken_object(shared_dir):
    """The checks above can fail: a misspelt field and a wrong type are both refused."""
    import jsonschema
    import kubernetes_validate

    objects = render_case("trainjob-fsdp-2x2").objects
    cm = dict(next(o for o in objects if o["kind"] == "ConfigMap"), dataa={})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    tj = next(o for o in objects if o["kind"] == "TrainJob")
    bad = yaml.safe_load(yaml.safe_dump(tj))
    bad["spec"]["trainer"]["numProcPerNode"] = "auto"
    assert list(jsonschema.Draft7Validator(crd_schema(shared_dir, tj["apiVersion"], "TrainJob")).iter_errors(bad))
