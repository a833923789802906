"""The cluster side of a run: which image, how many nodes and ranks, where, with what storage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cputrain.k8s.checks import (ManifestError, check_count, check_env_name, check_image, check_name,
                                 check_placement_group, check_quantity, quantity_value)
from cputrain.plan.time import DEFAULT_STORAGE_WRITE_MIB_S

GIB = 2**30
RDZV_PORT = 29500
NODE_RESERVED_CPUS = 1  # kubelet and daemons; requests are whole CPUs so the static CPU manager pins them


@dataclass
class ClusterOptions:
    name: str
    image: str | None
    nnodes: int
    nproc_per_node: int
    namespace: str = "default"
    instance_type: str | None = None  # None: the smallest instance the plan fits
    node_pool: str = "cputrain-amx"
    cluster_name: str = "cputrain"  # Karpenter discovery tag and node role of the EC2NodeClass
    placement_group: str | None = None  # an EC2 cluster placement group the EC2NodeClass launches nodes into
    pvc: str | None = None  # an existing claim for the run folder; None renders `<name>-output`
    storage_class: str = "fsx-sc"
    storage: str = "1200Gi"  # FSx for Lustre's smallest file system
    hf_token_secret: str | None = None
    hf_token_key: str = "token"
    secret_env: list[tuple[str, str, str]] = field(default_factory=list)  # (VAR, secret, key)
    cpu: str | None = None  # None: the instance's vCPUs minus what the node keeps
    memory: str | None = None  # None: the plan's pod memory plus /dev/shm
    shm_size: str = "8Gi"
    karpenter: bool = True
    # Seconds a pod gets after SIGTERM (None: the plan's stop window, plan/time/stop_window.py) and the
    # storage rate that window assumes; render fills grace_period_s and stop_timeout_s.
    grace_period_s: int | None = None
    storage_write_mib_s: float = DEFAULT_STORAGE_WRITE_MIB_S
    stop_timeout_s: int | None = None  # the agent's launch.stop_timeout_s in the rendered config

    def check(self) -> "ClusterOptions":
        check_name(self.name, "--name", max_len=50)  # pods are <name>-<index>-<suffix>: room for suffixes
        check_name(self.namespace, "--namespace")
        check_name(self.node_pool, "--node-pool")
        check_name(self.cluster_name, "--cluster-name")
        if self.placement_group is not None:
            check_placement_group(self.placement_group, "--placement-group")
        if self.pvc is not None:
            check_name(self.pvc, "--pvc")
        check_name(self.storage_class, "--storage-class")
        check_quantity(self.storage, "--storage")
        check_quantity(self.shm_size, "--shm-size")
        check_image(self.image)
        check_count(self.nnodes, "--nnodes")
        check_count(self.nproc_per_node, "--nproc-per-node")
        if self.cpu is not None:
            check_quantity(self.cpu, "--cpu")
        if self.memory is not None:
            check_quantity(self.memory, "--memory")
        if self.hf_token_secret is not None:
            check_name(self.hf_token_secret, "--hf-token-secret")
        if self.grace_period_s is not None and self.grace_period_s < 1:
            raise ManifestError(f"--grace-period-s must be a positive number of seconds (got {self.grace_period_s})")
        if not self.storage_write_mib_s > 0:
            raise ManifestError(f"--storage-write-mib-s must be a positive rate in MiB/s (got {self.storage_write_mib_s:g})")
        for var, secret, key in self.secret_env:
            check_env_name(var, "--secret-env")
            check_name(secret, f"--secret-env {var}")
        return self

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def pvc_name(self) -> str:
        return self.pvc or f"{self.name}-output"

    @property
    def service_name(self) -> str:
        return self.name  # the headless Service that gives pod 0 its DNS name

    @property
    def labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": "cputrain", "app.kubernetes.io/instance": self.name}


def manifest(opts: ClusterOptions, api_version: str, kind: str, name: str, **body) -> dict:
    """A namespaced object of this job: its head (apiVersion, kind, metadata with the job's
    namespace and labels), then `body` (spec, data, …) in the order given."""
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": opts.namespace, "labels": opts.labels}, **body}


def parse_secret_env(items: list[str]) -> list[tuple[str, str, str]]:
    """`VAR=secret:key` → (VAR, secret, key). Only references: a value is never accepted."""
    out = []
    for item in items:
        var, _, ref = item.partition("=")
        secret, _, key = ref.partition(":")
        if not var or not secret or not key:
            raise ManifestError(f"--secret-env '{item.split('=')[0]}=…' must be VAR=SECRET_NAME:KEY, a reference "
                                "to a Kubernetes Secret (values are never written into manifests)")
        out.append((var, secret, key))
    return out


@dataclass(frozen=True)
class PodResources:
    cpu: str
    memory: str
    shm_size: str


def pod_resources(opts: ClusterOptions, pod_memory_bytes: int, vcpus: int | None, allocatable_gib: float | None,
                  instance_given: bool = True) -> PodResources:
    """Requests = limits (Guaranteed QoS: the CPU manager then gives the pod whole cores).
    `instance_given`: --instance-type was the user's; else the plan chose it, and an error names
    what the user did give."""
    if opts.cpu is not None:
        cpu = opts.cpu
    elif vcpus is not None:
        cpu = str(max(opts.nproc_per_node, vcpus - NODE_RESERVED_CPUS))
    else:
        raise ManifestError("--cpu is required when --instance-type is not in the instance table")
    shm_bytes = int(quantity_value(opts.shm_size, "--shm-size"))
    if opts.memory is not None:
        memory = opts.memory
        if quantity_value(memory, "--memory") < pod_memory_bytes:
            raise ManifestError(f"--memory {memory} is below the plan's {pod_memory_bytes / GIB:.1f} GiB for "
                                f"{opts.nproc_per_node} rank(s) per pod; raise it or leave it out to use the plan")
    else:
        # /dev/shm is memory-backed: what ranks write there counts against the pod's limit.
        memory = f"{math.ceil((pod_memory_bytes + shm_bytes) / GIB)}Gi"
    if allocatable_gib is not None and quantity_value(memory, "--memory") > allocatable_gib * GIB and not instance_given:
        raise ManifestError(
            f"--memory {memory} is more than the {allocatable_gib:.0f} GiB that {opts.instance_type} (the smallest "
            f"instance the plan fits) allocates to pods; lower --memory, or pass --instance-type with a bigger one")
    if allocatable_gib is not None and quantity_value(memory, "--memory") > allocatable_gib * GIB:
        raise ManifestError(
            f"--instance-type: {opts.instance_type} allocates {allocatable_gib:.0f} GiB to pods but a pod with "
            f"{opts.nproc_per_node} rank(s) needs {memory}; choose a bigger instance type, fewer --nproc-per-node, "
            "or leave --instance-type out to take the smallest that fits"
        )
    if allocatable_gib is not None and vcpus is not None and float(quantity_value(cpu, "--cpu")) > vcpus:
        raise ManifestError(f"--cpu {cpu} is more than {opts.instance_type}'s {vcpus} vCPUs")
    return PodResources(cpu=cpu, memory=memory, shm_size=opts.shm_size)
