"""flowgraph.compilers: the executors that run an execution plan (local, fsdp, ray).

`run(plan, options)` is the one entry point for every target: it runs the plan as it
is (its target, pools, stages and dispatch; nothing is compiled again) and returns the
run, its folder and metric rows. `flowgraph run`, `flowgraph.run` and the tests call it.
A trained built-in model the plan names (`builtin:tiny-lm-sft`) is trained first, once
per machine (`builtins.py`); a run dir named as a model path is exported from its newest
checkpoint, once (`export.from_run_dirs`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from flowgraph.compilers.options import Run, RunOptions, read_metrics
from flowgraph.data.held import write_tables

if TYPE_CHECKING:
    from flowgraph.plan import ExecutionPlan

__all__ = ["Run", "RunOptions", "read_metrics", "run"]


def run(plan: ExecutionPlan, options: RunOptions | None = None) -> Run:
    """Run `plan` on its target; the run dir is the plan's `trainer.run_dir`."""
    opts = options or RunOptions()
    # the one place `--resume` and `trainer.resume` are merged
    opts = replace(opts, resume=opts.resume or plan.trainer.resume)
    from flowgraph.compilers.run_dir import prepare_run

    # the run dir refused, or cleared (`overwrite`), before anything is written into it
    prepare_run(plan, resume=opts.resume, overwrite=opts.overwrite,
                check_only=not _prepares_run_dir(plan, opts))
    # DataFrames and hub datasets as files in the run dir, before any process reads them
    plan = write_tables(plan, Path(plan.trainer.run_dir))
    from flowgraph.compilers.builtin_training import ensure_builtins
    from flowgraph.compilers.export import from_run_dirs

    ensure_builtins(plan.models, opts.out)  # before any worker looks for them
    plan = from_run_dirs(plan, opts.out)  # a run dir as a model path: its checkpoint's
    if plan.target == "fsdp":
        from flowgraph.compilers.targets.fsdp.launch import run_fsdp

        run_fsdp(plan, opts)
    elif plan.target == "ray":
        from flowgraph.compilers.targets.ray.driver import run_ray

        run_ray(plan, opts)
    else:
        from flowgraph.compilers.targets.local import run_plan

        run_plan(plan, opts)
    run_dir = Path(plan.trainer.run_dir)
    return Run(run_dir, read_metrics(run_dir))


def _prepares_run_dir(plan: ExecutionPlan, opts: RunOptions) -> bool:
    """Whether this process prepares the run dir: not a node > 0 of a multi-node fsdp
    launch, nor a rank > 0 that torchrun started (rank 0 and node 0 prepare the run dir
    all of them share)."""
    if plan.target != "fsdp":
        return True
    from flowgraph.compilers.targets.fsdp.launch import torchrun_rank

    return opts.node_rank == 0 and not torchrun_rank()
