"""The ray target: the strategy through which the training loop drives a Ray run's worker
groups (`flowgraph.compilers.target`); started by `flowgraph.compilers.targets.ray.driver`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgraph.compilers.checkpoint.store import (
    Rollout,
    begin_checkpoint,
    intact_checkpoint,
    publish_checkpoint,
)
from flowgraph.compilers.target import Report
from flowgraph.compilers.targets import process_groups
from flowgraph.compilers.targets.ray.calls import answers, ray_name, reserve
from flowgraph.compilers.targets.ray.cluster import check_fits, cluster_nodes
from flowgraph.compilers.targets.ray.worker import (
    DRIVER_MARKER,
    RayWorker,
    worker_log,
    worker_marker,
)
from flowgraph.compilers.targets.shared_run_dir import draw_token, mark, marked, not_one_run_dir
from flowgraph.compilers.worker import ExecOptions, Worker
from flowgraph.errors import FlowgraphError, WorkerLost
from flowgraph.plan import DRIVER, ExecutionPlan, PoolPlan, plan_to_json
from flowgraph.spelling import option

try:
    import ray
    from ray.util.placement_group import remove_placement_group
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise FlowgraphError(f"{option('target', 'ray')} needs Ray: pip install 'ray>=2.40' "
                         f"({exc})") from exc


MAX_RESTARTS = 3
"""Worker-group restarts allowed without a new checkpoint in between."""


@dataclass
class Group:
    """A pool's running workers."""

    pool: PoolPlan
    workers: list[Any]
    pg: Any
    names: list[str] | None = None
    """Each worker as a message names it: its pool and rank, Ray node and pid, its log."""


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
            placed = self._get([w.node.remote() for w in group.workers], timed=False)
            name = group.pool.name
            for i, (node, *_) in enumerate(placed):
                self.held.setdefault(node, []).append(f"worker {i} of pool `{name}`")
            group.names = [f"worker {i} of pool `{name}` (node {address}, pid {pid}; its "
                           f"output: {worker_log(Path(), name, i)} in the run dir)"
                           for i, (_, address, pid) in enumerate(placed)]
            one_node = len({node for node, *_ in placed}) == 1
            addr, port = self._get(group.workers[0].endpoint.remote(one_node), timed=False)
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
             timed: bool = True, names: list[str] | None = None) -> Any:
        return answers(refs, (self.plan.trainer.step_timeout_s or None) if timed else None,
                       where, names)

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
                 metrics: dict[str, float]) -> tuple[dict[str, Any], float]:
        """A node of a pool on its workers, as the plan dispatches its inputs: sliced where
        it splits them (the slices come back and are concatenated), else the whole batch
        to every worker (`broadcast`: an update takes its share of each mini-batch); a
        model-free node here."""
        placed = self.plan.node(name)
        if placed.pool not in self.groups:
            return self.worker.call(name, inputs, step, params, metrics)
        group = self.groups[placed.pool]
        world = len(group.workers)
        cut = None if world == 1 or not placed.data_parallel \
            else process_groups.cut(self.plan, name, inputs, world)
        slices = cut.slices if cut is not None else None
        if slices is None:  # the whole batch to every worker
            shared = {port: ray.put(v) for port, v in inputs.items()}
            dp = [{"dp_rank": w, "dp_size": world} if cut is not None and cut.shared else {}
                  for w in range(world)]  # broadcast: an update takes its share
            results = self._get([wk.call.remote(name, shared, step, params, dp[w])
                                 for w, wk in enumerate(group.workers)], (name, step),
                                names=group.names)
        else:
            assert cut is not None
            parts = [cut.parts(w) for w in range(world)]
            shared = {p: ray.put(v) for p, v in inputs.items() if p not in parts[0]}  # once
            results = self._get([wk.call.remote(name, {**shared, **parts[w]}, step, params,
                                                {"dp_rank": w, "dp_size": world,
                                                 "row_offset": slices.bounds[w][0]})
                                 for w, wk in enumerate(group.workers)], (name, step),
                                names=group.names)
        for w, r in enumerate(results):
            self.worker_times.setdefault(f"{placed.pool}/{w}", {})[f"timing_s/{name}"] = r[1]
        outputs = results[0][0] if slices is None else process_groups.join_outputs(
            self.plan, name, results[0][0], slices,
            lambda port, _: [r[0][port] for r in results])
        metrics.update(results[0][2])
        return outputs, max(r[1] for r in results)

    def evaluate(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float]) -> None:
        """An update's held-out metrics on its pool's workers, each on the whole batch
        (rank 0's are the run's); a model-free one here."""
        placed = self.plan.node(name)
        if placed.pool not in self.groups:
            self.worker.evaluate_update(name, inputs, step, params, metrics)
            return
        shared = {port: ray.put(v) for port, v in inputs.items()}
        group = self.groups[placed.pool]
        results = self._get([wk.evaluate.remote(name, shared, step, params)
                             for wk in group.workers], (name, step), names=group.names)
        metrics.update(results[0])

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
        groups = self.groups.values()
        self._get([w.save.remote(str(tmp)) for g in groups for w in g.workers],
                  f"while saving the checkpoint of step {step}",
                  names=[n for g in groups for n in g.names or ()] or None)
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
