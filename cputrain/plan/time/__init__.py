"""How long a step takes on the planned cluster, and how long a stop takes:

    comm_volume      the collectives of a step per strategy: bytes per rank and through a node's link
    measured_mfu     the MFU a time plan assumes, from this project's benchmarks
    link_efficiency  gloo's share of the line rate, from a measured table (gloo_link_efficiency.json)
    step_time        one step: compute, network, overlap, tokens/s (the API benchmarks call)
    advice           the same step re-planned with one setting changed, where the network dominates
    report           the time plan as printed and in plan.json
    stop_window      how long a stop takes: a step and a checkpoint save
"""
