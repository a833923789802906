"""The container every variant runs, and the pod-level pieces they share.

The command is `cputrain train /config/train.yaml`; the node count, ranks per node, node rank
and master address arrive as the PET_* variables torchrun reads (Kubeflow's torch runtime
injects them; the Indexed Job sets them itself). Secrets are only ever `secretKeyRef`s.
"""

from __future__ import annotations

from cputrain.k8s.options import ClusterOptions, PodResources

CONTAINER = "node"  # the container name Kubeflow's torch-distributed runtime patches
CONFIG_DIR = "/config"
CONFIG_FILE = "train.yaml"
OUTPUT_DIR = "/output"
COMMAND = ["cputrain", "train", f"{CONFIG_DIR}/{CONFIG_FILE}"]
AMX_TAINT_KEY = "intel.com/amx"
AMX_LABEL = {"intel.com/amx": "true"}
DO_NOT_DISRUPT = {"karpenter.sh/do-not-disrupt": "true"}
# A pod's network namespace has one interface besides loopback, and the CNI names it eth0.
POD_INTERFACE = "eth0"


def secret_env(opts: ClusterOptions) -> list[dict]:
    refs = list(opts.secret_env)
    if opts.hf_token_secret:
        refs.insert(0, ("HF_TOKEN", opts.hf_token_secret, opts.hf_token_key))
    return [{"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}} for var, secret, key in refs]


def base_env() -> list[dict]:
    # Offline-safe defaults for tokenizers and unbuffered logs (kubectl logs shows lines as they come).
    # GLOO_SOCKET_IFNAME: without it gloo binds to the address the pod's hostname resolves to,
    # which inside a pod can be loopback or an address the other pods cannot reach; the ranks
    # then hang in their first collective. The pod's own interface is the one to use.
    return [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
            {"name": "GLOO_SOCKET_IFNAME", "value": POD_INTERFACE}]


def resources(res: PodResources) -> dict:
    both = {"cpu": res.cpu, "memory": res.memory}
    return {"requests": dict(both), "limits": dict(both)}


def volume_mounts() -> list[dict]:
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "output", "mountPath": OUTPUT_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]


def volumes(opts: ClusterOptions, res: PodResources) -> list[dict]:
    return [
        {"name": "config", "configMap": {"name": f"{opts.name}-config"}},
        {"name": "output", "persistentVolumeClaim": {"claimName": opts.pvc_name}},
        # The container runtime's default /dev/shm is 64 MiB; collectives and data loaders need more.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": res.shm_size}},
    ]


def node_selector(opts: ClusterOptions) -> dict[str, str]:
    # Without Karpenter there is no pool label and no AMX label on the nodes: the instance type
    # the plan chose, a label every cloud provider sets, is what places the pods.
    sel = {"karpenter.sh/nodepool": opts.node_pool, **AMX_LABEL} if opts.karpenter else {}
    if opts.instance_type:
        sel["node.kubernetes.io/instance-type"] = opts.instance_type
    return sel


def tolerations(opts: ClusterOptions) -> list[dict]:
    if not opts.karpenter:  # only the rendered pool carries the AMX taint
        return []
    return [{"key": AMX_TAINT_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}]


def termination(opts: ClusterOptions) -> dict:
    """The pod's grace period after SIGTERM: the plan's step plus checkpoint save (render sets it)."""
    return {"terminationGracePeriodSeconds": opts.grace_period_s} if opts.grace_period_s is not None else {}


def annotations(opts: ClusterOptions) -> dict[str, str]:
    # Karpenter would otherwise consolidate a node away from under a running job.
    return dict(DO_NOT_DISRUPT) if opts.karpenter else {}
