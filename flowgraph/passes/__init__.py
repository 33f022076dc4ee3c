"""Compile passes: a graph file -> an `ExecutionPlan`, through a pipeline you can inspect.

    validate -> infer_dims -> asynchronous -> on_policy -> token_budget -> packing -> dce ->
    hoist -> fusion -> placement -> schedule -> memory

Each pass is a small frozen dataclass with a `name` and one `apply(program) ->
program` (see `program.py`), one per module here, listed in the flat registry
`PASSES` in pipeline order. `PassPipeline` prints the numbered list, skips disabled
passes, dumps the graph after a pass, and names the pass (and those before it) when
one fails. `compile_graph` is the one entry point:

    result = compile_graph("graphs/grpo.yaml", target="ray", nproc=2)
    plan_to_json(result.plan) if result.plan else result.diagnostics
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from flowgraph.choices import DEVICES, TARGETS
from flowgraph.diagnostics import Diagnostic
from flowgraph.errors import FlowgraphError, UsageError
from flowgraph.frontend import load_graph, no_overrides_for_a_built_graph
from flowgraph.ir import Graph
from flowgraph.passes.asynchronous import SplitRollouts
from flowgraph.passes.dce import EliminateDeadNodes
from flowgraph.passes.fusion import FuseForwards
from flowgraph.passes.hoist import HoistInvariants
from flowgraph.passes.infer_dims import InferDims
from flowgraph.passes.memory import EstimateMemory
from flowgraph.passes.on_policy import ElideOldLogProb
from flowgraph.passes.packing import PackSequences
from flowgraph.passes.placement import PlaceNodes
from flowgraph.passes.program import Pass, Program
from flowgraph.passes.schedule import ScheduleStages
from flowgraph.passes.token_budget import TokenBudget
from flowgraph.passes.validate import Validate
from flowgraph.plan import ExecutionPlan

__all__ = [
    "PASSES",
    "CompileResult",
    "ExecutionPlan",
    "Pass",
    "PassPipeline",
    "Program",
    "compile_graph",
]

PASSES: dict[str, type[Pass]] = {
    p.name: p
    for p in (Validate, InferDims, SplitRollouts, ElideOldLogProb, TokenBudget, PackSequences,
              EliminateDeadNodes, HoistInvariants, FuseForwards, PlaceNodes, ScheduleStages,
              EstimateMemory)
}
"""Every pass by name, in pipeline order."""

PLAN_NEEDS = ("validate", "placement", "schedule")
"""Passes the plan is built from; they cannot be disabled."""


@dataclass(frozen=True, slots=True)
class PassPipeline:
    """The passes to run, in order, and the names of those to skip."""

    passes: tuple[Pass, ...]
    disabled: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [p.name for p in self.passes]
        problems = [f"unknown pass `{n}`; the passes are: {', '.join(names)}"
                    for n in self.disabled if n not in names]
        problems += [f"pass `{n}` cannot be disabled: the plan is built from its result"
                     for n in self.disabled if n in PLAN_NEEDS]
        problems += [f"pass `{n}` cannot be disabled while `{p.name}` runs: `{p.name}` reads "
                     f"its result (disable `{p.name}` too)"
                     for p in self.passes if p.name not in self.disabled
                     for n in p.requires if n in self.disabled and n not in PLAN_NEEDS]
        if problems:
            raise UsageError("; ".join(problems))

    @staticmethod
    def default(disabled: Sequence[str] = ()) -> PassPipeline:
        return PassPipeline(tuple(cls() for cls in PASSES.values()), tuple(disabled))

    def describe(self) -> str:
        """The numbered pass list, as `flowgraph compile --print-passes` prints it."""
        width = max(len(p.name) for p in self.passes)
        lines = []
        for i, p in enumerate(self.passes, 1):
            doc = (type(p).__doc__ or "").strip().split("\n")[0]
            mark = "  [disabled]" if p.name in self.disabled else ""
            lines.append(f"{i:>2}. {p.name:<{width}}  {doc}{mark}")
        return "\n".join(lines)

    def run(self, program: Program, dump_after: Sequence[str] = (),
            dump: TextIO | None = None) -> Program:
        """Run the enabled passes in order; stop after the first pass that reports an error."""
        ran: list[str] = []
        for p in self.passes:
            if p.name in self.disabled:
                continue
            try:
                program = p.apply(program)
            except Exception as exc:
                raise FlowgraphError(
                    f"pass `{p.name}` failed: {type(exc).__name__}: {exc} (passes run before "
                    f"it: {', '.join(ran) or 'none'})") from exc
            ran.append(p.name)
            if p.name in dump_after and dump is not None:
                dump.write(f"# --- after pass `{p.name}` ---\n{program.describe()}")
            if program.failed:
                break
        return program

    def check_dump_names(self, names: Sequence[str]) -> None:
        for n in names:
            if n not in {p.name for p in self.passes}:
                raise UsageError(f"--dump-after `{n}`: no such pass; the passes are: "
                                 f"{', '.join(p.name for p in self.passes)}")
            if n in self.disabled:
                raise UsageError(f"--dump-after `{n}`: that pass is disabled")


@dataclass(frozen=True, slots=True)
class CompileResult:
    """The plan (None when there are errors) and every diagnostic found on the way."""

    plan: ExecutionPlan | None
    diagnostics: tuple[Diagnostic, ...]
    program: Program | None = None
    """The program after the last pass that ran; None when the file did not load."""


def compile_graph(
    file: str | Path | Graph,
    *,
    target: str = "local",
    nproc: int | None = None,
    overrides: Sequence[str] = (),
    pipeline: PassPipeline | None = None,
    dump_after: Sequence[str] = (),
    dump: TextIO | None = None,
    device: str | None = None,
) -> CompileResult:
    """Compile a graph file (or a `Graph` built in Python) for `target`.

    `nproc` overrides `resources.nproc`; `device` (`cpu` or `cuda`) decides
    `resources.device: auto`, which is cpu unless the caller says so. Problems with the
    graph come back as diagnostics; a wrong call raises `UsageError`.
    """
    # 1. The request itself: target, sizes, pass names.
    pipeline = pipeline or PassPipeline.default()
    _check_request(target, nproc, device, pipeline, dump_after)
    # 2. Front end: the file with its overrides -> Graph IR.
    graph, loaded = _load(file, overrides)
    if graph is None or any(d.is_error for d in loaded):
        return CompileResult(None, tuple(loaded))
    # 3. The program the passes transform.
    auto = graph.resources.device == "auto"
    program = Program(graph, target, nproc or graph.resources.nproc,
                      (device or "cpu") if auto else graph.resources.device,
                      diagnostics=tuple(loaded))
    # 4. The passes, in pipeline order; an error stops them.
    program = pipeline.run(program, dump_after, dump or sys.stderr)
    # 5. Lower to the plan.
    plan = None if program.failed else program.to_plan()
    return CompileResult(plan, program.diagnostics, program)


def _check_request(target: str, nproc: int | None, device: str | None, pipeline: PassPipeline,
                   dump_after: Sequence[str]) -> None:
    if target not in TARGETS:
        raise UsageError(f"unknown target `{target}`; the targets are: {', '.join(TARGETS)}")
    if nproc is not None and nproc < 1:
        raise UsageError(f"nproc must be >= 1, got {nproc}")
    if device is not None and device not in DEVICES:
        raise UsageError(f"device must be one of {', '.join(DEVICES)}, got `{device}`")
    pipeline.check_dump_names(dump_after)


def _load(file: str | Path | Graph, overrides: Sequence[str]
          ) -> tuple[Graph | None, list[Diagnostic]]:
    if not isinstance(file, Graph):
        return load_graph(file, overrides)
    no_overrides_for_a_built_graph(file, overrides)
    return file, []
