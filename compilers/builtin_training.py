"""Trained built-in models: trained on first use by running their recipe graph.

`builtin:tiny-lm-sft` (see `flowgraph.builtin_models.TRAINED_BUILTINS`) is `tiny-lm`
after the project's own SFT graph. `run` calls `ensure_builtins(plan.models)` before any
target starts, so every process of a run finds the model in the cache. The recipe runs
on the local target in a private temporary folder; its `policy` is exported there and
published by an atomic rename (as `flowgraph.nodes.models` publishes the random
built-ins): two processes training at once both succeed and a reader never sees half
a model. The recipe's `metrics.jsonl` is kept next to the weights (`sft_metrics.jsonl`).
CPU float32 training is deterministic, so one machine always builds the same weights.
A recipe is compiled once per process, when a model first needs training, and its plan
kept (`recipe_plan`); each training gives it only its own run dir.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from flowgraph.builtin_models import BUILTIN_PREFIX, TRAINED_BUILTINS
from flowgraph.errors import CompileError
from flowgraph.frontend import graph_from_yaml
from flowgraph.ir import ModelSpec
from flowgraph.plan import ExecutionPlan

__all__ = ["ensure_builtin", "ensure_builtins", "recipe_plan"]


def ensure_builtins(models: tuple[ModelSpec, ...], out: TextIO | None = None) -> None:
    """Train every trained built-in `models` (or their tokenizers) name, once."""
    for m in models:
        for path in (m.path, m.tokenizer):
            name = (path or "").removeprefix(BUILTIN_PREFIX)
            if path and path.startswith(BUILTIN_PREFIX) and name in TRAINED_BUILTINS:
                ensure_builtin(name, out=out)


def ensure_builtin(name: str, out: TextIO | None = None) -> Path:
    """The cached folder of trained built-in `name`, trained by its recipe if absent."""
    from flowgraph.nodes.models import builtin_dir

    final = builtin_dir(name)
    if (final / "config.json").exists():
        return final
    out = out or sys.stdout
    final.parent.mkdir(parents=True, exist_ok=True)
    with _alone(final, name, out):
        if (final / "config.json").exists():  # trained by the process we waited for
            return final
        _train(name, final, out)
    return final


@contextmanager
def _alone(final: Path, name: str, out: TextIO) -> Iterator[None]:
    """The body alone among the processes of this machine building `final` (an
    exclusive `flock` on `.<entry>.lock` beside it, released when the body ends or the
    process dies); a process that has to wait says for what."""
    lock = final.parent / f".{final.name}.lock"
    with open(lock, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{BUILTIN_PREFIX}{name}: another process is training it (`{lock}` is "
                  "locked); waiting for it", file=out, flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _train(name: str, final: Path, out: TextIO) -> None:
    """Train built-in `name` by its recipe and publish it at `final`."""
    from flowgraph.compilers.export import export_model
    from flowgraph.compilers.options import RunOptions
    from flowgraph.compilers.targets.local import run_plan
    from flowgraph.compilers.worker import quiet_hf

    plan = recipe_plan(name)
    print(f"{BUILTIN_PREFIX}{name}: training it once from "
          f"{BUILTIN_PREFIX}{TRAINED_BUILTINS[name][0]} ({plan.trainer.steps} steps of its "
          f"SFT recipe); cached in {final}", file=out, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        run_dir = tmp / "run"
        trained = plan.with_trainer(replace(plan.trainer, run_dir=str(run_dir)))
        quiet_hf()  # this run's run dir is new: `run` would prepare nothing else
        with open(os.devnull, "w") as quiet:
            run_plan(trained, RunOptions(out=quiet, tensorboard=False))
        model = export_model(run_dir, "policy", tmp / "model")
        shutil.copy(run_dir / "metrics.jsonl", model / "sft_metrics.jsonl")
        try:
            os.rename(model, final)  # atomic; fails if another process published first
        except OSError:
            if not (final / "config.json").exists():
                raise
        print(f"{BUILTIN_PREFIX}{name}: trained in {time.perf_counter() - t0:.0f} s",
              file=out, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def recipe_plan(name: str) -> ExecutionPlan:
    """The plan of trained built-in `name`'s recipe graph, compiled once per process."""
    from flowgraph.passes import compile_graph

    recipe = TRAINED_BUILTINS[name][1]
    result = compile_graph(graph_from_yaml(recipe, file=f"<recipe of {BUILTIN_PREFIX}{name}>"))
    if result.plan is None:  # the recipe is tested to compile; a broken one must not pass
        raise CompileError(result.diagnostics)
    return result.plan
