"""Memory per rank before a run: what each rank will hold, and the smallest cluster that fits it.

    model_shape   every parameter's shape, from a config on the meta device (no weights)
    accounting    bytes of parameters, gradients and optimizer state each rank holds
    activations   bytes saved for the backward pass, and communication buffers
    estimate      one rank's plan: the rows above plus the fixed process overhead
    instances     the instance families a cluster can be built from (built-in or a user file)
    fit           the smallest cluster whose nodes hold every rank's plan
    report        the printed table and plan.json
"""
