"""The ray target: a single controller and one Ray worker group per resource pool.

`flowgraph run FILE --target ray [--address ADDR]` runs this driver in the launching
process. With no address it starts an embedded Ray cluster on this machine (as many
logical CPUs as the plan's bundles need, at least the machine's cores; its node at
127.0.0.1, so that Ray's own servers listen on loopback alone); with one, it joins that
cluster. The driver runs the training loop (`flowgraph.compilers.loop`)
with a `RayTarget`:

* placement: each pool of the plan (e.g. `actor_rollout_ref`: actor, rollout and
  reference colocated; `critic`) becomes a placement group with one bundle per worker
  and a group of `RayWorker` actors in it. A worker loads only its pool's models; in a
  group of size > 1 the workers form a torch process group (gloo on CPU, nccl on GPU)
  and shard their models with FSDP2 (`_dist.shard_model`), as the fsdp target does.
* dispatch: the driver holds the whole batch of every edge and runs the model-free
  nodes (data, rewards, advantages) itself. A node placed on a pool is sent there:
  data-parallel nodes get one slice per worker (`_dist.Slices`, group-aligned where
  the plan says), broadcast inputs go once into the object store, and the slices
  come back and are concatenated; update nodes get the whole batch on every worker and
  the update loop takes the worker's share of each mini-batch
  (`flowgraph.compilers.update_loop`). Tensors move through Ray's object store.
* asynchronous rollouts (`trainer.max_staleness` S > 0): the producer runs on a pool of
  its own, the plan's rollout pool (`flowgraph.compilers.rollout_pool`), overlapping
  these groups; the trained weights go to it after every update (`trained_weights`).
* checkpoints: every worker writes its shards with DCP into the same folder as the
  fsdp target (`step_N/dcp/<model>`); the driver publishes it atomically, with the
  data cursors and node state. A checkpoint of the local target resumes here too. So
  the driver and every worker must see one run dir: before any model loads, each
  worker reads a marker the driver wrote into `run_dir/.ranks` and writes its own, which
  the driver reads back; a worker on a node without the run dir stops the run, named
  with its node (`flowgraph.compilers.machines`: fsdp's machines prove it alike).
* names: the run is `flowgraph/<run name>` on the cluster (the run dir's name): its Ray
  namespace, the prefix of its placement groups' names (`flowgraph/<run name>/<pool>`)
  and of its actors' (`flowgraph/<run name>/<pool>/<index>`), so that `ray list actors`
  and the dashboard tell two runs on one cluster apart. Each worker writes its stdout and
  stderr to `run_dir/logs/<pool>-<index>.log`, which Ray also forwards to the driver's
  console (`flowgraph.compilers.ray_worker.log_to`).
* faults: a worker that dies (its actor is gone, or its peers' process group broke:
  a node lost whole), or hangs (no answer within `trainer.step_timeout_s`) is noticed
  at the driver's next wait; the driver kills every worker group, starts them afresh
  (their placement groups wait, bounded, for a lost node to come back or be replaced:
  `flowgraph.compilers.ray_cluster`), reloads the last checkpoint and goes on from
  the step after it. metrics.jsonl is cut back to that step first, so it ends with
  every step exactly once. After `MAX_RESTARTS` restarts in a row without a completed
  checkpoint the run stops with the last error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgraph.compilers import _dist
from flowgraph.compilers.checkpoint import (
    Rollout,
    begin_checkpoint,
    intact_checkpoint,
    publish_checkpoint,
)
from flowgraph.compilers.local import prepare_run
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.machines import draw_token, mark, marked, not_one_run_dir
from flowgraph.compilers.options import RunOptions
from flowgraph.compilers.ray_calls import answers, namespace, ray_name, reserve, run_name
from flowgraph.compilers.ray_cluster import check_fits, cluster_nodes, watched
from flowgraph.compilers.ray_worker import DRIVER_MARKER, RayWorker, worker_marker
from flowgraph.compilers.signals import child_pids, reap_with_parent, run_guard
from flowgraph.compilers.target import Report
from flowgraph.compilers.worker import ExecOptions, Worker
from flowgraph.errors import DEBUG_ENV, FlowgraphError, WorkerLost
from flowgraph.plan import DRIVER, ExecutionPlan, PoolPlan, plan_to_json
from flowgraph.registry import plugin_source
from flowgraph.runtime.metrics import serving
from flowgraph.voice import ENTRY_ENV, Word, option

MAX_RESTARTS = 3
"""Worker-group restarts allowed without a new checkpoint in between."""
NAMESPACE_WAIT_S = 5.0
"""The longest wait for a dead run's actors to leave the run's namespace (`--address`)."""

try:
    import ray
    import ray._private.ray_constants as ray_constants
    from ray.util.placement_group import remove_placement_group
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise FlowgraphError(f"{option('target', 'ray')} needs Ray: pip install 'ray>=2.40' "
                         f"({exc})") from exc


# --- the driver ------------------------------------------------------------------------------


@dataclass
class Group:
    """A pool's running workers."""

    pool: PoolPlan
    workers: list[Any]
    pg: Any


