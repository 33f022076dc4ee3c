"""The fsdp target: N processes, SPMD, FSDP2; the same numbers as the local executor.

`flowgraph run FILE --target fsdp --nproc N` starts N processes through torch's
elastic launcher (what `torchrun` runs; `--nnodes/--node-rank/--rdzv-endpoint` for
several machines), or, started by `torchrun` itself (`WORLD_SIZE` set), runs as one of
its ranks. Every rank runs the training loop (`flowgraph.compilers.loop`) with an
`FsdpTarget`:

* placement: models the plan marks `full_shard` are wrapped with FSDP2 per block
  (`_dist.shard_model`; heads and tied embeddings replicated), gloo on CPU, nccl on
  GPU; the rest are replicated.
* dispatch: every rank holds the whole batch of every edge (the data sources draw the
  same batch everywhere; model-free nodes — rewards, advantages — run on the whole
  batch on every rank, as the plan's pool says). A data-parallel node takes its slice
  (`_dist.Slices`, group-aligned where the plan says so), runs, and its outputs are
  all-gathered back to the whole batch. Update nodes get the whole batch and the
  update loop takes this rank's share of each mini-batch
  (`flowgraph.compilers.update_loop`), so each optimizer step sees the mini-batch a
  one-process run sees.
* checkpoints: `torch.distributed.checkpoint` (a different N can resume them; so can
  the local target, whose own checkpoints resume here too), rank 0 publishes the
  folder atomically.

Rank 0 alone writes metrics, TensorBoard and the console line. A rank that fails
leaves its step and node in `run_dir/.ranks/rank_R`; the launching process names them
and how to resume.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import sys
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from flowgraph.compilers import _dist
from flowgraph.compilers.checkpoint import (
    Rollout,
    begin_checkpoint,
    checkpoint_root,
    latest_checkpoint,
    load_weights,
    publish_checkpoint,
    rng_state,
    save_shards,
    set_rng_state,
)
from flowgraph.compilers.local import prepare_run
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.options import RunOptions
from flowgraph.compilers.target import Report
from flowgraph.compilers.worker import ExecOptions, Worker
from flowgraph.errors import FlowgraphError, RankFailed, WorkerLost
from flowgraph.plan import ExecutionPlan
from flowgraph.runtime.metrics import serving


class FsdpTarget:
    """One rank of an fsdp run."""

    label = "rank0"

    def __init__(self, plan: ExecutionPlan, opts: ExecOptions, rank: int, world: int, *,
                 exporting: bool = False) -> None:
        self.plan, self.opts, self.rank, self.world = plan, opts, rank, world
        self.writes = rank == 0
        self.exporting = exporting
        """Prometheus is on (rank 0 serves it): every rank reports to rank 0 each step."""
        self.group = _dist.DataParallel()
        self.worker = Worker(plan, opts, tuple(m for p in plan.pools for m in p.models),
                             place=lambda placed, model: _dist.place(placed, model, world,
                                                                     opts.device))

    def start(self) -> None:
        self.worker.load_models()

    # -- dispatch -------------------------------------------------------------------------

    def dispatch(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float], *, evaluation: bool = False
                 ) -> tuple[dict[str, Any], float]:
        """A data-parallel node as the plan dispatches its inputs: on this rank's slice,
        its outputs all-gathered; on the whole batch shared out by rank (`broadcast`: an
        update takes its share of each mini-batch); else whole. The rest whole, here."""
        node = self.plan.node(name)
        if not evaluation:
            _dist.write_status(self.opts.run_dir, self.rank, step, name)
        if evaluation or self.world == 1 or not node.data_parallel:
            return self.worker.dispatch(name, inputs, step, params, metrics,
                                        evaluation=evaluation)
        cut = _dist.cut(self.plan, name, inputs, self.world)
        dp = {"dp_rank": self.rank, "dp_size": self.world, "workers": self.group}
        if cut.slices is None:  # every rank holds the whole batch
            return self.worker.call(name, inputs, step, params, metrics,
                                    **(dp if cut.shared else {}))
        outputs, seconds = self.worker.call(
            name, {**inputs, **cut.parts(self.rank)}, step, params, metrics,
            row_offset=cut.slices.bounds[self.rank][0], **dp)
        return _dist.join_outputs(self.plan, name, outputs, cut.slices,
                                  lambda _, value: _dist.all_gather(value, self.world)), seconds

    # -- checkpoints ----------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], rollouts: list[Rollout] | None
             ) -> None:
        run_dir = self.opts.run_dir
        tmp = checkpoint_root(run_dir) / f"step_{step}.tmp-fsdp"
        if self.rank == 0:
            begin_checkpoint(run_dir, step, "tmp-fsdp")
        dist.barrier()
        w = self.worker
        save_shards(tmp, w.saved_models(), w.optimizers, w.schedulers, self.rank)
        torch.save(rng_state(), tmp / f"rng.rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            publish_checkpoint(tmp, state, keep=self.plan.graph.trainer.max_checkpoints,
                               rollouts=rollouts)
        dist.barrier()

    def load(self, folder: Path) -> None:
        w = self.worker
        load_weights(folder, w.saved_models(), w.optimizers, w.schedulers)
        rng = folder / f"rng.rank{self.rank}.pt"
        if rng.exists():  # absent: more ranks than wrote it, or another target wrote it
            set_rng_state(torch.load(rng, weights_only=False))

    # -- the run ----------------------------------------------------------------------------

    def barrier(self) -> None:
        dist.barrier()

    def report(self, step: int, metrics: dict[str, float]) -> list[Report]:
        """Every rank's node seconds and memory, gathered on rank 0 for its endpoint (a
        `worker="rank<R>"` label each; rank 0's own row goes through its MetricsLog)."""
        if not self.exporting or self.world == 1:
            return []
        from flowgraph.runtime.prometheus import process_memory

        mine = ({k: v for k, v in metrics.items() if k.startswith("timing_s/")},
                process_memory())
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        if self.rank:
            return []
        return [(f"rank{rank}", timings if rank else {}, memory)
                for rank, (timings, memory) in enumerate(every)]

    def recover(self, exc: WorkerLost, step: int) -> Path | None:
        raise exc  # a lost rank ends the job; the launcher says how to resume

    def completed(self, saved: bool) -> None:
        pass


