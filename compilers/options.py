"""How a plan is run (`RunOptions`), and what a finished run gives back (`Run`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

RDZV_TIMEOUT_S = 600.0
"""The default of `RunOptions.rdzv_timeout` (torch's own join timeout)."""


@dataclass(frozen=True)
class RunOptions:
    """How to run a plan; what the plan itself fixes (target, pools, run dir) is not here."""

    strict: bool = False
    """Check every tensor on every edge at every step (else the first step only)."""
    resume: bool = False
    """Continue the run in the plan's `trainer.run_dir` from its last checkpoint."""
    overwrite: bool = False
    """Start afresh in a run dir that holds an earlier run: its files are removed first
    (only those of a flowgraph run dir; `flowgraph.compilers.run_dir.clear_run_dir`)."""
    allow_changed: tuple[str, ...] = ()
    """With `resume`: settings that may differ from those the checkpoint was written
    with (`--allow-changed KEY`), although they shaped its state."""
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
    rdzv_timeout: float = RDZV_TIMEOUT_S
    """fsdp: seconds the machines have to meet at `rdzv_endpoint` (a line every 10 s
    while they wait), then the run stops naming those missing."""
    disabled: tuple[str, ...] = ()
    """Passes the run's graph was compiled without (`--disable-pass`): the command that
    resumes the run repeats them, so that it compiles the same plan."""
    overrides: tuple[str, ...] = field(default=())
    """The command line's overrides, repeated in the resume command an fsdp failure prints."""
    plan_file: Path | None = None
    """The plan file the run was started from (`flowgraph run plan.json`): the resume
    command names it instead of the graph and its overrides."""
    called_with: str | None = None
    """From Python: what `flowgraph.run` was given, as the call that resumes the run names
    it (`plan`, `graph` (`flowgraph.spelling.Word`), or a file's path); None: the command's."""


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
