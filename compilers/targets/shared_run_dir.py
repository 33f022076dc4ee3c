"""Proof that every process of a run on several machines sees one run dir: each writes a
marker holding the run's token and reads the others' (fsdp's machines,
`flowgraph.compilers.targets.fsdp.multinode`; Ray's workers, `flowgraph.compilers.targets.ray`).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from flowgraph.errors import FlowgraphError
from flowgraph.spelling import option


def draw_token() -> str:
    """A token no earlier run's marker holds."""
    return uuid.uuid4().hex


def mark(run_dir: Path, name: str, token: str) -> None:
    """Write marker `name` (`run_dir/.ranks/<name>`) holding `token`."""
    ranks = run_dir / ".ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / name).write_text(token)


def marked(run_dir: Path, name: str, token: str) -> bool:
    """Whether marker `name`, as this machine sees it, holds `token`."""
    return _marker(run_dir / ".ranks" / name) == token


def not_one_run_dir(who: str, blind: str, run: str, writers: str, where: str = ""
                    ) -> FlowgraphError:
    """The error of a run whose processes do not see each other's markers: `who`
    (`the 2 nodes`) do not share one run dir, `blind` says which misses what; `run`
    (`a multi-node fsdp run`) writes each checkpoint from `writers` (`every rank`);
    `where` the run dir is to be given (` on every node`)."""
    return FlowgraphError(
        f"{who} do not share one run dir: {blind}. {run[:1].upper()}{run[1:]} writes each "
        f"checkpoint from {writers} into one folder: put trainer.run_dir on a filesystem "
        "every node mounts at the same path (NFS, Lustre, ...), e.g. "
        f"{option('run_dir', '/shared/runs/NAME')}{where}")


def _marker(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
