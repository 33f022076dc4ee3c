"""Compile and run from Python: `flowgraph.compile` and `flowgraph.run`, what the CLI calls.

    import flowgraph
    plan = flowgraph.compile(graph, target="ray", nproc=2)   # a Graph, a file or a path
    result = flowgraph.run(plan)                             # or run(graph, target=...)
    result.run_dir, result.rows[-1]["critic/score/mean"]

`compile` raises `CompileError` (its `diagnostics` are what `flowgraph check` prints)
instead of returning a plan with errors; `run` runs a plan as it is, or compiles a
graph first, and returns the run's folder and metric rows (`flowgraph.compilers.Run`).
With the CLI, this module is an entry point: the layer above the executors, the only
one that starts them (`tests/test_boundaries.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgraph.errors import CompileError, FlowgraphError
from flowgraph.ir import Graph
from flowgraph.plan import ExecutionPlan, verify_kinds
from flowgraph.registry import KindSpec, Registry

if TYPE_CHECKING:
    from flowgraph.compilers import Run


def compile(graph: Graph | str | Path, *, target: str = "local", nproc: int | None = None,
            overrides: Sequence[str] = (), device: str | None = None,
            disable: Sequence[str] = ()) -> ExecutionPlan:
    """Lower a graph (built in Python, or a graph file with `overrides`) to the plan that
    `run` executes on `target` (`local`, `fsdp`, `ray`) with `nproc` data-parallel
    workers (default `resources.nproc`), without the passes named in `disable`."""
    from flowgraph.passes import PassPipeline, compile_graph

    result = compile_graph(graph, target=target, nproc=nproc, overrides=overrides,
                           device=device, pipeline=PassPipeline.default(disabled=disable))
    if result.plan is None:
        raise CompileError(result.diagnostics)
    return result.plan


def load_plan(path: str | Path) -> ExecutionPlan:
    """A plan file (`flowgraph compile -o plan.json`), checked by the plan verifier."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise FlowgraphError(f"cannot read the plan `{path}`: {exc.strerror or exc}") from exc
    plan = ExecutionPlan.from_json(text)
    verify_kinds(plan, _kinds(plan))
    return plan


def _kinds(plan: ExecutionPlan) -> dict[str, KindSpec]:
    """Each node's and data source's kind, from the registry after the graph's plugins
    are imported."""
    registry = Registry.default()
    registry.load_plugins([p.module for p in plan.graph.plugins], plan.plugin_paths)
    kinds = {}
    for n in plan.nodes:
        kind = registry.get(n.kind)
        if kind is None:
            raise FlowgraphError(f"node `{n.name}`: kind `{n.kind}` is not registered (a "
                                 "plugin the graph lists under `plugins:` declares it?)")
        kinds[n.name] = kind
    return kinds


def run(plan: ExecutionPlan | Graph | str | Path, *, target: str | None = None,
        nproc: int | None = None, overrides: Sequence[str] = (), disable: Sequence[str] = (),
        **options: Any) -> Run:
    """Run a plan as it is, or compile a graph (or graph file) for `target` (default
    `local`) first; a `.json` path is a plan file. `options` are the fields of
    `flowgraph.compilers.RunOptions` (`resume`, `allow_changed`, `strict`, `out`,
    `tensorboard`, `metrics_port`, `address`...)."""
    from flowgraph.compilers import RunOptions
    from flowgraph.compilers import run as run_plan

    if isinstance(plan, (str, Path)) and str(plan).endswith(".json"):
        options.setdefault("plan_file", Path(plan))
        plan = load_plan(plan)
    if not isinstance(plan, ExecutionPlan):
        plan = compile(plan, target=target or "local", nproc=nproc, overrides=overrides,
                       disable=disable)
    elif overrides or disable or nproc is not None or target not in (None, plan.target):
        raise FlowgraphError(
            f"a plan runs as compiled (target {plan.target}, {plan.nproc} per pool): edit the "
            "plan, or compile the graph again with other overrides, --target or --nproc")
    if "allow_changed" in options:  # a list is welcome here; the options are frozen
        options["allow_changed"] = tuple(options["allow_changed"])
    return run_plan(plan, RunOptions(overrides=tuple(overrides), **options))