class RayTarget:
    """The single controller: it hosts no model, runs the model-free nodes itself and
    sends the others to their pool's workers."""

    label = "driver"
    writes = True

    def __init__(self, plan: ExecutionPlan, opts: ExecOptions) -> None:
        self.plan, self.opts = plan, opts
        self.worker = Worker(plan, opts, ())
        """The driver's own: model-free nodes, their state, the tokenizers."""
        self.groups: dict[str, Group] = {}
        self.restarts: list[float] = []
        """Seconds from each noticed fault to the next completed step."""
        self.failed_at: float | None = None
        """When the fault being recovered from was noticed (perf_counter)."""
        self.worker_times: dict[str, dict[str, float]] = {}
        """This step's node seconds per worker (`pool/rank`), for Prometheus."""
        self.tries = 0
        """Restarts since the last checkpoint."""
        self.held: dict[str, list[str]] = {}
        """Ray node id -> the workers it runs (e.g. worker 1 of pool `critic`)."""

    # -- worker groups --------------------------------------------------------------------

    def start(self, checkpoint: Path | None = None, *, again: bool = False) -> None:
        """A placement group and a group of `RayWorker`s per pool, set up (their models
        loaded, from `checkpoint` when given). `again`: a restart after a lost worker,
        whose placement groups wait (`placed`, bounded) for a lost node to come back or
        be replaced, naming it, instead of the first start's check of the cluster."""
        if not again:
            check_fits(self.plan, cluster_nodes())  # a shortfall is a message, not a wait
        held, self.held = self.held, {}
        sent = (plan_to_json(self.plan), self.plan.pickled_objects())
        cwd, path = os.getcwd(), [p for p in sys.path if p]
        for pool in self.plan.pools:
            if pool.name == DRIVER or not pool.bundles:
                continue
            pg, places = reserve(pool, name=ray_name(self.plan, pool.name), held=held)
            remote = ray.remote(RayWorker)
            workers = [remote.options(name=ray_name(self.plan, pool.name, i), **places[i]
                                      ).remote(sent, pool.name, i, cwd, path,
                                               str(self.opts.run_dir))
                       for i in range(pool.size)]
            self.groups[pool.name] = Group(pool, workers, pg)
        self._prove_shared_run_dir()  # before any model loads
        # Set up every group at once: workers of a group rendezvous with each other.
        pending = []
        for group in self.groups.values():
            nodes = self._get([w.node.remote() for w in group.workers], timed=False)
            for i, node in enumerate(nodes):
                self.held.setdefault(node, []).append(f"worker {i} of pool `{group.pool.name}`")
            addr, port = self._get(group.workers[0].endpoint.remote(len(set(nodes)) == 1),
                                   timed=False)
            pending += [w.setup.remote(addr, port, str(self.opts.run_dir),
                                       str(checkpoint) if checkpoint else None)
                        for w in group.workers]
        self._get(pending, "while setting up", timed=False)  # loading models is not a step
        # Who is who, for operators (and tests) that want to signal a worker.
        (self.opts.run_dir / ".ranks").mkdir(parents=True, exist_ok=True)
        (self.opts.run_dir / ".ranks" / "workers.json").write_text(
            json.dumps(self.worker_pids(), indent=2))

    def _prove_shared_run_dir(self) -> None:
        """The driver writes a marker holding a fresh token into `run_dir/.ranks`; every
        worker reads it and writes its own (`RayWorker.sees`), which the driver reads
        back. A worker on a node that does not mount the run dir would write its
        checkpoint shards to a disk of its own, and the driver publish checkpoints
        without them: such a worker stops the run, named with its node."""
        token = draw_token()
        mark(self.opts.run_dir, DRIVER_MARKER, token)
        workers = [(g.pool.name, i, w) for g in self.groups.values()
                   for i, w in enumerate(g.workers)]
        seen = self._get([w.sees.remote(str(self.opts.run_dir), token) for *_, w in workers],
                         "while looking for the run dir", timed=False)
        check_shared_run_dir(self.opts.run_dir, token, {
            (pool, i): answer for (pool, i, _), answer in zip(workers, seen, strict=True)})

    def stop(self) -> None:
        for group in self.groups.values():
            for w in group.workers:
                ray.kill(w, no_restart=True)
            remove_placement_group(group.pg)
        self.groups.clear()

    def worker_pids(self) -> dict[str, list[int]]:
        return {name: self._get([w.pid.remote() for w in g.workers], "while listing its pid")
                for name, g in self.groups.items()}

    def _get(self, refs: Any, where: tuple[str, int] | str | None = None, *,
             timed: bool = True) -> Any:
        return answers(refs, (self.plan.trainer.step_timeout_s or None) if timed else None,
                       where)

    def trained_weights(self, models: list[str], *, changed: bool) -> list[Any]:
        """The current weights of trained `models`, whole (model -> name -> tensor, on
        CPU), as object-store references, one per pool hosting some of them: a call that
        takes them as arguments waits for them, the driver does not. Every worker of the
        pool takes part (an entry sharded over them is made whole by a collective); the
        reference is worker 0's. `changed`: only the entries an update changes."""
        refs = []
        for group in self.groups.values():
            hosted = [m for m in models if m in {p.name for p in group.pool.models}]
            if hosted:
                calls = [w.weights.remote(hosted, changed) for w in group.workers]
                refs.append(calls[0])  # the others take part in the collective
        return refs

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float], *, evaluation: bool = False
                 ) -> tuple[dict[str, Any], float]:
        """A node of a pool on its workers, as the plan dispatches its inputs: sliced where
        it splits them (the slices come back and are concatenated), else the whole batch
        to every worker (`broadcast`: an update takes its share of each mini-batch); a
        model-free node here."""
        placed = self.plan.node(name)
        if placed.pool not in self.groups:
            return self.worker.dispatch(name, inputs, step, params, metrics,
                                        evaluation=evaluation)
        group = self.groups[placed.pool]
        world = len(group.workers)
        cut = None if world == 1 or not placed.data_parallel or evaluation \
            else _dist.cut(self.plan, name, inputs, world)
        slices = cut.slices if cut is not None else None
        if slices is None:  # the whole batch to every worker
            shared = {port: ray.put(v) for port, v in inputs.items()}
            dp = [{"dp_rank": w, "dp_size": world} if cut is not None and cut.shared else {}
                  for w in range(world)]  # broadcast: an update takes its share
            results = self._get([wk.call.remote(name, shared, step, params, dp[w], evaluation)
                                 for w, wk in enumerate(group.workers)], (name, step))
        else:
            assert cut is not None
            parts = [cut.parts(w) for w in range(world)]
            shared = {p: ray.put(v) for p, v in inputs.items() if p not in parts[0]}  # once
            results = self._get([wk.call.remote(name, {**shared, **parts[w]}, step, params,
                                                {"dp_rank": w, "dp_size": world,
                                                 "row_offset": slices.bounds[w][0]})
                                 for w, wk in enumerate(group.workers)], (name, step))
        if not evaluation:
            for w, r in enumerate(results):
                self.worker_times.setdefault(f"{placed.pool}/{w}", {})[f"timing_s/{name}"] = r[1]
        outputs = results[0][0] if slices is None else _dist.join_outputs(
            self.plan, name, results[0][0], slices,
            lambda port, _: [r[0][port] for r in results])
        metrics.update(results[0][2])
        return outputs, max(r[1] for r in results)

    def report(self, step: int, metrics: dict[str, float]) -> list[Report]:
        """The first step completed after a restart says how long recovering took
        (`perf/recovery_s`); with Prometheus on, every pool worker's node seconds and
        memory (one endpoint on the driver, a `worker="<pool>/<rank>"` label each)."""
        if self.failed_at is not None:
            metrics["perf/recovery_s"] = time.perf_counter() - self.failed_at
            self.restarts.append(metrics["perf/recovery_s"])
            self.failed_at = None
        times, self.worker_times = self.worker_times, {}
        if self.opts.exporter is None:
            return []
        out = []
        for name, group in self.groups.items():
            usage = self._get([w.memory.remote() for w in group.workers],
                              "while reporting its memory")
            out += [(f"{name}/{rank}", times.get(f"{name}/{rank}", {}), memory)
                    for rank, memory in enumerate(usage)]
        return out

    def barrier(self) -> None:
        pass

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], rollouts: list[Rollout] | None
             ) -> None:
        tmp = begin_checkpoint(self.opts.run_dir, step, "tmp-ray")
        self._get([w.save.remote(str(tmp)) for g in self.groups.values() for w in g.workers],
                  f"while saving the checkpoint of step {step}")
        publish_checkpoint(tmp, state, keep=self.plan.trainer.max_checkpoints,
                           rollouts=rollouts)

    def load(self, folder: Path) -> None:
        """Every worker loads its pool's part of the checkpoint."""
        self._get([w.load.remote(str(folder)) for g in self.groups.values()
                   for w in g.workers], f"while loading {folder.name}", timed=False)

    # -- restarts ---------------------------------------------------------------------------

    def recover(self, exc: WorkerLost, step: int) -> Path | None:
        """Fresh worker groups holding the last checkpoint, which the loop then goes on
        from (None: none yet, start over). After `MAX_RESTARTS` restarts without a new
        checkpoint in between, the run stops."""
        self.tries += 1
        if self.tries > MAX_RESTARTS:
            raise WorkerLost(f"{exc}; gave up after {MAX_RESTARTS} restarts without a new "
                             "checkpoint") from None
        self.failed_at = self.failed_at or time.perf_counter()
        print(f"step {step}: {exc}; restarting the worker groups from the last checkpoint",
              file=self.opts.out or sys.stdout, flush=True)
        self.stop()
        found = intact_checkpoint(self.opts.run_dir, lambda line: print(
            line, file=self.opts.out or sys.stdout, flush=True))
        self.start(found[1] if found else None, again=True)
        return found[1] if found else None

    def completed(self, saved: bool) -> None:
        self.tries = 0 if saved else self.tries

    def stop_requested(self) -> int | None:
        """The driver's signal (the workers, in a process group of their own, get none)."""
        return self.opts.stop.signum if self.opts.stop is not None else None


