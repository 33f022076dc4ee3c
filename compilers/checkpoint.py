"""Atomic checkpoints: `run_dir/checkpoints/step_N/`, written whole or not at all.

A checkpoint is built in `step_N.tmp-<pid>` and renamed into place; a rename is
atomic, so a SIGKILL mid-write leaves the previous checkpoints untouched and at most
a `*.tmp-*` folder, which the next run removes. It holds every model's weights, each
optimizer and scheduler, the data cursors, per-node state (KL controllers) and the
RNG states — everything a resumed run needs to produce the same numbers. A trained
model's frozen parameters (a LoRA model's base) are not in it: they load from the
model's source, and only the adapters are saved (`TrainedPart`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from flowgraph.compilers.rollouts import Rollout, save_buffer
from flowgraph.errors import FlowgraphError

_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint, or None."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name))]
    return max(found) if found else None


def remove_partial(run_dir: Path) -> None:
    """Remove folders a killed writer left behind."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The names of a trained model's frozen parameters (a LoRA model's base weights):
    a checkpoint leaves them out, the model's source holds them."""
    return {n for n, p in model.named_parameters() if not p.requires_grad}


class TrainedPart:
    """A trained model as a checkpoint module: its state without the frozen parameters
    (a LoRA model: the adapters alone)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        frozen = frozen_names(self.model)
        return {k: v for k, v in self.model.state_dict().items() if k not in frozen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        lost = sorted(set(missing) - frozen_names(self.model))
        if lost or unexpected:
            raise FlowgraphError(
                "the checkpoint does not match the model: "
                + "; ".join(f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                            for what, names in (("missing", lost), ("unexpected", unexpected))
                            if names)
                + " (was it written with other lora settings?)")


def save_checkpoint(run_dir: Path, step: int, *, modules: dict[str, Any],
                    state: dict[str, Any], keep: int = 2, rollouts: list[Rollout] | None = None
                    ) -> Path:
    """Write `step_<step>` atomically; keep the newest `keep` checkpoints.

    `modules` maps a file stem to an object with `state_dict()` (models, optimizers,
    schedulers); `state` is JSON-able run state (step, cursors, node state).
    """
    tmp = begin_checkpoint(run_dir, step, f"tmp-{os.getpid()}")
    for stem, obj in modules.items():
        torch.save(obj.state_dict(), tmp / f"{stem}.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    return publish_checkpoint(tmp, state, keep, rollouts)


def begin_checkpoint(run_dir: Path, step: int, suffix: str) -> Path:
    """A fresh `step_<step>.<suffix>` folder to write a checkpoint into."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step_{step}.{suffix}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish_checkpoint(tmp: Path, state: dict[str, Any], keep: int = 2,
                       rollouts: list[Rollout] | None = None) -> Path:
    """Write the rollout buffer of an asynchronous run (`rollouts`, when not None) and
    `state.json` last, then rename `tmp` into place and prune old ones."""
    if rollouts is not None:
        save_buffer(tmp, rollouts)
    root, final = tmp.parent, tmp.parent / tmp.name.split(".")[0]
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, keep)
    return final


def load_checkpoint(folder: Path, *, modules: dict[str, Any]) -> dict[str, Any]:
    """Load every module's state; restore the RNGs; return the JSON state."""
    for stem, obj in modules.items():
        obj.load_state_dict(torch.load(folder / f"{stem}.pt", weights_only=False))
    set_rng_state(torch.load(folder / "rng.pt", weights_only=False))
    state: dict[str, Any] = json.loads((folder / "state.json").read_text())
    return state


def _fsync_dir(path: Path) -> None:
    for p in [*path.rglob("*"), path] if path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _prune(root: Path, keep: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)))
    for _, p in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
