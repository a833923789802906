"""The FSDP layouts compared by both plans: parallel.layout=auto's choice (the fastest by the time
plan of those whose memory plan fits) and the table of every layout on every instance type that
`cputrain plan` prints. What each layout is lives in its spec (cputrain.parallel.fsdp_layouts).

    choice   parallel.layout=auto, in a plan (on an instance type) and in a run (on its node)
    table    every layout side by side on every instance type
"""

from cputrain.plan.layouts.choice import (LayoutFigures, full_shard_fit, layout_choice, layout_on_instance,
                                          layout_on_node, plans_by_layout)
from cputrain.plan.layouts.table import beat_one_node_line, layout_table, table_document, table_lines
