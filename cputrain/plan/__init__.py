"""Before a run: what each rank will hold and the smallest cluster that fits it (memory), then
how long a step takes on that cluster (time). The time plan reads the memory plan, never the
other way; what both read sits here:

    model_shape   every parameter's shape, from a config on the meta device (no weights)
    instances     the instance families a cluster can be built from (built-in or a user file)
"""