def check_shared_run_dir(run_dir: Path, token: str,
                         seen: dict[tuple[str, int], tuple[str, bool]]) -> None:
    """Stop unless every worker saw the driver's marker in `run_dir` holding `token` and
    wrote its own, which the driver sees. `seen`: (pool, index) -> (the worker's node
    address, whether it saw the driver's marker), its answer to `RayWorker.sees`."""
    blind = []
    for (pool, index), (address, saw) in seen.items():
        missed = [] if saw else ["does not see the driver's files"]
        if not marked(run_dir, worker_marker(pool, index), token):
            missed.append("writes files the driver does not see")
        if missed:
            blind.append(f"worker {index} of pool `{pool}` (node {address}) "
                         + " and ".join(missed))
    if blind:
        raise not_one_run_dir(f"the driver (run dir `{run_dir}`) and its Ray workers",
                              "; ".join(blind), "a Ray run on several nodes", "every worker")


# --- entry point ------------------------------------------------------------------------------


def cluster_cpus(plan: ExecutionPlan) -> int:
    """Logical CPUs the embedded cluster offers: the plan's bundles (its rollout pool's
    too), at least the cores."""
    rollout = plan.asynchronous.pool if plan.asynchronous is not None else None
    need = sum(b.cpu for p in (*plan.pools, *([rollout] if rollout else [])) for b in p.bundles)
    return max(need, os.cpu_count() or 1)


