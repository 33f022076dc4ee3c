"""Atomic checkpoints: `run_dir/checkpoints/step_N/`, written whole or not at all.

A checkpoint is built in `step_N.tmp-<pid>` and renamed into place; a rename is
atomic, so a SIGKILL mid-write leaves the previous checkpoints untouched and at most
a `*.tmp-*` folder, which the next run removes. It holds every model's weights, each
optimizer and scheduler, the data cursors, per-node state (KL controllers) and the
RNG states — everything a resumed run needs to produce the same numbers. A trained
model's frozen parameters (a LoRA model's base) are not in it: they load from the
model's source, and only the adapters are saved (`TrainedPart`).

What a checkpoint holds is checked before it is loaded (`flowgraph.compilers.checkpoint.integrity`):
weights are safetensors, the rest `torch.save` files read with `weights_only=True`
(nothing is unpickled as code) and JSON, and `manifest.json` — size and sha256 of every
file, DCP shards included — is written last, before the rename. `intact_checkpoint`
names a damaged newest checkpoint and falls back to the newest intact one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flowgraph.compilers.checkpoint.integrity import (
    checkpoint_damage,
    load_plain,
    load_tensors,
    save_tensors,
    torch_bytes,
    write_bytes,
    write_failure,
    write_manifest,
)
from flowgraph.errors import FlowgraphError, NonFiniteError
from flowgraph.runs import checkpoint_root, published_checkpoints
from flowgraph.spelling import Word, option

DCP_DIR = "dcp"
"""Sub-folder of a checkpoint that holds the DCP shards of models and optimizers."""
BUFFER = "rollouts.pt"
"""The rollout buffer of an asynchronous run in a checkpoint folder."""


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest published checkpoint (not verified), or None."""
    found = published_checkpoints(run_dir)
    return found[0] if found else None


def intact_checkpoint(run_dir: Path, say: Callable[[str], None]) -> tuple[int, Path] | None:
    """(step, folder) of the newest checkpoint whose files are as written; each damaged
    newer one is named through `say`. None when the run dir holds no checkpoint; one
    error when it holds only damaged ones."""
    damaged: list[str] = []
    for step, folder in published_checkpoints(run_dir):
        problem = checkpoint_damage(folder, step)
        if problem is None:
            if damaged:
                say(f"falling back to the newest intact checkpoint, `{folder}` (step {step})")
            return step, folder
        damaged.append(f"`{folder}`: {problem}")
        say(f"checkpoint `{folder}` is damaged: {problem}")
    if damaged:
        raise FlowgraphError(
            f"no intact checkpoint in `{checkpoint_root(run_dir)}` to resume from: "
            + "; ".join(damaged) + ". Start the run again in a new folder "
            f"({option('run_dir', Word('...'))}), or restore the files from a copy")
    return None


def remove_partial(run_dir: Path) -> None:
    """Remove folders a killed writer left behind."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True)


def save_rng(path: Path) -> None:
    write_bytes(path, torch_bytes(rng_state()))


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
            raise FlowgraphError(mismatch(lost, unexpected))


def mismatch(missing: list[str], unexpected: list[str]) -> str:
    return ("the checkpoint does not match the model: "
            + "; ".join(f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                        for what, names in (("missing", missing), ("unexpected", unexpected))
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
    try:
        for stem, obj in modules.items():
            if isinstance(obj, (TrainedPart, nn.Module)):  # weights: safetensors
                save_tensors(tmp / f"{stem}.safetensors", obj.state_dict())
            else:
                write_bytes(tmp / f"{stem}.pt", torch_bytes(obj.state_dict()))
        save_rng(tmp / "rng.pt")
        return publish_checkpoint(tmp, state, keep, rollouts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # what a full disk let through: its space
        raise


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
    """Write the rollout buffer of an asynchronous run (`rollouts`, when not None),
    `state.json` and the manifest last, then rename `tmp` into place and prune old
    ones."""
    if rollouts is not None:
        save_buffer(tmp, rollouts)
    root, final = tmp.parent, tmp.parent / tmp.name.split(".")[0]
    write_bytes(tmp / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
    write_manifest(tmp)
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root.parent, keep)
    return final


def load_checkpoint(folder: Path, *, modules: dict[str, Any]) -> dict[str, Any]:
    """Load every module's state; restore the RNGs; return the JSON state."""
    for stem, obj in modules.items():
        weights = folder / f"{stem}.safetensors"
        obj.load_state_dict(load_tensors(weights) if weights.exists()
                            else load_plain(folder / f"{stem}.pt"))
    set_rng_state(load_plain(folder / "rng.pt"))
    state: dict[str, Any] = json.loads((folder / "state.json").read_text())
    return state


