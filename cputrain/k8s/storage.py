"""The training config as a ConfigMap, and the claim that holds the run folder.

The config is the user's, with output_dir and the data cache moved onto the claim so every
node writes one run folder (checkpoints must be on storage all nodes share, such as FSx).
"""

from __future__ import annotations

from cputrain.config import Config
from cputrain.k8s import pod
from cputrain.k8s.options import ClusterOptions


def pod_config(cfg: Config, opts: ClusterOptions) -> Config:
    pod_cfg = cfg.model_copy(deep=True)
    pod_cfg.output_dir = f"{pod.OUTPUT_DIR}/{opts.name}"
    pod_cfg.data.cache_dir = f"{pod.OUTPUT_DIR}/.cache/cputrain"
    return pod_cfg


def config_map(cfg: Config, opts: ClusterOptions) -> dict:
    header = ("# Rendered by `cputrain k8s`. Nodes, ranks per node, node rank and master address\n"
              "# come from the PET_* variables of the pod, not from this file.\n")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{opts.name}-config", "namespace": opts.namespace, "labels": opts.labels},
        "data": {pod.CONFIG_FILE: header + pod_config(cfg, opts).dump_yaml()},
    }


def output_claim(opts: ClusterOptions) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": opts.pvc_name, "namespace": opts.namespace, "labels": opts.labels},
        "spec": {
            "accessModes": ["ReadWriteMany"],  # every node writes the same run folder
            "storageClassName": opts.storage_class,
            "resources": {"requests": {"storage": opts.storage}},
        },
    }