def start_ray(plan: ExecutionPlan, address: str | None) -> None:
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    env = _runtime_env(plan)
    if address:
        try:
            _answers(address)
            ray.init(address=address, log_to_driver=True, runtime_env=env,
                     namespace=namespace(plan))
        except (OSError, RuntimeError, ValueError) as exc:  # ConnectionError is an OSError
            raise FlowgraphError(
                f"cannot join the Ray cluster at `{address}`: {exc}. Is `ray start --head` "
                "running there (its address, or `auto` on a machine of the cluster)? Or "
                f"leave out {option('address', Word('ADDR'))} for a local cluster") from None
        _namespace_free(plan, address)
        return
    _private_token()
    before = child_pids()
    with _loopback_node():
        ray.init(num_cpus=cluster_cpus(plan), include_dashboard=False, log_to_driver=True,
                 configure_logging=False, runtime_env=env, namespace=namespace(plan),
                 _node_ip_address="127.0.0.1")
    reap_with_parent(child_pids() - before)  # a killed driver takes the cluster along


@contextmanager
def _loopback_node() -> Iterator[None]:
    """The embedded cluster's node at 127.0.0.1, so that every server of Ray's (GCS,
    raylet and object manager, dashboard and runtime-env agents, metrics, each worker's
    gRPC server) listens there alone, as Ray does when its node's address is 127.0.0.1.
    `ray.init` replaces a loopback `_node_ip_address` with the machine's outward address
    unless Ray runs no cluster of several machines (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
    which Ray reads once, when imported): that setting is off while `ray.init` starts the
    node, and as it was afterwards (a later `--address` run in this process joins as
    usual). The node's processes take their address from their command line."""
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _namespace_free(plan: ExecutionPlan, address: str) -> None:
    """Stop when the run's namespace on the cluster joined holds live actors: another
    run's whose run dir has the same name (one run dir is one run: its lock). A dead
    driver's actors are Ray's to end, which it does within a second (measured 0.1 s);
    they are waited for `NAMESPACE_WAIT_S` at most."""
    deadline = time.monotonic() + NAMESPACE_WAIT_S
    while held := ray.util.list_named_actors():  # this job's namespace
        if time.monotonic() > deadline:
            raise FlowgraphError(
                f"the Ray cluster at `{address}` runs actors of another run in namespace "
                f"`{namespace(plan)}` ({', '.join(sorted(held)[:3])}): a run's Ray names "
                f"come from its run dir's name, `{run_name(plan)}`; give this run a run dir "
                f"of another name, e.g. {option('run_dir', f'runs/{run_name(plan)}-2')}")
        time.sleep(0.5)


