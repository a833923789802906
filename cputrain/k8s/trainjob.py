"""Kubeflow Trainer v2: a TrainJob on the `torch-distributed` runtime.

The runtime starts one pod per node and injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT. numProcPerNode is always an explicit integer: "auto"
would start one rank per CPU of the pod — dozens of ranks, each with its own copy of the
model state — which is how hand-written jobs run out of memory or deadlock.
Pod-level settings (volumes, node selection, the do-not-disrupt annotation) go in a
runtime patch on the runtime's "node" job. The patch can set the pods' grace period but not the
Job's podFailurePolicy (the TrainJob API has no such field): whether a stopped pod (exit 75)
restarts is the runtime's JobSet failure policy, which the cluster's ClusterTrainingRuntime owns.
Progress (cputrain.metrics.trainjob_progress) needs nothing rendered here: where the controller
runs with the TrainJobStatus feature gate, its plugin adds to every trainer container the
KUBEFLOW_TRAINER_SERVER_URL/_CA_CERT/_TOKEN variables and the projected volume they name (at
/var/run/secrets/kubeflow/trainer: a token whose audience is this TrainJob, and the CA from a
ConfigMap it makes), so none of the patch's volume names may be `kubeflow-trainer-token`.
Without the gate there is no endpoint, and an Indexed Job has none either.
"""

from __future__ import annotations

from cputrain.k8s import pod
from cputrain.k8s.options import ClusterOptions, PodResources, manifest

API_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "torch-distributed"
REPLICATED_JOB = "node"  # the torch-distributed runtime's one replicated job
PATCH_MANAGER = "cputrain.k8s/render"


def trainjob(opts: ClusterOptions, res: PodResources) -> dict:
    pod_spec = {
        **pod.termination(opts),
        "nodeSelector": pod.node_selector(opts),
        "tolerations": pod.tolerations(opts),
        "volumes": pod.volumes(opts, res),
        "containers": [{"name": pod.CONTAINER, "volumeMounts": pod.volume_mounts()}],
    }
    return manifest(
        opts, API_VERSION, "TrainJob", opts.name,
        spec={
            "runtimeRef": {"name": RUNTIME, "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"},
            "trainer": {
                "image": opts.image,
                "command": list(pod.COMMAND),
                "numNodes": opts.nnodes,
                "numProcPerNode": opts.nproc_per_node,
                "resourcesPerNode": pod.resources(res),
                "env": pod.base_env() + pod.secret_env(opts),
            },
            "runtimePatches": [{
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                    "name": REPLICATED_JOB,
                    "template": {"spec": {"template": {
                        "metadata": {"labels": opts.labels, "annotations": pod.annotations(opts)},
                        "spec": pod_spec,
                    }}},
                }]}}},
            }],
        },
    )
