"""flowgraph.compilers.targets.ray — the ray target: a single controller and one Ray worker
group per resource pool.

`flowgraph run FILE --target ray [--address ADDR]` runs this driver in the launching
process. With no address it starts an embedded Ray cluster on this machine (as many
logical CPUs as the plan's bundles need, at least the machine's cores; its node at
127.0.0.1, so that Ray's own servers listen on loopback alone), as its own: never the
cluster `RAY_ADDRESS` or Ray's `ray_current_cluster` file names; with one, it joins that
cluster. The driver runs the training loop (`flowgraph.compilers.loop`)
with a `RayTarget`:

* placement: each pool of the plan (e.g. `actor_rollout_ref`: actor, rollout and
  reference colocated; `critic`) becomes a placement group with one bundle per worker
  and a group of `RayWorker` actors in it. A worker loads only its pool's models; in a
  group of size > 1 the workers form a torch process group (gloo on CPU, nccl on GPU)
  and shard their models with FSDP2 (`process_groups.shard_model`), as the fsdp target does.
* dispatch: the driver holds the whole batch of every edge and runs the model-free
  nodes (data, rewards, advantages) itself. A node placed on a pool is sent there:
  data-parallel nodes get one slice per worker (`process_groups.Slices`, group-aligned where
  the plan says), broadcast inputs go once into the object store, and the slices
  come back and are concatenated; update nodes get the whole batch on every worker and
  the update loop takes the worker's share of each mini-batch
  (`flowgraph.compilers.update_loop`). Tensors move through Ray's object store.
* asynchronous rollouts (`trainer.max_staleness` S > 0): the producer runs on a pool of
  its own, the plan's rollout pool (`flowgraph.compilers.rollouts.pool`), overlapping
  these groups; the trained weights go to it after every update (`trained_weights`).
* checkpoints: every worker writes its shards with DCP into the same folder as the
  fsdp target (`step_N/dcp/<model>`); the driver publishes it atomically, with the
  data cursors and node state. A checkpoint of the local target resumes here too. So
  the driver and every worker must see one run dir: before any model loads, each
  worker reads a marker the driver wrote into `run_dir/.ranks` and writes its own, which
  the driver reads back; a worker on a node without the run dir stops the run, named
  with its node (`flowgraph.compilers.targets.fsdp.multinode`: fsdp's machines prove it alike).
* names: the run is `flowgraph/<run name>` on the cluster (the run dir's name): its Ray
  namespace, the prefix of its placement groups' names (`flowgraph/<run name>/<pool>`)
  and of its actors' (`flowgraph/<run name>/<pool>/<index>`), so that `ray list actors`
  and the dashboard tell two runs on one cluster apart. Each worker writes its stdout and
  stderr to `run_dir/logs/<pool>-<index>.log`, after a line naming it, its host, node
  and pid and when it started; Ray also forwards it to the driver's console
  (`flowgraph.compilers.targets.ray.worker.log_to`).
* faults: a worker that dies (its actor is gone, or its peers' process group broke:
  a node lost whole), or hangs (no answer within `trainer.step_timeout_s`: named with
  its node, pid and log) is noticed at the driver's next wait; the driver kills every
  worker group, starts them afresh (their placement groups wait, bounded, for a lost
  node to come back or be replaced:
  `flowgraph.compilers.targets.ray.cluster`), reloads the last checkpoint and goes on from
  the step after it. metrics.jsonl is cut back to that step first, so it ends with
  every step exactly once. After `MAX_RESTARTS` restarts in a row without a completed
  checkpoint the run stops with the last error. A worker lost while the run stops
  (SIGTERM) is not restarted: the run says that no checkpoint could be written and
  which steps are lost (`StopUnsaved`).

The room: `driver` (start or join the cluster, run the loop), `target` (`RayTarget`,
the strategy), `worker` (a pool's Ray actor), `calls` (waiting on workers, placement
groups, names), `cluster` (what the run does when the cluster loses a part).
"""