def _private_token() -> None:
    """Ray (2.5x) enables token authentication on a cluster `ray.init` starts and, when
    it finds no token, writes one to `~/.ray/auth_token` readable by everyone (0644).
    Write it first, readable by its owner alone (0600); tighten one left readable."""
    told = os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" or any(
        k in os.environ for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"))
    if told or importlib.util.find_spec("ray._private.authentication") is None:
        return  # the user's token, or a Ray without token authentication
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # as `ray get-auth-token --generate` makes one


def _runtime_env(plan: ExecutionPlan) -> dict[str, Any] | None:
    """What the job's workers need wherever they run: the plugin files and packages
    next to the graph (`py_modules`, uploaded with the job) and `--debug`."""
    env: dict[str, Any] = {}
    told = {k: os.environ[k] for k in (DEBUG_ENV, ENTRY_ENV) if k in os.environ}
    if told:  # `--debug`; the voice of the workers' messages (`flowgraph.voice`)
        env["env_vars"] = told
    sources = [plugin_source(p.module, folder) for p in plan.plugins
               for folder in plan.plugin_paths]
    modules = sorted({str(s) for s in sources if s is not None})
    if modules:
        env["py_modules"] = modules
    return env or None


def _answers(address: str) -> None:
    """Raise OSError when nothing listens at a `host:port` address: `ray.init` would
    retry such an address for minutes before it gives up."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # `auto`, `ray://...`: Ray resolves those itself
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5):  # [::1]:6379
        pass


def run_ray(plan: ExecutionPlan, opts: RunOptions) -> None:
    """`flowgraph run --target ray`: start or join a cluster (`opts.address`) and drive
    the plan. Prometheus metrics as `run_plan` serves them, from the driver."""
    run_dir = prepare_run(plan, resume=opts.resume, overwrite=opts.overwrite).resolve()
    with serving(plan, opts.metrics_port, opts.metrics_host, hold=opts.metrics_hold,
                 target="ray", out=opts.out) as exporter, run_guard(plan, opts) as stop:
        target = None
        try:
            start_ray(plan, opts.address)
            stop.take_signals()  # ray.init's SIGTERM handler would end the driver
            options = ExecOptions(run_dir, "cpu", opts.strict, opts.resume, opts.out,
                                  opts.tensorboard, exporter, stop=stop,
                                  allow_changed=opts.allow_changed)
            with watched(plan, opts):  # a lost head or node: what to do, not Ray's exit
                target = RayTarget(plan, options)
                loop = TrainingLoop(plan, target, options)
                loop.setup()
                loop.run()
        finally:  # workers first: the endpoint is held after this block
            if target is not None:
                target.stop()
            if opts.shutdown and not opts.address and ray.is_initialized():
                ray.shutdown()
