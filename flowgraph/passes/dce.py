"""Pass `dce`: dead-node elimination.

A node is live when one of its outputs reaches a sink (an update node: a kind that
`trains`), directly or through other nodes; everything else is dropped, data sources
included. A graph without a sink (an evaluation-only graph) keeps every node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.ir import Graph
from flowgraph.passes.program import Program


@dataclass(frozen=True, slots=True)
class EliminateDeadNodes:
    """Drop nodes and data sources whose outputs reach no update node."""

    name: ClassVar[str] = "dce"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        graph = program.graph
        sinks = [n.name for n in graph.nodes if program.kind(n.name).sink]
        if not sinks:
            return program
        live = _reaching(graph, sinks)
        dropped = tuple(name for name in program.producers() if name not in live)
        if not dropped:
            return program
        graph = replace(graph, nodes=tuple(n for n in graph.nodes if n.name in live),
                        data=tuple(d for d in graph.data if d.name in live))
        return replace(program, graph=graph, dropped=program.dropped + dropped)


def _reaching(graph: Graph, sinks: list[str]) -> set[str]:
    """The sinks and every producer upstream of them (a walk over input edges)."""
    upstream = {n.name: [ref.node for _, ref in n.inputs] for n in graph.nodes}
    live: set[str] = set()
    todo = list(sinks)
    while todo:
        name = todo.pop()
        if name not in live:
            live.add(name)
            todo.extend(upstream.get(name, ()))
    return live
