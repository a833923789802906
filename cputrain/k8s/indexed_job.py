"""For clusters without Kubeflow: an Indexed Job (one pod per node) and a headless Service.

Each pod gets its node rank from its completion index, and finds node 0 by the DNS name the
headless Service gives it: `<job>-0.<service>`. The pod sets the same PET_* variables the
Kubeflow runtime would, so the container command is the same.
"""

from __future__ import annotations

from cputrain.k8s import pod
from cputrain.k8s.options import RDZV_PORT, ClusterOptions, PodResources, manifest

COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def master_addr(opts: ClusterOptions) -> str:
    return f"{opts.name}-0.{opts.service_name}"


def pet_env(opts: ClusterOptions) -> list[dict]:
    return [
        {"name": "PET_NNODES", "value": str(opts.nnodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(opts.nproc_per_node)},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        {"name": "PET_MASTER_ADDR", "value": master_addr(opts)},
        {"name": "PET_MASTER_PORT", "value": str(RDZV_PORT)},
    ]


def service(opts: ClusterOptions) -> dict:
    return manifest(
        opts, "v1", "Service", opts.service_name,
        spec={
            "clusterIP": "None",
            # Node 0 must be resolvable before it is Ready: the others dial it while it waits for them.
            "publishNotReadyAddresses": True,
            "selector": opts.labels,
            "ports": [{"name": "rendezvous", "port": RDZV_PORT, "targetPort": RDZV_PORT}],
        },
    )


def indexed_job(opts: ClusterOptions, res: PodResources) -> dict:
    container = {
        "name": pod.CONTAINER,
        "image": opts.image,
        "command": list(pod.COMMAND),
        "env": pet_env(opts) + pod.base_env() + pod.secret_env(opts),
        "ports": [{"name": "rendezvous", "containerPort": RDZV_PORT}],
        "resources": pod.resources(res),
        "volumeMounts": pod.volume_mounts(),
    }
    return manifest(
        opts, "batch/v1", "Job", opts.name,
        spec={
            "completionMode": "Indexed",
            "completions": opts.nnodes,
            "parallelism": opts.nnodes,
            # One lost pod breaks the collective of all: fail fast, restart the job, resume from
            # the newest checkpoint (torchrun's --max-restarts covers in-pod rank failures).
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": opts.labels, "annotations": pod.annotations(opts)},
                "spec": {
                    "subdomain": opts.service_name,
                    "restartPolicy": "Never",
                    "nodeSelector": pod.node_selector(opts),
                    "tolerations": pod.tolerations(opts),
                    "containers": [container],
                    "volumes": pod.volumes(opts, res),
                },
            },
        },
    )
