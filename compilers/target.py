"""What a target is: the strategy the training loop runs a plan through.

A target (`targets/`: local, fsdp, ray) decides where models live and how a node's
batch reaches them; the interpreter and the training loop are the same on all three.
Its verbs, and nothing else:

    worker            this process's `Worker` (its models, the nodes' implementations
                      and state; the Ray driver's hosts no model)
    start()           place the models: here whole (local), sharded over the ranks
                      (fsdp), or on Ray worker groups started per pool (ray)
    dispatch(...)     run one node on its inputs: in this process, on this rank's slice
                      with the outputs gathered, or on a pool's workers
    evaluate(...)     an update's metrics on held-out inputs, no step (its loss's
                      `held_out`): where the update's model is, on the whole batch
    save(step, ...)   write a checkpoint: whole files, or every worker's DCP shards,
                      published atomically with the loop's state and rollout buffer
    load(folder)      this target's models, optimizers, schedulers (and RNG) from a
                      checkpoint any target wrote
    writes, label     whether this process writes the run's artefacts (rank 0, the
                      driver), and the Prometheus `worker` label of its rows
    barrier()         wait for every process of the run (fsdp; a no-op elsewhere)
    report(step, m)   the workers' node seconds and memory for Prometheus, besides
                      this process's row (which it may add to, as ray's recovery time)
    recover(exc, s)   after a lost worker: the checkpoint folder to go on from (None:
                      start over), or raise
    completed(saved)  a step finished (and saved a checkpoint)
    stop_requested()  the signal of a stop every process of the run agrees on (SIGTERM,
                      SIGINT; fsdp: any rank's, or the launcher's), else None
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.worker import Worker
from flowgraph.errors import WorkerLost

Report = tuple[str, dict[str, float], list[tuple[str, int]]]
"""(worker label, its node seconds this step, its device memory in use)."""


class Target(Protocol):
    worker: Worker
    writes: bool
    label: str

    def start(self) -> None: ...

    def dispatch(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float]) -> tuple[dict[str, Any], float]: ...

    def evaluate(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float]) -> None: ...

    def save(self, step: int, state: dict[str, Any], rollouts: list[Rollout] | None
             ) -> None: ...

    def load(self, folder: Path) -> None: ...

    def barrier(self) -> None: ...

    def report(self, step: int, metrics: dict[str, float]) -> list[Report]: ...

    def recover(self, exc: WorkerLost, step: int) -> Path | None: ...

    def completed(self, saved: bool) -> None: ...

    def stop_requested(self) -> int | None: ...
