"""The local target: one process, CPU or one GPU, every model whole.

    run_plan(plan, opts)      the run dir checked, Prometheus served, then
      TrainingLoop(plan, LocalTarget(plan, options), options).setup() / .run()

`LocalTarget` is the simplest strategy of `flowgraph.compilers.target`: its worker
hosts every pool's models, `dispatch` calls a node in this process on the whole
batch, and a checkpoint is whole files (`model.<m>.safetensors`, `optim.<m>.pt`,
`sched.<m>.pt`, `rng.pt`, and `manifest.json`); a checkpoint of the fsdp or ray target
(DCP shards) loads here too.
`prepare_run` is what every target does before any model loads: the run dir created
and known writable, and refused when it holds a run unless resuming or overwriting it
(`clear_run_dir`: a flowgraph run dir's files only).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from flowgraph.compilers.checkpoint import (
    Rollout,
    latest_checkpoint,
    load_weights,
    save_checkpoint,
    trained_modules,
)
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.options import RunOptions
from flowgraph.compilers.signals import LOCK, RunLock, run_guard
from flowgraph.compilers.target import Report
from flowgraph.compilers.worker import TRACEBACK, ExecOptions, Worker, pick_device, quiet_hf
from flowgraph.errors import FlowgraphError, WorkerLost
from flowgraph.plan import ExecutionPlan
from flowgraph.runtime.metrics import serving
from flowgraph.runtime.trackers import check_trackers
from flowgraph.spelling import option


class LocalTarget:
    """Every model whole, in this process."""

    writes = True
    label = "local"

    def __init__(self, plan: ExecutionPlan, opts: ExecOptions) -> None:
        self.opts, self.keep = opts, plan.trainer.max_checkpoints
        self.worker = Worker(plan, opts, tuple(m for p in plan.pools for m in p.models))
        self.dispatch = self.worker.dispatch

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


def prepare_run(plan: ExecutionPlan, *, resume: bool, overwrite: bool = False,
                check_only: bool = False) -> Path:
    """The run dir, created and known writable before any model loads; refuses one that
    holds a run unless resuming or overwriting it (`clear_run_dir`), and a tracker whose
    package is missing. An earlier attempt's `traceback.txt` is removed: the file is the
    latest attempt's. Quiets Hugging Face."""
    check_trackers(plan.trainer)
    run_dir = Path(plan.trainer.run_dir)
    if check_only:
        return run_dir
    quiet_hf()
    held = bool(latest_checkpoint(run_dir) or (run_dir / "metrics.jsonl").exists())
    if held and overwrite and not resume:
        clear_run_dir(run_dir)
        held = False
    _writable(run_dir)
    if held and not resume:
        raise FlowgraphError(
            f"`{run_dir}` already holds a run; continue it with {option('resume')}, start "
            f"it afresh with {option('overwrite')}, or give another directory: "
            f"{option('run_dir', 'runs/new')}")
    (run_dir / TRACEBACK).unlink(missing_ok=True)
    return run_dir


def clear_run_dir(run_dir: Path) -> None:
    """Remove an earlier run's files to start afresh (`overwrite`) — only from a flowgraph
    run dir (it holds the `plan.json` a run writes), never from the working directory or a
    folder above it, and not while a live run holds its lock."""
    here, folder = Path.cwd().resolve(), run_dir.resolve()
    if folder == here or folder in here.parents or folder == Path.home().resolve():
        raise FlowgraphError(
            f"`{run_dir}` is the working directory, your home or a folder above them: "
            f"{option('overwrite')} removes nothing there; give the run a folder of its "
            f"own, e.g. {option('run_dir', 'runs/new')}")
    if not _wrote_plan(run_dir / "plan.json"):
        raise FlowgraphError(
            f"`{run_dir}` holds no plan.json of a flowgraph run, so {option('overwrite')} "
            "leaves it alone (it may not be a run dir): remove its files yourself, or give "
            f"another directory: {option('run_dir', 'runs/new')}")
    lock = RunLock(run_dir)
    lock.acquire()  # refuses while another run holds the folder
    try:
        for path in run_dir.iterdir():
            if path.name in (LOCK, ".ranks"):  # ours; fsdp ranks' files (they start now)
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    finally:
        lock.release()


def _wrote_plan(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "version" in data and "nodes" in data


def _writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FlowgraphError(
            f"cannot write the run dir `{run_dir}` (trainer.run_dir): "
            f"{exc.strerror or exc}{f' (`{exc.filename}`)' if exc.filename else ''}; give a "
            f"folder you can write to, e.g. {option('run_dir', 'runs/my-run')}") from exc


def run_plan(plan: ExecutionPlan, opts: RunOptions) -> None:
    """Set up and run a local plan (`flowgraph.compilers.run`); refuses to overwrite an
    existing run without `opts.resume`, and a run dir another run holds (`run_guard`:
    its lock; SIGTERM / SIGINT stop the run with a checkpoint). Prometheus metrics on
    `opts.metrics_port` (else `trainer.metrics_port`; 0 picks a free port) from before the
    models load until the run ends, and `opts.metrics_hold` seconds longer so a scraper
    sees the final values."""
    run_dir = prepare_run(plan, resume=opts.resume, overwrite=opts.overwrite)
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
