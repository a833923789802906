"""Lock files shared by several processes, nodes or pods: the atomic file operations, and one heartbeat
lock built on them (used by run.lock and by each token-cache entry)."""
