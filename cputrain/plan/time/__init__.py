"""How long a step takes on the planned cluster, and how long a stop takes. This module is the time
plan's face: code outside cputrain.plan imports from here, never from the modules below.

    comm_volume      the collectives of a step per strategy: bytes per rank and through a node's link
    measured_mfu     the MFU a time plan assumes, from this project's benchmarks
    link_efficiency  gloo's share of the line rate, from a measured table (gloo_link_efficiency.json)
    link             the nodes' network: a collective's rate, gloo's share of it, its seconds
    overlap          how much of the network time no compute hides, one function per regime
    step_time        one step: compute, network, overlap, tokens/s (the API benchmarks call)
    on_instance      a memory plan's step on an instance type
    advice           the same step re-planned with one setting changed, where the network dominates
    report           the time plan as printed and in plan.json
    sharded_compute  what sharding costs a rank's compute: the factor a sharded run's compute takes, per
                     strategy, layout and allocator
    checkpoint_worth whether a checkpoint's save is worth the steps it protects
    stop_window      how long a stop takes: a step and a checkpoint save
"""

# The names below are the face: imported here for the code outside cputrain.plan.
from cputrain.plan.time.advice import remedies
from cputrain.plan.time.checkpoint_worth import CheckpointWorth, duration, worth_here, worth_of_plan
from cputrain.plan.time.comm_volume import comm_pattern, zero3_backward_gathers
from cputrain.plan.time.link import Link, node_link_gbit_s
from cputrain.plan.time.link_efficiency import EfficiencyTable, load_table, parse_table
from cputrain.plan.time.measured_mfu import cpu_kind, measured_mfu
from cputrain.plan.time.on_instance import ASSUMED_CLOCK_GHZ, RUN_NETWORK, Network, rank_peak_flops, step_on_instance
from cputrain.plan.time.overlap import PREFETCH_HIDDEN_SHARE, REDUCE_HIDDEN_SHARE
from cputrain.plan.time.sharded_compute import (IMAGE_ALLOCATOR, ShardedCompute, measured_compute, running_allocator,
                                               sharded_factor)
from cputrain.plan.time.report import summary_line, time_document, time_lines, time_plan
from cputrain.plan.time.step_time import Compute, StepSettings, StepTimePlan, plan_step_time, step_flops, token_flops
from cputrain.plan.time.stop_window import (ASSUMED_MFU, DEFAULT_STORAGE_WRITE_MIB_S, EXIT_MARGIN_S, SPOT_NOTICE_S,
                                            checkpoint_bytes, stop_window)

