"""Kubernetes manifests for a cputrain run, rendered from the same config `cputrain train` reads.

    checks       names, quantities, counts and the image: refused with the field named
    options      what the cluster side needs (image, nodes, ranks, pool, volumes, secrets)
    pod          the one container every variant runs: `cputrain train` driven by PET_*
    trainjob     Kubeflow Trainer v2 TrainJob (runtime torch-distributed)
    indexed_job  a plain Indexed Job + headless Service, for clusters without Kubeflow
    karpenter    NodePool + EC2NodeClass for the AMX instance families
    storage      the ConfigMap with the training config, the PVC for the run folder
    render       every object of a run, in apply order
    output       multi-document YAML on stdout, or one file per object
"""
