"""Everything about ranks: who started us, where each rank runs, and the process group."""
