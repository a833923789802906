"""Bad cluster options are refused with one line naming the field; secrets never reach a file."""

from __future__ import annotations

import pytest

from cputrain.errors import UserError
from cputrain.k8s.checks import quantity_value

from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here

from .rendering import ARCH, render_case


@pytest.mark.parametrize("changes, field", [
    (dict(name="Llama_FT"), "--name"),
    (dict(name="-bad"), "--name"),
    (dict(namespace="a" * 64), "--namespace"),
    (dict(nnodes=0), "--nnodes"),
    (dict(nproc_per_node=0), "--nproc-per-node"),
    (dict(image=None), "--image"),
    (dict(image=""), "--image"),
    (dict(memory="64GB"), "--memory"),
    (dict(cpu="two"), "--cpu"),
    (dict(shm_size="-1Gi"), "--shm-size"),
    (dict(memory="1Gi"), "--memory"),  # a valid quantity below the plan
    (dict(instance_type="c7i.8xlarge", nnodes=1, nproc_per_node=16), "--instance-type"),
    (dict(instance_type="x9.huge"), "--instance-type"),
    (dict(memory="4000Gi", instance_type=None), "--memory 4000Gi is more than"),  # --instance-type not given: not blamed
    (dict(grace_period_s=0), "--grace-period-s"),
    (dict(storage_write_mib_s=0.0), "--storage-write-mib-s"),
    (dict(placement_group="my group"), "--placement-group"),
    (dict(placement_group=""), "--placement-group"),
])
def test_refused_with_the_field_named(changes, field):
    with pytest.raises(UserError) as err:
        render_case("job-ddp-4x1", **changes)
    assert field in str(err.value)
    if not changes.get("instance_type"):
        assert "--instance-type:" not in str(err.value)  # an option the user did not give is not named as the cause


def test_quantities_follow_kubernetes_grammar():
    assert quantity_value("64Gi", "f") == 64 * 2**30
    assert quantity_value("1.5G", "f") == 1_500_000_000
    assert quantity_value("15500m", "f") == 15.5
    assert quantity_value("1e3", "f") == 1000
    for bad in ("64GB", "Gi", "1.2.3", "64 Gi", "ten"):
        with pytest.raises(UserError, match="not a Kubernetes quantity"):
            quantity_value(bad, "--memory")


def test_world_size_that_fits_no_instance(tmp_path):
    # ddp keeps all 16 bytes/param in every rank: 2 ranks per pod of a 100M model do not fit a
    # table whose only instance has 2 GiB.
    table = tmp_path / "tiny.yaml"
    table.write_text("- {name: t3.small, vcpus: 2, memory_gib: 2, amx: false}\n")
    proc = run_cli_here("plan", *ARCH, "parallel.strategy=ddp", "--world-size", "2", "--instances-file", table)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("cputrain: error: world size 2:") and len(proc.stderr.strip().splitlines()) == 1


def test_cli_errors_are_one_line():
    """As its own process: the exit code and stderr are the command's."""
    proc = run_cli("k8s", *ARCH, "--name", "ok", "--nnodes", "2", "--nproc-per-node", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == proc.stderr.strip().splitlines()[0] and "--image is required" in proc.stderr


def test_no_secret_value_is_ever_written(tmp_path):
    secret_value = "hf_sEcReT_value_0123456789"
    env = dict(HF_TOKEN=secret_value, WANDB_API_KEY=secret_value)
    out = tmp_path / "manifests"
    proc = run_cli_here("k8s", *ARCH, "parallel.strategy=fsdp", "--name", "sec", "--image", "img:1", "--nnodes", "2",
                   "--nproc-per-node", "2", "--hf-token-secret", "hf-token", "--secret-env", "WANDB_API_KEY=wandb:key",
                   "--kind", "job", "--output", out, env=env)
    assert proc.returncode == 0, proc.stderr
    files = sorted(out.iterdir())
    assert len(files) == 6  # NodePool, EC2NodeClass, ConfigMap, PVC, Service, Job
    text = "".join(f.read_text() for f in files)
    assert secret_value not in text
    assert "secretKeyRef" in text and "name: hf-token" in text and "name: wandb" in text
    # a value in place of a reference is refused
    proc = run_cli_here("k8s", *ARCH, "--name", "sec", "--image", "img:1", "--nnodes", "1", "--nproc-per-node", "1",
                        "--secret-env", f"HF_TOKEN={secret_value}")
    assert proc.returncode == 2 and "SECRET_NAME:KEY" in proc.stderr
    assert secret_value not in proc.stdout


def test_output_folder_never_overwrites_other_content(tmp_path):
    from cputrain.k8s.output import write_folder

    objects = render_case("job-ddp-4x1").objects
    first = write_folder(objects, tmp_path)
    assert write_folder(objects, tmp_path) == first  # the same content again is fine
    first[0].write_text("# edited by hand\n")
    with pytest.raises(UserError, match="--overwrite"):
        write_folder(objects, tmp_path)
    assert first[0].read_text() == "# edited by hand\n"
    write_folder(objects, tmp_path, overwrite=True)
    assert first[0].read_text() != "# edited by hand\n"


@pytest.mark.parametrize("command", ["plan", "k8s"])
def test_model_config_that_is_not_a_json_object(tmp_path, command):
    """Was a TypeError traceback (plan) and a silently planned hidden_size of 4096."""
    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2, 3]\n")
    no_hidden = tmp_path / "no-hidden"
    no_hidden.mkdir()
    (no_hidden / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, '
                                           '"vocab_size": 100, "intermediate_size": 128}')
    extra = ["--name", "x", "--image", "img:1", "--nnodes", "1", "--nproc-per-node", "1"] if command == "k8s" else ["--world-size", "1"]
    for config, expected in ((not_object, "holds a JSON list, not an object"), (no_hidden, "lacks hidden_size")):
        proc = run_cli_here(command, *ARCH, "--model-config", config, *extra)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and expected in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
