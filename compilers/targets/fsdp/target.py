"""The fsdp target: one rank's strategy through which the training loop runs
(`flowgraph.compilers.target`); the ranks are started by `flowgraph.compilers.targets.fsdp.launch`.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flowgraph.compilers.checkpoint.integrity import load_plain
from flowgraph.compilers.checkpoint.store import (
    Rollout,
    begin_checkpoint,
    load_weights,
    publish_checkpoint,
    save_rng,
    save_shards,
    set_rng_state,
)
from flowgraph.compilers.signals import (
    STOP_FILE,
)
from flowgraph.compilers.target import Report
from flowgraph.compilers.targets import process_groups
from flowgraph.compilers.worker import ExecOptions, Worker
from flowgraph.errors import (
    WorkerLost,
)
from flowgraph.plan import ExecutionPlan
from flowgraph.runs import checkpoint_root


class FsdpTarget:
    """One rank of an fsdp run."""

    label = "rank0"

    def __init__(self, plan: ExecutionPlan, opts: ExecOptions, rank: int, world: int, *,
                 exporting: bool = False) -> None:
        self.plan, self.opts, self.rank, self.world = plan, opts, rank, world
        self.writes = rank == 0
        self.exporting = exporting
        """Prometheus is on (rank 0 serves it): every rank reports to rank 0 each step."""
        self.group = process_groups.DataParallel()
        self.worker = Worker(plan, opts, tuple(m for p in plan.pools for m in p.models),
                             place=lambda placed, spec, model: process_groups.place(
                                 placed, spec, model, world, opts.device))
        self.evaluate = self.worker.evaluate_update
        """An update's held-out metrics: every rank holds the whole batch."""

    def start(self) -> None:
        self.worker.load_models()

    # -- dispatch -------------------------------------------------------------------------

    def dispatch(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float]) -> tuple[dict[str, Any], float]:
        """A data-parallel node as the plan dispatches its inputs: on this rank's slice,
        its outputs all-gathered; on the whole batch shared out by rank (`broadcast`: an
        update takes its share of each mini-batch); else whole. The rest whole, here."""
        node = self.plan.node(name)
        process_groups.write_status(self.opts.run_dir, self.rank, step, name)
        if self.world == 1 or not node.data_parallel:
            return self.worker.call(name, inputs, step, params, metrics)
        cut = process_groups.cut(self.plan, name, inputs, self.world)
        dp = {"dp_rank": self.rank, "dp_size": self.world, "workers": self.group}
        if cut.slices is None:  # every rank holds the whole batch
            return self.worker.call(name, inputs, step, params, metrics,
                                    **(dp if cut.shared else {}))
        outputs, seconds = self.worker.call(
            name, {**inputs, **cut.parts(self.rank)}, step, params, metrics,
            row_offset=cut.slices.bounds[self.rank][0], **dp)
        joined = process_groups.join_outputs(
            self.plan, name, outputs, cut.slices,
            lambda _, value: process_groups.all_gather(value, self.world))
        return joined, seconds

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
        save_rng(tmp / f"rng.rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            publish_checkpoint(tmp, state, keep=self.plan.trainer.max_checkpoints,
                               rollouts=rollouts)
        dist.barrier()

    def load(self, folder: Path) -> None:
        w = self.worker
        load_weights(folder, w.saved_models(), w.optimizers, w.schedulers)
        rng = folder / f"rng.rank{self.rank}.pt"
        if rng.exists():  # absent: more ranks than wrote it, or another target wrote it
            set_rng_state(load_plain(rng))

    # -- the run ----------------------------------------------------------------------------

    def barrier(self) -> None:
        dist.barrier()

    def report(self, step: int, metrics: dict[str, float]) -> list[Report]:
        """Every rank's node seconds and memory, gathered on rank 0 for its endpoint (a
        `worker="rank<R>"` label each; the step row is rank 0's, through its MetricsLog)."""
        if not self.exporting or self.world == 1:
            return []
        from flowgraph.runtime.prometheus import process_memory

        mine = ({k: v for k, v in metrics.items() if k.startswith("timing_s/")},
                process_memory())
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        if self.rank:
            return []
        return [(f"rank{rank}", timings, memory)
                for rank, (timings, memory) in enumerate(every)]

    def recover(self, exc: WorkerLost, step: int) -> Path | None:
        raise exc  # a lost rank ends the job; the launcher says how to resume

    def stop_requested(self) -> int | None:
        """A stop every rank agrees on: this rank's signal, the launcher's (its stop
        file), or another rank's (a MAX all-reduce, so all stop at the same node)."""
        stop = self.opts.stop
        mine = stop.signum if stop is not None and stop.signum is not None else 0
        told = self.opts.run_dir / STOP_FILE
        if not mine and told.exists():
            mine = int(told.read_text().strip() or signal.SIGTERM)
        agreed = torch.tensor([mine], device=self.opts.device)
        if self.world > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        signum = int(agreed.item())
        if signum and stop is not None and stop.signum is None:
            stop.request(signum, note=False)  # a signal after this one stops at once
        return signum or None

    def completed(self, saved: bool) -> None:
        pass
