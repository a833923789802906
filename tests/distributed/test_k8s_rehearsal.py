"""The whole Kubernetes path on one machine: the rendered Indexed Job, run as two "pods".

Each pod is a network namespace with its own address, joined to the other by a veth pair.
The container command and environment are taken from the rendered Job as they are: values
verbatim, PET_NODE_RANK from the completion index (what the fieldRef resolves to), and the
master address — the headless Service's DNS name for pod 0 — resolved through the
namespace's own /etc/hosts (`ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts).
The volume mounts become folders: /config holds the ConfigMap's train.yaml, /output is one
folder both pods share (the PVC). Both pods must finish training; everything is torn down.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from harness.cli_env import cli_env
from harness.tiny_run import TINY_ARCH
from cputrain.config.file import load_config
from cputrain.k8s.indexed_job import COMPLETION_INDEX
from cputrain.k8s.options import ClusterOptions
from cputrain.k8s.pod import POD_INTERFACE
from cputrain.k8s.render import render
from cputrain.plan.instances import builtin_instances

pytestmark = [pytest.mark.netns, pytest.mark.slow]
ADDRESSES = ("10.78.0.1", "10.78.0.2")
POD_TIMEOUT_S = 90  # both pods together; a tiny model trains 3 steps in well under a minute


def _need_root():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip`) to create network namespaces")


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _pod_env(container: dict, index: int) -> dict:
    env = cli_env()
    for key in [k for k in env if k.startswith("PET_")]:
        env.pop(key)
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == COMPLETION_INDEX:
            env[item["name"]] = str(index)
        else:
            raise AssertionError(f"the rehearsal cannot resolve {item}")
    return env


def test_indexed_job_trains_on_two_pods(tmp_path, cache_dir):
    _need_root()
    tag = uuid.uuid4().hex[:6]
    namespaces = [f"cput-{tag}-{i}" for i in range(2)]
    veths = (f"cpv{tag}a", f"cpv{tag}b")
    cfg = load_config(None, TINY_ARCH + [
        "data.seq_len=32", "data.max_documents=400", "train.max_steps=3", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.eval_every=3", "train.eval_batches=1", "train.checkpoint_every=3",
        "train.sample_tokens=0", "hardware.precision=fp32", "hardware.threads=1", "parallel.strategy=ddp",
        "train.log_every=1",
    ])
    opts = ClusterOptions(name="rehearsal", image="cputrain:local", nnodes=2, nproc_per_node=1, cpu="1", memory="4Gi",
                          shm_size="1Gi", instance_type="c7i.8xlarge")
    objects = {o["kind"]: o for o in render(cfg, opts, builtin_instances(), kind="job").objects}
    job = objects["Job"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert job["spec"]["completions"] == 2
    assert {"name": "GLOO_SOCKET_IFNAME", "value": POD_INTERFACE} in container["env"]

    # The volumes: /config (the ConfigMap) and /output (the shared claim) become folders here.
    config_dir, output_dir = tmp_path / "config", tmp_path / "output"
    config_dir.mkdir()
    train_yaml = objects["ConfigMap"]["data"]["train.yaml"]
    raw = yaml.safe_load(train_yaml)
    raw["output_dir"] = raw["output_dir"].replace("/output", str(output_dir), 1)
    raw["data"]["cache_dir"] = str(cache_dir)  # tokenizer and packed data the session already made
    (config_dir / "train.yaml").write_text(yaml.safe_dump(raw))
    command = [a.replace("/config", str(config_dir), 1) if a.startswith("/config/") else a for a in container["command"]]
    assert command[:2] == ["cputrain", "train"]
    command = [sys.executable, "-m", "cputrain", *command[1:]]
    master = next(e["value"] for e in container["env"] if e["name"] == "PET_MASTER_ADDR")

    procs = []
    try:
        for ns in namespaces:
            _ip("netns", "add", ns)
            hosts = Path("/etc/netns") / ns
            hosts.mkdir(parents=True, exist_ok=True)
            (hosts / "hosts").write_text(f"127.0.0.1 localhost\n{ADDRESSES[0]} {master}\n")
        # Each end of the pair goes straight into its namespace and is renamed eth0 there, as a
        # CNI names a pod's interface: the rendered GLOO_SOCKET_IFNAME then holds unchanged.
        _ip("link", "add", veths[0], "netns", namespaces[0], "type", "veth", "peer", "name", veths[1],
            "netns", namespaces[1])
        for ns, veth, addr in zip(namespaces, veths, ADDRESSES):
            _ip("-n", ns, "link", "set", "dev", veth, "name", POD_INTERFACE)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", POD_INTERFACE)
            _ip("-n", ns, "link", "set", POD_INTERFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        for index, ns in enumerate(namespaces):
            log = open(tmp_path / f"pod-{index}.log", "w")
            procs.append((subprocess.Popen(["ip", "netns", "exec", ns, *command], env=_pod_env(container, index),
                                           cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
        codes = []
        deadline = time.monotonic() + POD_TIMEOUT_S
        for proc, log in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append("timed out")
            finally:
                log.close()
        logs = "\n".join((tmp_path / f"pod-{i}.log").read_text()[-2000:] for i in range(2))
        assert codes == [0, 0], f"pods ended {codes}:\n{logs}"
        run = Path(raw["output_dir"])
        summary = yaml.safe_load((run / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["final_step"] == 3
        assert (run / "plan.json").is_file() and (run / "checkpoints").is_dir()
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the pod's launcher and the ranks it started
                proc.wait()
            log.close()
        for ns in namespaces:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    # Deleting a namespace deletes its end of the veth pair, and with it the pair.
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in namespaces), f"namespaces left behind: {left}"
    assert not any((Path("/etc/netns") / ns).exists() for ns in namespaces)
