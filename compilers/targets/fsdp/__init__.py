"""flowgraph.compilers.targets.fsdp — the fsdp target: N processes, SPMD, FSDP2; the same
numbers as the local executor.

`flowgraph run FILE --target fsdp --nproc N` starts N processes through torch's
elastic launcher (what `torchrun` runs; `--nnodes/--node-rank/--rdzv-endpoint` for
several machines), or, started by `torchrun` itself (`WORLD_SIZE` set), runs as one of
its ranks. Every rank runs the training loop (`flowgraph.compilers.loop`) with an
`FsdpTarget`:

* placement: models the plan marks `full_shard` are wrapped with FSDP2 per block
  (`process_groups.shard_model`; heads and tied embeddings replicated), gloo on CPU, nccl on
  GPU; the rest are replicated.
* dispatch: every rank holds the whole batch of every edge (the data sources draw the
  same batch everywhere; model-free nodes — rewards, advantages — run on the whole
  batch on every rank, as the plan's pool says). A data-parallel node takes its slice
  (`process_groups.Slices`, group-aligned where the plan says so), runs, and its outputs are
  all-gathered back to the whole batch. Update nodes get the whole batch and the
  update loop takes this rank's share of each mini-batch
  (`flowgraph.compilers.update_loop`), so each optimizer step sees the mini-batch a
  one-process run sees.
* checkpoints: `torch.distributed.checkpoint` (a different N can resume them; so can
  the local target, whose own checkpoints resume here too), rank 0 publishes the
  folder atomically.

Rank 0 alone writes metrics, TensorBoard and the console line. Every rank's stdout and
stderr are also in `run_dir/logs/rank-<R>.log` (`flowgraph.compilers.logs`). A rank that
fails leaves its step and node in `run_dir/.ranks/rank_R`; the launching process names
them, the failed ranks' logs and how to resume.

The room: `launch` (the ranks started, each rank's body, the failure report), `target`
(`FsdpTarget`, one rank's strategy), `multinode` (the machines of a multi-node launch).
"""
