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

import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgraph.document import parse_override, plain
from flowgraph.errors import CompileError, FlowgraphError, PlanError, PlanFileError, UsageError
from flowgraph.ir import Graph
from flowgraph.plan import MAX_PLAN_BYTES, ExecutionPlan, verify_kinds
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
    """A plan file (`flowgraph compile -o plan.json`), checked by the plan verifier. A file
    that cannot be read as a plan (missing, over `MAX_PLAN_BYTES`, not UTF-8, not JSON,
    nested too deeply, another format version), or whose Python objects this process
    cannot rebuild (`flowgraph.objects`), is one `PlanFileError` naming it."""
    file = Path(path)
    try:
        if file.stat().st_size > MAX_PLAN_BYTES:  # before reading it all into memory
            raise PlanFileError(f"the plan `{path}` is larger than {MAX_PLAN_BYTES >> 20} MiB")
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise PlanFileError(f"cannot read the plan `{path}`: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise PlanFileError(f"the plan `{path}` is not UTF-8 text (byte {exc.start}: "
                            f"{exc.object[exc.start:exc.start + 1]!r}); write it as "
                            "`flowgraph compile -o` does") from exc
    try:
        plan = ExecutionPlan.from_json(text)
    except PlanFileError as exc:
        raise PlanFileError(f"`{path}`: {exc}") from exc
    missing = plan.unresolved()  # a plan file holds references to Python objects, no code
    if missing:
        raise PlanFileError(f"`{path}`: {missing}")
    verify_kinds(plan, _kinds(plan))
    return plan


PLAN_RUN_SETTINGS = {"run_dir": (str, "a folder"), "steps": (int, "a whole number")}
"""The `trainer.` settings a run of a compiled plan may override, with their type: where
it writes and how long it trains. Nothing the plan was compiled from depends on them;
every other setting may (dims, params, models, the loop's schedule), so the graph is
compiled again with it."""


def with_run_settings(plan: ExecutionPlan, overrides: Sequence[str]) -> ExecutionPlan:
    """`plan` with the `trainer.run_dir=` and `trainer.steps=` overrides applied; any other
    override is a `UsageError` naming it (it would change the plan)."""
    trainer, refused = plan.graph.trainer, []
    for i, text in enumerate(overrides):
        parsed = parse_override(text, i)
        if not isinstance(parsed, tuple):
            raise UsageError(parsed.message)
        path, node = parsed
        name = path[1] if len(path) == 2 and path[0] == "trainer" else ""
        if name not in PLAN_RUN_SETTINGS:
            refused.append(text)
            continue
        value, (want, words) = plain(node), PLAN_RUN_SETTINGS[name]
        if type(value) is not want:  # bool is an int: a type check, not isinstance
            raise UsageError(f"override `{text}`: trainer.{name} takes {words}")
        setting: dict[str, Any] = {name: value}
        try:
            trainer = replace(trainer, **setting)
        except FlowgraphError as exc:  # the setting's bounds: `trainer.steps is -1; ...`
            raise UsageError(f"override `{text}`: {exc}") from exc
    if refused:
        raise UsageError(
            f"a compiled plan runs as it is: {', '.join(refused)} would change what it runs "
            f"(it takes only {', '.join(f'trainer.{k}' for k in PLAN_RUN_SETTINGS)}); "
            "compile the graph again with them (`flowgraph compile GRAPH KEY=VALUE -o "
            "plan.json`), or edit the plan")
    if trainer is plan.graph.trainer:
        return plan
    return replace(plan, graph=replace(plan.graph, trainer=trainer))


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

    if sys._getframe(1).f_globals.get("__name__") == "__mp_main__":
        # a worker process (an fsdp rank, the rollout producer) importing the user's script
        raise UsageError("flowgraph.run was called again as a worker process of the run "
                         "imported your script: start the run under "
                         "`if __name__ == \"__main__\":` (Python's rule for scripts that "
                         "start processes)")
    if isinstance(plan, (str, Path)) and str(plan).endswith(".json"):
        options.setdefault("plan_file", Path(plan))
        plan = load_plan(plan)
    if not isinstance(plan, ExecutionPlan):
        plan = compile(plan, target=target or "local", nproc=nproc, overrides=overrides,
                       disable=disable)
        options.setdefault("disabled", tuple(disable))
    elif disable or nproc is not None or target not in (None, plan.target):
        raise UsageError(
            f"a plan runs as compiled (target {plan.target}, {plan.nproc} per pool): edit the "
            "plan, or compile the graph again with other --target, --nproc or passes")
    else:
        plan = with_run_settings(plan, overrides)
    missing = plan.unresolved()  # before anything starts: the run would need them
    if missing:
        raise PlanError(missing)
    if "allow_changed" in options:  # a list is welcome here; the options are frozen
        options["allow_changed"] = tuple(options["allow_changed"])
    return run_plan(plan, RunOptions(overrides=tuple(overrides), **options))
