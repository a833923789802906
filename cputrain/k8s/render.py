"""Every object of a run, in the order `kubectl apply` should create them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cputrain.config import Config
from cputrain.k8s import indexed_job, karpenter, storage, trainjob
from cputrain.k8s.options import ClusterOptions, pod_resources
from cputrain.plan.build import Plan, make_plan
from cputrain.plan.fit import allocatable_gib, pod_memory_bytes
from cputrain.plan.instances import Instance, find_instance

KINDS = ("trainjob", "job")


@dataclass
class Rendered:
    objects: list[dict]
    plan: Plan
    options: ClusterOptions  # with the instance type the plan chose


def render(cfg: Config, opts: ClusterOptions, instances: list[Instance], kind: str = "trainjob",
           config_json: str | None = None, plan: Plan | None = None) -> Rendered:
    opts.check()
    if kind not in KINDS:
        raise ValueError(kind)
    plan = plan or make_plan(cfg, opts.world_size, nproc_per_node=opts.nproc_per_node,
                             instances=None if opts.instance_type else instances, config_json=config_json)
    rank_peak = max(r.total_bytes for r in plan.ranks)
    given = bool(opts.instance_type)
    if given:
        inst = find_instance(instances, opts.instance_type)
    else:
        inst = plan.fit.instance
        opts = replace(opts, instance_type=inst.name)
    res = pod_resources(opts, pod_memory_bytes(rank_peak, opts.nproc_per_node), inst.vcpus, allocatable_gib(inst),
                        instance_given=given)

    objects = []
    if opts.karpenter:
        objects += [karpenter.node_pool(opts, instances), karpenter.ec2_node_class(opts)]
    objects.append(storage.config_map(cfg, opts))
    if opts.pvc is None:
        objects.append(storage.output_claim(opts))
    if kind == "trainjob":
        objects.append(trainjob.trainjob(opts, res))
    else:
        objects += [indexed_job.service(opts), indexed_job.indexed_job(opts, res)]
    return Rendered(objects, plan, opts)
