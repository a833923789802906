"""Karpenter NodePool (karpenter.sh/v1) and EC2NodeClass (karpenter.k8s.aws/v1) for AMX nodes.

The three must agree: the pool taints its nodes `intel.com/amx=true:NoSchedule` so only
training pods land there; the job tolerates that taint and selects the pool's label
`intel.com/amx=true` and `karpenter.sh/nodepool`. Requirement values are separate list items
(a fused "24xlarge, 48xlarge" is one value that matches no instance).

With a placement group (`--placement-group NAME`, made beforehand with `aws ec2 create-placement-group
--strategy cluster`), the EC2NodeClass launches its nodes into it: one TCP flow between them then
gets up to 10 Gbit/s instead of 5 (EC2's published per-flow limits), which the time plan counts.
"""

from __future__ import annotations

from cputrain.k8s import pod
from cputrain.k8s.options import ClusterOptions
from cputrain.plan.instances import Instance


def node_pool(opts: ClusterOptions, instances: list[Instance]) -> dict:
    amx = [i for i in instances if i.amx]
    families = sorted({i.family for i in amx})
    sizes = sorted({i.size for i in amx}, key=lambda s: (len(s), s))
    requirements = [
        {"key": "karpenter.k8s.aws/instance-family", "operator": "In", "values": families},
        {"key": "karpenter.k8s.aws/instance-size", "operator": "In", "values": sizes},
        {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
    ]
    # The pool offers every AMX size of the table; each job picks its instance type by nodeSelector.
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": opts.node_pool, "labels": {"app.kubernetes.io/name": "cputrain"}},
        "spec": {
            "template": {
                "metadata": {"labels": dict(pod.AMX_LABEL)},
                "spec": {
                    "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": opts.node_pool},
                    "taints": [{"key": pod.AMX_TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
                    "requirements": requirements,
                    "expireAfter": "Never",  # a training node is never recycled under a running job
                },
            },
            # Nodes go when empty; running pods also carry karpenter.sh/do-not-disrupt.
            "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "5m"},
        },
    }


def ec2_node_class(opts: ClusterOptions) -> dict:
    discovery = {"karpenter.sh/discovery": opts.cluster_name}
    return {
        "apiVersion": "karpenter.k8s.aws/v1",
        "kind": "EC2NodeClass",
        "metadata": {"name": opts.node_pool, "labels": {"app.kubernetes.io/name": "cputrain"}},
        "spec": {
            "role": f"KarpenterNodeRole-{opts.cluster_name}",
            "amiSelectorTerms": [{"alias": "al2023@latest"}],
            "subnetSelectorTerms": [{"tags": dict(discovery)}],
            "securityGroupSelectorTerms": [{"tags": dict(discovery)}],
            "blockDeviceMappings": [{
                "deviceName": "/dev/xvda",
                "ebs": {"volumeSize": "200Gi", "volumeType": "gp3", "encrypted": True},
            }],
            **({"placementGroupSelector": {"name": opts.placement_group}} if opts.placement_group else {}),
        },
    }
