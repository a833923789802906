"""For clusters without Kubeflow: an Indexed Job (one pod per node) and a headless Service.

Each pod gets its node rank from its completion index, and finds node 0 by the DNS name the
headless Service gives it: `<job>-0.<service>`. The pod sets the same PET_* variables the
Kubeflow runtime would, so the container command is the same.
"""

from __future__ import annotations

from cputrain.errors import Stopped
from cputrain.k8s import pod
from cputrain.k8s.options import RDZV_PORT, ClusterOptions, PodResources, manifest

STOPPED_EXIT_CODE = Stopped.exit_code  # `cputrain train` stopped by a signal, its checkpoint saved
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
            # A pod stopped on purpose is not a failure: one evicted by a node drain or a spot
            # reclaim (the DisruptionTarget condition), or one that exited 75 after saving its
            # checkpoint because another node's pod was stopped. Ignore = a new pod, no count
            # against backoffLimit: the job resumes from that checkpoint.
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "Ignore", "onExitCodes": {"containerName": pod.CONTAINER, "operator": "In",
                                                     "values": [STOPPED_EXIT_CODE]}},
            ]},
            "template": {
                "metadata": {"labels": opts.labels, "annotations": pod.annotations(opts)},
                "spec": {
                    "subdomain": opts.service_name,
                    "restartPolicy": "Never",  # podFailurePolicy requires it
                    **pod.termination(opts),
                    "nodeSelector": pod.node_selector(opts),
                    "tolerations": pod.tolerations(opts),
                    "containers": [container],
                    "volumes": pod.volumes(opts, res),
                },
            },
        },
    )
