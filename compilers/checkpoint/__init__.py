"""flowgraph.compilers.checkpoint — checkpoints: `store` (the step folders, written
atomically, read back, the rollout buffer), `integrity` (one writer, a manifest, nothing
run as code), `resume` (what a resumed run must share with its checkpoint)."""
