"""Evaluation on held-out data: every node but the updates on the held-out rows, the
updates' own held-out metrics (no step), the step metrics and the responses' text
metrics, as `val/...` (`flowgraph.runtime.evaluation`, `HeldOut`).

Every held-out row counts once: batches of Bp in file order, the last one the last Bp
rows, of which only the rows not seen yet count (its step metrics weigh by them).
Each prompt is answered once, greedily, unless the rollout asks for `val_n` samples
at `val_temperature`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from flowgraph.compilers.batches import Batches
from flowgraph.compilers.interpreter import Interpreter
from flowgraph.compilers.metrics import HeldOut, log_ratio_to_reference, step_metrics


class UpdateEval(Protocol):
    """The target's `evaluate`: an update's metrics on held-out inputs, into `metrics`."""

    def __call__(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float]) -> None: ...


def evaluate(batches: Batches, names: list[str], step: int, tokenizers: dict[str, Any],
             strict: bool, updates: UpdateEval) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The `val/...` metrics of the model after `step` (none without held-out data), by
    `names` (the prologue's and the step's nodes) on every held-out batch; and the
    responses, for the `validation` table. `strict`: every held-out prologue batch held
    to its contracts (else the first). `updates`: the target's `evaluate`, which the
    updates run instead of a step."""
    out: dict[str, float] = {}
    ip = batches.interpreter
    if not all(batches.data[d.name].eval is not None for d in ip.plan.data):
        return out, []
    evals = [batches.data[d.name].eval for d in ip.plan.data]
    for ev in evals:
        ev.load_state_dict({"epoch": 0, "position": 0})
    rows, size = min(len(ev) for ev in evals), batches.rows
    batches.run_prologue("eval", strict)  # once a run: usually done before the loop
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    held_out = HeldOut()
    with torch.no_grad():
        for fresh in new_rows_per_batch(rows, size):
            if fresh < size:  # the last batch: the last Bp rows
                for ev in evals:
                    ev.load_state_dict({"epoch": 0, "position": rows - size})
            env: dict[tuple[str, str], Any] = {}
            batches.draw(env, {}, split="eval")
            scratch = _eval_nodes(ip, updates, names, env, step)
            scratch.update(step_metrics(ip.plan, env))
            scratch.update(log_ratio_to_reference(ip.plan, env))
            held_out.add(ip.plan, env, tokenizers, skip=size - fresh)
            for k, v in scratch.items():
                sums[k] = sums.get(k, 0.0) + v * fresh
                weights[k] = weights.get(k, 0.0) + fresh
    for k, v in sums.items():  # over the batches that report it (an env's: those it
        if not k.startswith("perf/"):  # played in), each by its new rows
            out["val/" + k.removeprefix("critic/")] = v / weights[k]
    out.update({f"val/{k}": v for k, v in held_out.metrics().items()})
    return out, held_out.rows()


def _eval_nodes(ip: Interpreter, updates: UpdateEval, names: list[str],
                env: dict[tuple[str, str], Any], step: int) -> dict[str, float]:
    """Every node on one held-out batch, the updates' evaluation taking their place."""
    scratch: dict[str, float] = {}
    for name in names:
        if not ip.placed[name].trains:
            ip.run_node(name, env, step, strict=False, metrics=scratch, split="eval")
        else:
            updates(name, ip.inputs(name, env), step, ip.params(name), scratch)
    return scratch


def new_rows_per_batch(rows: int, size: int) -> list[int]:
    """Rows not seen before in each held-out batch of `size`: ⌈rows/size⌉ batches, the
    last one overlapping the one before (one batch when rows < size: it cannot be
    drawn, and the dataset says so)."""
    if rows <= size:
        return [size]
    return [min(size, rows - start) for start in range(0, rows, size)]