def _fsync_dir(path: Path) -> None:
    for p in [*path.rglob("*"), path] if path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _prune(run_dir: Path, keep: int) -> None:
    steps = published_checkpoints(run_dir)[::-1]  # oldest first
    for _, p in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


# --- a process's trained models, optimizers and schedulers ------------------------------


def trained_modules(models: dict[str, nn.Module], optimizers: dict[str, Any],
                    schedulers: dict[str, Any]) -> dict[str, Any]:
    """File stem -> what a whole checkpoint saves: each trained model (`TrainedPart`), its
    optimizer and LR schedule."""
    mods: dict[str, Any] = {f"model.{name}": TrainedPart(m) for name, m in models.items()}
    for name, opt in optimizers.items():
        mods[f"optim.{name}"] = opt
        mods[f"sched.{name}"] = schedulers[name]
    return mods


def save_shards(folder: Path, models: dict[str, nn.Module], optimizers: dict[str, Any],
                schedulers: dict[str, Any], rank: int) -> None:
    """One worker's part of a distributed checkpoint in `folder`: its DCP shards of the
    trained models and optimizers; the schedulers (the same on every worker) from
    worker 0."""
    dcp_save(folder, models, optimizers)
    if rank == 0:
        for name, sched in schedulers.items():
            write_bytes(folder / f"sched.{name}.pt", torch_bytes(sched.state_dict()))


def load_weights(folder: Path, models: dict[str, nn.Module], optimizers: dict[str, Any],
                 schedulers: dict[str, Any]) -> None:
    """Models, optimizers and schedulers from the checkpoint in `folder`, whichever
    target wrote it: whole files (local target; RNG states too) or DCP shards (fsdp,
    ray), into whole models or sharded ones (fsdp, ray)."""
    dcp = has_dcp(folder)
    if not dcp and not any(map(is_sharded, models.values())):
        load_checkpoint(folder, modules=trained_modules(models, optimizers, schedulers))
    else:
        (dcp_load if dcp else load_whole)(folder, models, optimizers)
        for name, sched in schedulers.items():
            sched.load_state_dict(load_plain(folder / f"sched.{name}.pt"))
    for name, sched in schedulers.items():
        _on_schedule(optimizers[name], sched)


def _on_schedule(opt: Any, sched: Any) -> None:
    """The LR a resumed run's first step takes, from this run's schedule (the saved
    optimizer holds the old one's: another `trainer.steps` decays toward the new end).
    `LambdaLR.step`'s product: an unchanged schedule gives the saved LR to the bit."""
    for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas,
                                   strict=True):
        group["lr"] = base * factor(sched.last_epoch)


# --- sharded checkpoints: DCP ------------------------------------------------------------


def _options(model: nn.Module, *, full_state_dict: bool = False) -> Any:
    """State-dict options: a model's frozen parameters (a LoRA model's base) are left
    out of its checkpoint, as `checkpoint.TrainedPart` leaves them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    partial = bool(frozen_names(model))
    return StateDictOptions(full_state_dict=full_state_dict, ignore_frozen_params=partial,
                            strict=not partial)


def _model_state(model: nn.Module, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, [opt] if opt is not None else [],
                              options=_options(model))
    return {"model": msd, "optim": osd} if opt is not None else {"model": msd}


def dcp_save(folder: Path, models: dict[str, nn.Module], optimizers: dict[str, Any],
             group: Any = None) -> None:
    """Each model (and its optimizer) into `folder/dcp/<model>`, by every worker holding
    it (`group`: those workers; None: the default group, or this process alone)."""
    import torch.distributed.checkpoint as dcp

    for name, model in models.items():
        where = folder / DCP_DIR / name
        with warnings.catch_warnings():  # a worker of a one-worker pool: on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            try:
                dcp.save(_model_state(model, optimizers.get(name)), checkpoint_id=str(where),
                         process_group=group, no_dist=not dist.is_initialized())
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                full = write_failure(exc, where)
                if full is None:
                    raise
                raise full from exc


def dcp_load(folder: Path, models: dict[str, nn.Module], optimizers: dict[str, Any],
             group: Any = None) -> None:
    """The inverse of `dcp_save`, into models sharded over any number of workers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    for name, model in models.items():
        where = folder / DCP_DIR / name
        if not (where / ".metadata").exists():
            raise FlowgraphError(f"checkpoint `{folder}` holds no weights for `{name}`")
        opt = optimizers.get(name)
        state = _model_state(model, opt)
        with warnings.catch_warnings():  # one process (the local target): on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(where), process_group=group,
                     no_dist=not dist.is_initialized())
        set_state_dict(model, [opt] if opt is not None else [],
                       model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=_options(model))


