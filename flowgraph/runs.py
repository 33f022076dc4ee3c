"""A flowgraph run dir where a model is expected (`models.actor.path: runs/sft`): the
model of it that is meant, and how to export it instead.

A run dir holds the `plan.json` of its run and no `config.json` (a model folder's).
The model meant is the run's one trained causal LM (SFT's `policy`, PPO's `actor`);
the executors load it from the newest intact checkpoint
(`flowgraph.compilers.export.from_run_dirs`), `flowgraph check --data` checks its base.
"""

from __future__ import annotations

import re
from pathlib import Path

from flowgraph.errors import FlowgraphError, PlanError
from flowgraph.ir import ModelSpec
from flowgraph.plan import plan_from_json
from flowgraph.spelling import command

_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def published_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every published checkpoint of a run, newest first (not verified:
    `flowgraph.compilers.checkpoint.store.intact_checkpoint` reads their files)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name))),
                  reverse=True)


def is_run_dir(path: str) -> bool:
    folder = Path(path).expanduser()
    return (folder / "plan.json").is_file() and not (folder / "config.json").exists()


def trained_lm(path: str) -> ModelSpec:
    """The spec of the run's one trained causal LM, as the run had it; a
    `FlowgraphError` saying how to export one when it has none or several."""
    try:
        plan = plan_from_json((Path(path).expanduser() / "plan.json").read_text())
    except (OSError, PlanError) as exc:
        raise FlowgraphError(f"`{path}` holds a plan.json that cannot be read ({exc}); give "
                             "a model folder (one `flowgraph export` wrote)") from exc
    heads = {m.name: m.head for p in plan.pools for m in p.models}
    lms = [m.name for m in plan.models if m.trainable and heads.get(m.name) == "lm"]
    if len(lms) != 1:
        which = f"{len(lms)} trained causal LMs ({', '.join(lms)})" if lms else \
            "no trained causal LM"
        raise FlowgraphError(f"`{path}` is a flowgraph run dir with {which}: export the "
                             "model you mean and give its folder: "
                             f"{export_command(path, lms[0] if lms else 'MODEL')}")
    return plan.model(lms[0])


def export_command(run_dir: str, model: str) -> str:
    """The command (or call) that exports `model` of the run in `run_dir`."""
    return command("export", run_dir, [("model", model), ("out", f"{model}-hf")])