# --- processes -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(plan_json: str, strict: bool, resume: bool, metrics_port: int | None = None,
              metrics_host: str = "127.0.0.1", metrics_hold: float = 0.0) -> None:
    """The body of one rank (under torch's launcher: RANK, WORLD_SIZE, LOCAL_RANK set).
    Rank 0 serves Prometheus metrics on `metrics_port` when it is given."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = ExecutionPlan.from_json(Path(plan_json).read_text())
    run_dir = Path(plan.graph.trainer.run_dir)
    device = "cpu"
    if plan.graph.resources.device != "cpu" and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    else:  # share the cores: N ranks with all cores each would oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    exporting = (plan.graph.trainer.metrics_port if metrics_port is None
                 else metrics_port) is not None
    try:
        with serving(plan.graph, metrics_port, metrics_host, hold=metrics_hold,
                     target="fsdp", out=sys.stdout, here=rank == 0) as exporter:
            # A rank silent for trainer.step_timeout_s fails its peers' next collective:
            # the hang ends the job like a death (and names the ranks' positions).
            _dist.init_group(rank, world, device,
                             timeout_s=plan.graph.trainer.step_timeout_s or 1800.0)
            options = ExecOptions(run_dir, device, strict, resume, out=sys.stdout,
                                  exporter=exporter)
            target = FsdpTarget(plan, options, rank, world, exporting=exporting)
            loop = TrainingLoop(plan, target, options)
            loop.setup()
            loop.run()
    except BaseException as exc:
        where = _dist.read_status(run_dir, rank)
        text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, FlowgraphError) else str(exc)
        (run_dir / ".ranks").mkdir(parents=True, exist_ok=True)
        named = where is None or f"node `{where[1]}`" in text
        (run_dir / ".ranks" / f"error_{rank}").write_text(
            text + ("" if named or where is None
                    else f"\n(at step {where[0]}, node `{where[1]}`)"))
        (run_dir / ".ranks" / f"traceback_{rank}").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def world_size(plan: ExecutionPlan) -> int:
    """Processes in all: the size of the plan's one pool (`spmd`)."""
    (pool,) = [p for p in plan.pools if p.bundles]
    return pool.size


