"""Memory per rank before a run: what each rank will hold, and the smallest cluster that fits it;
then how long a step takes on that cluster.

    model_shape   every parameter's shape, from a config on the meta device (no weights)
    accounting    bytes of parameters, gradients and optimizer state each rank holds
    activations   bytes saved for the backward pass, and communication buffers
    estimate      one rank's plan: the rows above plus the fixed process overhead
    instances     the instance families a cluster can be built from (built-in or a user file)
    fit           the smallest cluster whose nodes hold every rank's plan
    report        the printed table and plan.json
    comm_volume   the collectives of a step per strategy: bytes per rank and through a node's link
    measured_mfu  the MFU a time plan assumes, from this project's benchmarks
    link_efficiency  gloo's share of the line rate, from a measured table
    step_time     one step: compute, network, overlap, tokens/s (the API benchmarks call)
    time_advice   the same step re-planned with one setting changed, where the network dominates
    time_report   the time plan as printed and in plan.json
"""
