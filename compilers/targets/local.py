"""The local target: one process, CPU or one GPU, every model whole.

    run_plan(plan, opts)      Prometheus served, then
      TrainingLoop(plan, LocalTarget(plan, options), options).setup() / .run()

`LocalTarget` is the simplest strategy of `flowgraph.compilers.target`: its worker
hosts every pool's models, `dispatch` calls a node in this process on the whole
batch, and a checkpoint is whole files (`model.<m>.safetensors`, `optim.<m>.pt`,
`sched.<m>.pt`, `rng.pt`, and `manifest.json`); a checkpoint of the fsdp or ray target
(DCP shards) loads here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flowgraph.compilers.checkpoint.store import (
    Rollout,
    load_weights,
    save_checkpoint,
    trained_modules,
)
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.options import RunOptions
from flowgraph.compilers.signals import run_guard
from flowgraph.compilers.target import Report
from flowgraph.compilers.worker import ExecOptions, Worker, pick_device
from flowgraph.errors import WorkerLost
from flowgraph.plan import ExecutionPlan
from flowgraph.runtime.metrics import serving


class LocalTarget:
    """Every model whole, in this process."""

    writes = True
    label = "local"

    def __init__(self, plan: ExecutionPlan, opts: ExecOptions) -> None:
        self.opts, self.keep = opts, plan.trainer.max_checkpoints
        self.worker = Worker(plan, opts, tuple(m for p in plan.pools for m in p.models))
        self.dispatch = self.worker.call
        self.evaluate = self.worker.evaluate_update

    def start(self) -> None:
        self.worker.load_models()

    def save(self, step: int, state: dict[str, Any], rollouts: list[Rollout] | None
             ) -> None:
        w = self.worker
        save_checkpoint(self.opts.run_dir, step, state=state, keep=self.keep,
                        rollouts=rollouts, modules=trained_modules(
                            w.saved_models(), w.optimizers, w.schedulers))

    def load(self, folder: Path) -> None:
        w = self.worker
        load_weights(folder, w.saved_models(), w.optimizers, w.schedulers)

    def barrier(self) -> None:
        pass

    def report(self, step: int, metrics: dict[str, float]) -> list[Report]:
        return []

    def recover(self, exc: WorkerLost, step: int) -> Path | None:
        raise exc

    def completed(self, saved: bool) -> None:
        pass

    def stop_requested(self) -> int | None:
        return self.opts.stop.signum if self.opts.stop is not None else None


def run_plan(plan: ExecutionPlan, opts: RunOptions) -> None:
    """Set up and run a local plan (`flowgraph.compilers.run`, which prepared its run dir);
    refuses a run dir another run holds (`run_guard`: its lock; SIGTERM / SIGINT stop the
    run with a checkpoint). Prometheus metrics on
    `opts.metrics_port` (else `trainer.metrics_port`; 0 picks a free port) from before the
    models load until the run ends, and `opts.metrics_hold` seconds longer so a scraper
    sees the final values."""
    run_dir = Path(plan.trainer.run_dir)
    device = pick_device(plan.resources.device)
    # The guard inside `serving`: the metrics hold after the run is no longer the run's,
    # and Ctrl-C ends it at once
    with serving(plan, opts.metrics_port, opts.metrics_host, hold=opts.metrics_hold,
                 out=opts.out) as exporter, run_guard(plan, opts) as stop:
        options = ExecOptions(run_dir, device, opts.strict, opts.resume, opts.out,
                              opts.tensorboard, exporter,
                              step_timeout_s=plan.trainer.step_timeout_s, stop=stop,
                              allow_changed=opts.allow_changed)
        loop = TrainingLoop(plan, LocalTarget(plan, options), options)
        loop.setup()
        loop.run()
