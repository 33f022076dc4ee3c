"""The checker: one pass that collects every problem of a graph.

`check_graph` runs structural lint, dim/dtype unification along every edge and batch
arithmetic, and returns a `CheckResult` holding all diagnostics (sorted by position)
plus what unification inferred, which `viz` and the compiler reuse.
"""

from __future__ import annotations

import html
import traceback
from dataclasses import dataclass
from pathlib import Path

from flowgraph.checker.agents import SCHEMA_HINT, check_agents
from flowgraph.checker.batch import check_batches, ranks_of
from flowgraph.checker.filters import check_filters
from flowgraph.checker.functions import check_functions
from flowgraph.checker.init_from import check_init_from
from flowgraph.checker.judges import check_judges
from flowgraph.checker.resources import check_pool_gpus
from flowgraph.checker.sampling import check_temperatures, check_val_sampling
from flowgraph.checker.shapes import DimEnv, EdgeInfo, PortShape, ShapeResult, infer_shapes
from flowgraph.checker.staleness import check_staleness
from flowgraph.checker.structure import (
    Resolved,
    check_cycles,
    check_data_files,
    check_held_out,
    check_models,
    check_params,
    check_ports,
    check_unused,
    resolve_kinds,
)
from flowgraph.diagnostics import Diagnostic, error, sort_key
from flowgraph.errors import PluginError, ToolSchemaError
from flowgraph.ir import Graph, Plugin
from flowgraph.registry import Registry, plugin_source
from flowgraph.source import SourcePos
from flowgraph.spelling import graph_written_in

__all__ = ["CheckResult", "DimEnv", "EdgeInfo", "PortShape", "Resolved", "check_graph"]


@dataclass(frozen=True, repr=False)
class CheckResult:
    """Diagnostics plus the inferred facts about a graph. Printed (`str`, or shown in a
    notebook), it reads as the diagnostics, then every edge with its bound shape
    (`edge_lines`)."""

    graph: Graph
    diagnostics: tuple[Diagnostic, ...]
    table: dict[str, Resolved]
    shapes: ShapeResult
    registry: Registry
    dp: int

    @property
    def ok(self) -> bool:
        return not any(d.is_error for d in self.diagnostics)

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.is_error)

    def edge_lines(self) -> list[str]:
        """One line per edge: `gen.responses -> reward.responses  int (Bp*N, T) =
        (16, 8)`, the producer's dtype and the dims unification bound (`✗`: the edge
        breaks its contract; a diagnostic says how)."""
        rows = [(f"{e.src.node}.{e.src.port} -> {e.dst}.{e.port}", e) for e in
                self.shapes.edges]
        width = max((len(name) for name, _ in rows), default=0)
        lines = []
        for name, e in rows:
            shape = self.shapes.outputs.get((e.src.node, e.src.port))
            dtype = f"{shape.spec.dtype} " if shape is not None else ""
            lines.append(f"{name:<{width}}  {dtype}{e.label}{'' if e.ok else '  ✗'}")
        return lines

    def __str__(self) -> str:
        errors = len(self.errors)
        warnings = sum(d.severity == "warning" for d in self.diagnostics)
        head = (f"graph `{self.graph.name}`: {'ok' if not errors else 'failed'}, "
                f"{errors} error(s), {warnings} warning(s); {len(self.shapes.edges)} edges")
        return "\n".join([head, *(d.summary() for d in self.diagnostics), "edges:",
                          *(f"  {line}" for line in self.edge_lines())])

    def __repr__(self) -> str:
        return f"<CheckResult {str(self).splitlines()[0]}>"

    def _repr_html_(self) -> str:
        """A notebook shows the printed form."""
        return f"<pre>{html.escape(str(self))}</pre>"


def _load_plugins(graph: Graph, registry: Registry, out: list[Diagnostic]) -> None:
    for plugin in graph.plugins:
        try:
            registry.load_plugins([plugin.module], [plugin.folder()])
        except PluginError as exc:
            if isinstance(exc.__cause__, ToolSchemaError):  # a @tool it defines
                out.append(error("FG603", f"plugin `{plugin.module}` defines a tool that "
                                 f"cannot be offered to the policy: {exc.__cause__}",
                                 plugin.pos, hint=SCHEMA_HINT))
                continue
            at = _failed_at(plugin, exc)
            out.append(error("FG113", str(exc), at or plugin.pos,
                             notes=(f"listed under plugins: at {plugin.pos}",) if at else (),
                             hint="the plugin's own line above failed on import" if at else
                             "a file or module next to the graph file, or an installed "
                             "package: is the name spelt as you would `import` it?"))


def _failed_at(plugin: Plugin, exc: PluginError) -> SourcePos | None:
    """The plugin's own line that failed to import (a `SyntaxError`'s, or the deepest
    frame of the import's traceback in the plugin's folder), where a CI annotation and the
    snippet belong; None when the plugin itself was not found or not reached."""
    cause = exc.__cause__
    if isinstance(cause, SyntaxError) and cause.filename and cause.lineno:
        return SourcePos(cause.filename, cause.lineno, cause.offset or 1)
    source = plugin_source(plugin.module, plugin.folder())
    if cause is None or source is None:
        return None
    folder = source if source.is_dir() else source.parent
    mine = [f for f in traceback.extract_tb(cause.__traceback__)
            if Path(f.filename).is_relative_to(folder)]
    return SourcePos(mine[-1].filename, mine[-1].lineno or 0, 1) if mine else None


def check_graph(graph: Graph, registry: Registry | None = None, dp: int | None = None,
                target: str | None = None) -> CheckResult:
    """Check everything; `dp` (data-parallel size) defaults to `resources.nproc`. The
    updates of models in declared `resources.pools` run on their pool's workers, under
    target ray: pools are taken as declared unless `target` is `local` or `fsdp`."""
    registry = registry or Registry.default()
    dp = dp or graph.resources.nproc
    with graph_written_in(graph.source):  # hints spell the fix as the graph is written
        diags, table, shapes = _check(graph, registry, dp, target)
    return CheckResult(graph, diags, table, shapes, registry, dp)


def _check(graph: Graph, registry: Registry, dp: int, target: str | None
           ) -> tuple[tuple[Diagnostic, ...], dict[str, Resolved], ShapeResult]:
    ranks, pools = ranks_of(graph, dp, target not in ("local", "fsdp"))
    out: list[Diagnostic] = []
    _load_plugins(graph, registry, out)
    table = resolve_kinds(graph, registry, out)
    check_params(table, out)
    check_functions(graph, table, out)
    check_models(graph, table, out)
    check_init_from(graph, table, out)
    check_temperatures(table, out)
    check_val_sampling(table, out)
    check_held_out(graph, out)
    check_data_files(graph, out)
    on_cycle = check_cycles(graph, out)
    check_unused(graph, table, out)
    shapes = infer_shapes(graph, table, on_cycle, out)
    check_ports(table, shapes.batch, out)  # after unification: an update's rows count
    check_batches(graph, table, shapes, ranks, pools, out)
    check_filters(graph, table, shapes, out)
    check_staleness(graph, table, shapes, out)
    check_agents(graph, table, shapes.env, out)
    check_judges(graph, table, out)
    check_pool_gpus(graph, target, out)
    return tuple(sorted(dict.fromkeys(out), key=sort_key)), table, shapes

