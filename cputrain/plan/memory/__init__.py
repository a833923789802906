"""Memory per rank before a run, from decided values:

    accounting    bytes of parameters, gradients and optimizer state each rank holds
    activations   bytes saved for the backward pass, and communication buffers
    estimate      one rank's plan: the rows above plus the fixed process overhead
    fit           the smallest cluster whose nodes hold every rank's plan
    build         make_plan: the inputs, every rank's plan and the cluster that fits
    checkpointing model.activation_checkpointing=auto: as little recompute as the node's memory allows
    report        the printed table and plan.json
    runtime       plan.json of the run being started, and a warning when the node cannot hold it
    compare       a run's plan.json against its measured memory.json
"""