def launch(plan: ExecutionPlan, opts: RunOptions, out: TextIO | None = None) -> Path:
    """Run `plan` on its pool's processes, `opts.nnodes` machines sharing them evenly;
    the run dir when it finished."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    out = out or sys.stdout
    run_dir = prepare_run(plan, resume=opts.resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks = run_dir / ".ranks"
    for stale in ranks.glob("*") if ranks.is_dir() else []:
        stale.unlink()
    plan_json = run_dir / ".ranks" / "plan.json"
    plan_json.parent.mkdir(exist_ok=True)
    plan_json.write_text(plan.to_json())
    endpoint = opts.rdzv_endpoint or f"127.0.0.1:{_free_port()}"
    world = world_size(plan)
    if world % opts.nnodes:
        raise FlowgraphError(f"the plan's {world} processes do not split over --nnodes "
                             f"{opts.nnodes} machines")
    config = LaunchConfig(
        min_nodes=opts.nnodes, max_nodes=opts.nnodes, nproc_per_node=world // opts.nnodes,
        run_id=f"flowgraph-{uuid.uuid4().hex[:8]}" if opts.rdzv_endpoint is None
        else f"flowgraph-{plan.graph.name}",
        rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": opts.node_rank == 0} if opts.nnodes > 1 else {},
        max_restarts=0, monitor_interval=0.1, start_method="spawn")
    try:
        with _quiet_launcher():
            elastic_launch(config, rank_main)(str(plan_json), opts.strict, opts.resume,
                                              opts.metrics_port, opts.metrics_host,
                                              opts.metrics_hold)
    except ChildFailedError as exc:
        raise RankFailed(_failure_message(exc, run_dir, plan, opts)) from None
    return run_dir


def _failure_message(exc: Any, run_dir: Path, plan: ExecutionPlan, opts: RunOptions) -> str:
    """`rank 1 died (SIGKILL) at step 3 in node `update_actor``, with how to resume."""
    lines, traces = [], []
    # The first failure first: the others are often its echo (a peer's broken pipe).
    for rank, failure in sorted(exc.failures.items(), key=lambda f: (f[1].timestamp, f[0])):
        error = run_dir / ".ranks" / f"error_{rank}"
        if error.exists():
            lines.append(f"rank {rank} failed: {error.read_text().strip()}")
            traces.append(str(run_dir / ".ranks" / f"traceback_{rank}"))
            continue
        where = _dist.read_status(run_dir, rank)
        code = failure.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}")
        at = f" at step {where[0]} in node `{where[1]}`" if where else " before its first node"
        lines.append(f"rank {rank} {how}{at}")
    done = latest_checkpoint(run_dir)
    # --resume also without a checkpoint: the run dir already holds metrics.jsonl rows
    # The user's overrides too: without them the resumed run would be another graph.
    again = shlex.join(
        ["flowgraph", "run", str(opts.plan_file), "--resume",
         *opts.overrides] if opts.plan_file else
        ["flowgraph", "run", plan.graph.source, "--target", "fsdp", "--nproc",
         str(world_size(plan)), "--resume",
         *(o for o in opts.overrides if not o.startswith("trainer.run_dir=")),
         f"trainer.run_dir={run_dir}"])
    tail = (f"the last checkpoint is step {done[0]}; continue with: {again}" if done
            else f"no checkpoint was written; start again from step 0 with: {again}")
    if traces:
        tail += f"\n(the full traceback: {', '.join(traces)})"
    return "the fsdp run stopped: " + "; ".join(lines) + f"\n{tail}"


@contextmanager
def _quiet_launcher() -> Iterator[None]:
    """Torch's launcher logs every failed rank's traceback, and a line for each rank it
    then stops; `_failure_message` says what failed instead, and the traceback stays in
    `run_dir/.ranks/traceback_R`."""
    loggers = [logging.getLogger(name) for name in (
        "torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def run_fsdp(plan: ExecutionPlan, opts: RunOptions) -> None:
    """`flowgraph run --target fsdp`: as a rank when torchrun started us, else launch."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        prepare_run(plan, resume=opts.resume, check_only=int(os.environ["RANK"]) != 0)
        plan_json = Path(plan.graph.trainer.run_dir) / ".ranks" / f"plan.{os.environ['RANK']}.json"
        plan_json.parent.mkdir(parents=True, exist_ok=True)
        plan_json.write_text(plan.to_json())
        rank_main(str(plan_json), opts.strict, opts.resume,
                  opts.metrics_port, opts.metrics_host, opts.metrics_hold)
        return
    launch(plan, opts)
