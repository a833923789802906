"""`cputrain k8s CONFIG [key=value ...] --image IMG --nnodes N --nproc-per-node P --name NAME`."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "k8s",
        help="render Kubernetes manifests (Kubeflow TrainJob or Indexed Job, Karpenter pool) for a run",
        description="Render the manifests that run `cputrain train` on a cluster, sized by `cputrain plan`. "
        "Without --output a multi-document YAML goes to stdout (pipe it to `kubectl apply -f -`).",
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.strategy=fsdp")
    p.add_argument("--name", required=True, help="name of the job and its objects (DNS-1123 label)")
    p.add_argument("--image", help="training image (built from the Dockerfile); required")
    p.add_argument("--nnodes", type=int, required=True, help="nodes (pods), at least 1")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per pod; always explicit, never 'auto'")
    p.add_argument("--kind", choices=["trainjob", "job"], default="trainjob",
                   help="trainjob: Kubeflow Trainer v2; job: Indexed Job + headless Service (default: %(default)s)")
    p.add_argument("--namespace", default="default", help="namespace (default: %(default)s)")
    p.add_argument("--instance-type", help="e.g. m7i.16xlarge (default: the smallest the plan fits)")
    p.add_argument("--node-pool", default="cputrain-amx", help="Karpenter NodePool/EC2NodeClass name (default: %(default)s)")
    p.add_argument("--cluster-name", default="cputrain", help="EKS cluster name: Karpenter discovery tag and node role")
    p.add_argument("--placement-group", help="an EC2 cluster placement group (its name) the EC2NodeClass launches "
                   "nodes into: one TCP flow between them gets up to 10 Gbit/s instead of 5, as the time plan counts")
    p.add_argument("--no-karpenter", action="store_true", help="for a cluster without Karpenter: no NodePool or EC2NodeClass, and the pods "
                   "select the planned instance type (node.kubernetes.io/instance-type) instead of the pool")
    p.add_argument("--pvc", help="an existing PersistentVolumeClaim for the run folder (default: render <name>-output)")
    p.add_argument("--storage-class", default="fsx-sc", help="storage class of the rendered claim (default: %(default)s)")
    p.add_argument("--storage", default="1200Gi", help="size of the rendered claim (default: %(default)s)")
    p.add_argument("--hf-token-secret", help="Secret holding the Hugging Face token (key: --hf-token-key)")
    p.add_argument("--hf-token-key", default="token", help="key in that Secret (default: %(default)s)")
    p.add_argument("--secret-env", action="append", default=[], metavar="VAR=SECRET:KEY",
                   help="another variable from a Secret, by reference (repeatable)")
    p.add_argument("--cpu", help="CPU request and limit per pod (default: the instance's vCPUs minus 1)")
    p.add_argument("--memory", help="memory request and limit per pod (default: the plan plus /dev/shm)")
    p.add_argument("--shm-size", default="8Gi", help="size of the memory-backed /dev/shm (default: %(default)s)")
    p.add_argument("--grace-period-s", type=int, help="seconds a pod gets after SIGTERM to finish its step and save "
                   "(default: the plan's step plus checkpoint save, printed on stderr)")
    p.add_argument("--storage-write-mib-s", type=float, help="write rate of the run folder's storage that the "
                   "default grace period assumes (default: that of FSx for Lustre's smallest file system)")
    p.add_argument("--instances-file", help="YAML/JSON instance table (default: built-in c7i/m7i/r7i)")
    p.add_argument("--model-config", help="a config.json (or folder) to plan for instead of the config's model")
    p.add_argument("--output", help="write one file per object into this folder instead of stdout")
    p.add_argument("--overwrite", action="store_true", help="replace files in --output that have other content")
    return p


def run(args) -> int:
    from cputrain.k8s.options import ClusterOptions, parse_secret_env
    from cputrain.k8s.output import to_stream, write_folder
    from cputrain.k8s.render import render
    from cputrain.commands.plan import load_run_config
    from cputrain.plan.instances import load_instances

    opts = ClusterOptions(
        name=args.name, image=args.image, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
        namespace=args.namespace, instance_type=args.instance_type, node_pool=args.node_pool,
        cluster_name=args.cluster_name, placement_group=args.placement_group, pvc=args.pvc,
        storage_class=args.storage_class, storage=args.storage,
        hf_token_secret=args.hf_token_secret, hf_token_key=args.hf_token_key,
        secret_env=parse_secret_env(args.secret_env), cpu=args.cpu, memory=args.memory,
        shm_size=args.shm_size, karpenter=not args.no_karpenter, grace_period_s=args.grace_period_s,
        **({} if args.storage_write_mib_s is None else {"storage_write_mib_s": args.storage_write_mib_s}),
    ).check()  # names, counts, quantities and the image before the (slower) plan
    cfg = load_run_config(args.config, args.overrides)
    instances = load_instances(args.instances_file)
    out = render(cfg, opts, instances, kind=args.kind, config_json=args.model_config)
    _log_time_plan(cfg, out, instances)
    if args.output:
        for path in write_folder(out.objects, args.output, overwrite=args.overwrite):
            print(path)
    else:
        sys.stdout.write(to_stream(out.objects))
    return 0


def _log_time_plan(cfg, out, instances) -> None:
    """The time plan in one line on stderr (stdout carries the manifests)."""
    import logging

    from cputrain.plan.instances import find_instance
    from cputrain.plan.time import summary_line, time_plan

    inst = find_instance(instances, out.options.instance_type)
    tp = time_plan(out.plan, cfg.train.global_batch_size, inst, out.options.nproc_per_node, None, instances,
                   placement_group=out.options.placement_group is not None)
    logging.getLogger("cputrain").info(summary_line(tp))
