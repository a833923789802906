"""Native runtime libraries a training process can run on: the malloc (allocator) and what else
this machine has (libs: Intel's OpenMP runtime), found on the system and preloaded into ranks; and how
long libgomp's workers wait between operators (openmp_waits), set before torch loads."""
