"""Every object of a run, in the order `kubectl apply` should create them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from cputrain.config import Config
from cputrain.k8s import indexed_job, karpenter, storage, trainjob
from cputrain.k8s.checks import quantity_value
from cputrain.k8s.options import ClusterOptions, pod_resources
from cputrain.plan.memory.build import Plan, make_plan
from cputrain.plan.memory.fit import GIB, allocatable_gib, pod_memory_bytes, smallest_cluster
from cputrain.plan.instances import Instance, find_instance
from cputrain.plan.time import EXIT_MARGIN_S, Network, SPOT_NOTICE_S, stop_window
from cputrain.training.choices import decide_for_plan

log = logging.getLogger("cputrain")

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
    # The plan of `cfg` with its keys decided as `cputrain plan` decides them; the ConfigMap keeps
    # `cfg` as written, so each pod decides its "auto"s on its own node. No instance fit in the
    # plan: the render fits the whole pod (its ranks and /dev/shm) below.
    given = bool(opts.instance_type)
    plan = plan or _plan(cfg, opts, [find_instance(instances, opts.instance_type)] if given else instances,
                         config_json)
    rank_peak = max(r.total_bytes for r in plan.ranks)
    if given:
        inst = find_instance(instances, opts.instance_type)
    else:
        # The plan's fit counts the ranks; the pod also holds its memory-backed /dev/shm, and asks
        # for whole GiB (up to 1 GiB more): the smallest instance that holds all of that.
        shm_bytes = int(quantity_value(opts.shm_size, "--shm-size"))
        inst = smallest_cluster(instances, rank_peak, opts.world_size, opts.nproc_per_node,
                                pod_extra_bytes=shm_bytes + GIB).instance
        opts = replace(opts, instance_type=inst.name)
    res = pod_resources(opts, pod_memory_bytes(rank_peak, opts.nproc_per_node), inst.vcpus, allocatable_gib(inst),
                        instance_given=given)
    opts = _with_stop_window(cfg, opts, plan, inst)

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


def _plan(cfg: Config, opts: ClusterOptions, instances: list[Instance], config_json: str | None) -> Plan:
    """`cfg`'s keys decided as `cputrain plan` decides them, parallel.layout on the instance types
    the pods may get (and their placement group), then the memory plan without a fit: the render
    fits the whole pod."""
    res = decide_for_plan(cfg, opts.world_size, nproc_per_node=opts.nproc_per_node, instances=instances,
                          network=Network(placement_group=opts.placement_group is not None), config_json=config_json)
    return make_plan(res.config, opts.world_size, nproc_per_node=opts.nproc_per_node, config_json=config_json,
                     reasons=res.reasons)


def _with_stop_window(cfg: Config, opts: ClusterOptions, plan: Plan, inst: Instance) -> ClusterOptions:
    """The pods' grace period and the agent's stop timeout: the plan's step plus checkpoint save,
    or --grace-period-s. Said on stderr, since it decides whether a drain loses work."""
    window = stop_window(plan, cfg.train.global_batch_size, inst, opts.nnodes,
                         storage_write_mib_s=opts.storage_write_mib_s)
    if opts.grace_period_s is None:
        grace, stop_timeout = window.grace_period_s, window.stop_timeout_s
        log.info("pods: terminationGracePeriodSeconds %d (%s; --grace-period-s sets it)", grace, window.describe())
    else:
        grace, stop_timeout = opts.grace_period_s, max(1, opts.grace_period_s - EXIT_MARGIN_S)
        if grace < window.grace_period_s:
            log.warning("--grace-period-s %d is below the plan's %d s (%s): a drain may kill a checkpoint save "
                        "half-way (the previous checkpoint is kept)", grace, window.grace_period_s, window.describe())
    if stop_timeout > SPOT_NOTICE_S:
        log.info("a spot node gets %d s of notice, less than this run's stop window: on spot capacity, set "
                 "train.checkpoint_every_s so a reclaim loses at most that much", SPOT_NOTICE_S)
    return replace(opts, grace_period_s=grace, stop_timeout_s=stop_timeout)
