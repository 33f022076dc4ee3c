"""The run dir, prepared once per run before anything is written into it or any model
loads (`flowgraph.compilers.run`, whatever the target): created and known writable, and
refused when it holds a run unless resuming or overwriting it (`clear_run_dir`: a
flowgraph run dir's files only). On several processes that share it (the nodes of a
multi-node fsdp launch, the ranks torchrun started) the first prepares it and the
others only check what they need of it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from flowgraph.compilers.checkpoint.store import (
    latest_checkpoint,
)
from flowgraph.compilers.signals import LOCK, RunLock
from flowgraph.compilers.worker import TRACEBACK, quiet_hf
from flowgraph.errors import FlowgraphError
from flowgraph.plan import ExecutionPlan
from flowgraph.runtime.trackers import check_trackers
from flowgraph.spelling import option


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
