"""flowgraph.compilers: executors that run an execution plan (local, fsdp, ray)."""
