"""The training config as a ConfigMap, and the claim that holds the run folder.

The config is the user's, with output_dir and the data cache moved onto the claim so every
node writes one run folder (checkpoints must be on storage all nodes share, such as FSx). A
DeepSpeed file named by parallel.deepspeed_config is a path on the machine that renders; it
goes into the same ConfigMap, and the pod's config points at its mounted copy.
"""

from __future__ import annotations

from pathlib import Path

from cputrain.config import Config
from cputrain.k8s import pod
from cputrain.k8s.options import ClusterOptions, manifest


DEEPSPEED_FILE = "deepspeed.json"


def pod_config(cfg: Config, opts: ClusterOptions) -> Config:
    pod_cfg = cfg.model_copy(deep=True)
    pod_cfg.output_dir = f"{pod.OUTPUT_DIR}/{opts.name}"
    pod_cfg.data.cache_dir = f"{pod.OUTPUT_DIR}/.cache/cputrain"
    if cfg.parallel.deepspeed_config:
        pod_cfg.parallel.deepspeed_config = f"{pod.CONFIG_DIR}/{DEEPSPEED_FILE}"
    if opts.stop_timeout_s is not None:  # the agent waits for the save as long as the pod may
        pod_cfg.launch.stop_timeout_s = opts.stop_timeout_s
    return pod_cfg


def config_map(cfg: Config, opts: ClusterOptions) -> dict:
    header = ("# Rendered by `cputrain k8s`. Nodes, ranks per node, node rank and master address\n"
              "# come from the PET_* variables of the pod, not from this file.\n")
    data = {pod.CONFIG_FILE: header + pod_config(cfg, opts).dump_yaml()}
    if cfg.parallel.deepspeed_config:
        from cputrain.parallel.deepspeed_config import read_user_config

        # Read and checked here (bad JSON, a wrong stage fail now, not in the pods); shipped as is.
        read_user_config(cfg.parallel.deepspeed_config)
        data[DEEPSPEED_FILE] = Path(cfg.parallel.deepspeed_config).read_text()
    return manifest(opts, "v1", "ConfigMap", f"{opts.name}-config", data=data)


def output_claim(opts: ClusterOptions) -> dict:
    return manifest(
        opts, "v1", "PersistentVolumeClaim", opts.pvc_name,
        spec={
            "accessModes": ["ReadWriteMany"],  # every node writes the same run folder
            "storageClassName": opts.storage_class,
            "resources": {"requests": {"storage": opts.storage}},
        },
    )