def dcp_full_model(folder: Path, name: str, model: nn.Module) -> None:
    """Load model `name` of a DCP checkpoint whole into a plain model, in one process."""
    part = TrainedPart(model)
    part.load_state_dict(dcp_whole(folder, name, part.state_dict()))


def dcp_whole(folder: Path, name: str, template: dict[str, Any]) -> dict[str, Any]:
    """Model `name` of a DCP checkpoint read whole in one process, into the tensors of
    `template` (a state dict with the keys to read)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": template}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder / DCP_DIR / name), no_dist=True)
    weights: dict[str, Any] = state["model"]
    return weights


def has_dcp(folder: Path) -> bool:
    return (folder / DCP_DIR).is_dir()


def load_whole(folder: Path, models: dict[str, nn.Module], optimizers: dict[str, Any]
               ) -> None:
    """A checkpoint of the local target (`model.<name>.safetensors`, `optim.<name>.pt`:
    whole tensors) into models sharded over any number of workers: each keeps its
    shards."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    for name, model in models.items():
        weights: dict[str, Any] = load_tensors(folder / f"model.{name}.safetensors")
        opt = optimizers.get(name)
        optim = ({} if opt is None else _named_optim_state(
            model, opt, load_plain(folder / f"optim.{name}.pt", map_location="cpu")))
        set_state_dict(model, [opt] if opt is not None else [], model_state_dict=weights,
                       optim_state_dict=optim, options=_options(model, full_state_dict=True))


def _named_optim_state(model: nn.Module, opt: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """`Optimizer.state_dict()` (parameters numbered in `opt`'s order) keyed by parameter
    name instead, as `set_state_dict` takes it (a shared parameter by its first name)."""
    fqn = {id(p): name for name, p in model.named_parameters()}
    names: dict[int, str] = {}
    groups: list[dict[str, Any]] = []
    for group, kept in zip(opt.param_groups, saved["param_groups"], strict=True):
        ours = [fqn[id(p)] for p in group["params"]]
        names.update(zip(kept["params"], ours, strict=True))
        groups.append({**kept, "params": ours})
    return {"state": {names[i]: v for i, v in saved["state"].items()}, "param_groups": groups}


def is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())


# --- the rollout buffer of an asynchronous run ---------------------------------------


@dataclass
class Rollout:
    """The producer's outputs for the batch of one step, and where they came from."""

    index: int
    """The step whose batch this is (block); the production count (drop)."""
    version: int
    """Updates applied to the weights that generated it: the policy version (with partial
    rollouts, that it began with: its tokens record their own, `AsyncPlan.versions`)."""
    env: dict[tuple[str, str], Any] = field(default_factory=dict)
    """Every producer output, `(node, port)` -> tensor or list."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the producer's nodes reported (the filter's counts, the rollout's tokens)."""
    cursors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each data source's cursor after this batch was drawn."""
    node_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The producer nodes' state after it (an adaptive KL coefficient): checkpointed
    with the buffer, as the cursors are."""
    error: BaseException | None = None
    """A NaN in the producer: raised at the step whose batch this is."""


def save_buffer(folder: Path, items: list[Rollout]) -> None:
    """The buffer of a checkpoint, written into its folder: plain data only (a NaN kept
    for its step as the `NonFiniteError`'s fields)."""
    write_bytes(folder / BUFFER, torch_bytes([{**vars(item), "error": _error_fields(item.error)}
                                              for item in items]))


def load_buffer(folder: Path) -> list[Rollout]:
    """The buffer of a checkpoint an asynchronous run wrote; missing or unreadable is
    an error (an empty buffer would train later steps' batches in earlier steps)."""
    path = folder / BUFFER
    if not path.exists():
        raise FlowgraphError(f"checkpoint `{folder}` of an asynchronous run has no rollout "
                             f"buffer `{BUFFER}`: its buffered rollouts are lost")
    items = []
    for item in load_plain(path):
        error = item.pop("error")
        items.append(Rollout(**item, error=None if error is None else NonFiniteError(**error)))
    return items


def _error_fields(error: BaseException | None) -> dict[str, Any] | None:
    if error is None:
        return None
    if not isinstance(error, NonFiniteError):  # what `ProducerNodes.produce` keeps
        raise TypeError(f"a rollout keeps a NonFiniteError, not {type(error).__name__}")
    return {"node": error.node, "step": error.step, "what": error.what}
