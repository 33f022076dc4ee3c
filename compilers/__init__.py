"""flowgraph.compilers: the executors that run an execution plan (local, fsdp, ray).

`run(plan, options)` is the one entry point for every target: it runs the plan as it
is (its target, pools, stages and dispatch; nothing is compiled again) and returns the
run, its folder and metric rows. `flowgraph run`, `flowgraph.run` and the tests call it.
A trained built-in model the plan names (`builtin:tiny-lm-sft`) is trained first, once
per machine (`builtins.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from flowgraph.plan import ExecutionPlan

__all__ = ["Run", "RunOptions", "read_metrics", "run"]


@dataclass(frozen=True)
class RunOptions:
    """How to run a plan; what the plan itself fixes (target, pools, run dir) is not here."""

    strict: bool = False
    """Check every tensor on every edge at every step (else the first step only)."""
    resume: bool = False
    """Continue the run in the plan's `trainer.run_dir` from its last checkpoint."""
    out: TextIO | None = None
    """Where the per-step lines go (stdout when None)."""
    tensorboard: bool = True
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: a free one; None: `trainer.metrics_port`)."""
    metrics_host: str = "127.0.0.1"
    metrics_hold: float = 0.0
    """Seconds to keep serving after the run, for a last scrape."""
    address: str | None = None
    """ray: the cluster to join; None starts one on this machine."""
    shutdown: bool = True
    """ray: stop the cluster this run started when it ends."""
    nnodes: int = 1
    """fsdp: machines; the plan's processes are split evenly over them."""
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    overrides: tuple[str, ...] = field(default=())
    """The command line's overrides, repeated in the resume command an fsdp failure prints."""
    plan_file: Path | None = None
    """The plan file the run was started from (`flowgraph run plan.json`): the resume
    command names it instead of the graph and its overrides."""


@dataclass(frozen=True)
class Run:
    """A finished run: its folder and every row of its `metrics.jsonl`."""

    run_dir: Path
    rows: list[dict[str, Any]]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(plan: ExecutionPlan, options: RunOptions | None = None) -> Run:
    """Run `plan` on its target; the run dir is the plan's `trainer.run_dir`."""
    opts = options or RunOptions()
    # the one place `--resume` and `trainer.resume` are merged
    opts = replace(opts, resume=opts.resume or plan.graph.trainer.resume)
    from flowgraph.compilers.builtins import ensure_builtins

    ensure_builtins(plan.graph, opts.out)  # before any worker looks for them
    if plan.target == "fsdp":
        from flowgraph.compilers.fsdp import run_fsdp

        run_fsdp(plan, opts)
    elif plan.target == "ray":
        from flowgraph.compilers.ray import run_ray

        run_ray(plan, opts)
    else:
        from flowgraph.compilers.local import run_plan

        run_plan(plan, opts)
    run_dir = Path(plan.graph.trainer.run_dir)
    return Run(run_dir, read_metrics(run_dir))
