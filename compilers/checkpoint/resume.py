"""What a resumed run must share with the checkpoint it continues: the settings that
shaped the checkpoint's state.

A checkpoint's `state.json` records them (`recorded_settings`: flat keys, as the
command line overrides them — `dims.Bp`, `models.actor.optimizer.lr`,
`nodes.adv.params.gamma`, `data.train.path`, `trainer.seed`); `--resume` with another
value stops (`check_settings`) naming each key, the checkpoint's value and the new one,
unless the key is allowed to change (`--allow-changed KEY`). What does not shape the
state may change freely: `trainer.steps`, `run_dir`, loggers, checkpoint and
evaluation cadence, strict mode, ports, and the node params that only say how a node
computes (`micro_batch_size`, `chunk_size`, `packing`, a rollout's `backend`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from flowgraph.errors import FlowgraphError
from flowgraph.ir import Params
from flowgraph.plan import ExecutionPlan
from flowgraph.spelling import Word, option

TRAINER = ("seed", "max_staleness", "admission")
"""The trainer settings that shape a checkpoint: the seed (data order, sampling), and
the asynchronous rollouts its buffer was generated for."""
BUFFER_KEYS = frozenset({"trainer.max_staleness", "trainer.admission"})
"""Settings a non-empty rollout buffer was generated under: its rollouts are due at
their own steps, so these cannot change (not even allowed) while it holds any."""
_MODEL_SKIP = frozenset({"name", "gradient_checkpointing", "attn_implementation",
                         "config"})
"""A model's fields that change how it computes, not what its checkpoint holds."""
_LAYOUT_PARAMS = frozenset({"micro_batch_size", "max_token_len", "packing", "chunk_size",
                            "backend", "gpu_memory_utilization", "timeout_s"})
"""Node params that say how a node computes (its memory, its engine, its time limit), not
what: a run resumed with a smaller micro-batch after running out of memory trains the
same way."""
_ABSENT = "(absent)"


def recorded_settings(plan: ExecutionPlan) -> dict[str, Any]:
    """The settings that shape a checkpoint of `plan`, by override key (JSON values)."""
    out: dict[str, Any] = {f"dims.{d.name}": d.value for d in plan.dims}
    for model in plan.models:
        _flat(out, f"models.{model.name}", model, _MODEL_SKIP)
    for data in plan.data:
        out[f"data.{data.name}.kind"] = data.kind
        out[f"data.{data.name}.path"] = data.path
        _flat(out, f"data.{data.name}.params", data.params.to_python())
    for name in TRAINER:
        out[f"trainer.{name}"] = getattr(plan.trainer, name)
    for node in plan.nodes:
        if node.category != "data":
            out[f"nodes.{node.name}.kind"] = node.kind
            _flat(out, f"nodes.{node.name}.params", {
                k: v for k, v in node.param_values().items() if k not in _LAYOUT_PARAMS})
    result: dict[str, Any] = json.loads(json.dumps(out))  # tuples as lists, as JSON holds them
    return result


def _flat(out: dict[str, Any], key: str, value: Any, skip: frozenset[str] = frozenset()
          ) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name not in skip and f.name != "pos":  # where it was written: no state
                _flat(out, f"{key}.{f.name}", getattr(value, f.name))
    elif isinstance(value, Params):
        _flat(out, key, value.to_python())
    elif isinstance(value, dict) and value:
        for k, v in value.items():
            _flat(out, f"{key}.{k}", v)
    else:
        out[key] = value


def check_settings(folder: Any, state: dict[str, Any], now: dict[str, Any],
                   allowed: Iterable[str]) -> list[str]:
    """Refuse to resume the checkpoint in `folder` (its `state`) with settings that
    changed since it was written, except those `allowed`; the allowed changes, one line
    each, to be said."""
    then: dict[str, Any] = state.get("settings", {})
    allow = set(allowed)
    pairs = [(key, then.get(key, _ABSENT), now.get(key, _ABSENT))
             for key in sorted(set(then) | set(now))]
    diffs = [(key, old, new) for key, old, new in pairs if old != new]
    buffered = int(state.get("buffered", 0))
    locked = [d for d in diffs if d[0] in BUFFER_KEYS and buffered]
    refused = [d for d in diffs if d[0] not in allow and d not in locked]
    if locked:
        raise FlowgraphError(
            f"cannot resume from `{folder}`: its rollout buffer holds {buffered} rollout(s) "
            "generated for "
            + ", ".join(f"{k}={_show(old)}" for k, old, _ in locked)
            + ", due at their own steps; this run has "
            + ", ".join(f"{k}={_show(new)}" for k, _, new in locked)
            + f". Resume with {' '.join(f'{k}={_show(old)}' for k, old, _ in locked)}")
    if refused:
        flags = f"{option('resume')} {option('allow_changed', [k for k, _, _ in refused])}"
        raise FlowgraphError(
            f"cannot resume from `{folder}`: settings that shape its state changed since it "
            "was written:\n"
            + "\n".join(f"  {k}: {_show(old)} in the checkpoint, {_show(new)} now"
                        for k, old, new in refused)
            + "\nResume with the checkpoint's values, or accept each change deliberately: "
            f"{flags}")
    allowed = option("allow_changed", Word("KEY"))
    return [f"{k}: {_show(old)} in the checkpoint, {_show(new)} now ({allowed})"
            for k, old, new in diffs]


def _show(value: Any) -> str:
    return value if value == _ABSENT else json.dumps(value)


def fresher_rollouts(step: int, steps: int, staleness: int, buffered: int) -> str | None:
    """A note, where an asynchronous checkpoint (`block`) after `step` holds fewer of the
    rollouts ahead of it (`buffered`) than a run of `steps` steps holds there — the last
    checkpoint of a shorter run, extended, holds none: what the resumed run then trains
    otherwise than a run of `steps` steps from the start (None: nothing)."""
    ahead = min(staleness, steps - 1 - step)
    if buffered >= ahead:
        return None
    first, last = step + 1 + buffered, step + ahead
    which = f"step {first}'s rollout is" if first == last else \
        f"the rollouts of steps {first}…{last} are"
    return (f"note: the checkpoint after step {step} holds {buffered} of the {ahead} "
            f"rollout(s) generated ahead that a run of trainer.steps = {steps} holds there (a "
            "run generates none past its last step: this one ended a shorter run, or a "
            f"synchronous one), so {which} generated now by the policy "
            f"of step {step + 1}, where that run generates step j's by the policy of step "
            f"j − {staleness} (trainer.max_staleness): from step {first} on, the numbers are "
            f"not those of a run of {steps} steps from the start")
