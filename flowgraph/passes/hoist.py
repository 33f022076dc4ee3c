"""Pass `hoist`: loop-invariant hoisting.

A node is invariant when it computes the same rows at every step: every input comes from
a data source or another invariant node, its model (if any) is frozen, and its kind is
deterministic and row-wise. Invariant nodes get `hoisted: true` and make the plan's
`prologue` stage: the executor runs them before the training loop over every row of
the dataset (and of the held-out split when there is evaluation), keeps the outputs by
the row's `uid` and reads them at every step (per process, not checkpointed: a resumed
run computes them again). Offline DPO's reference log-probs are the classic
case (Rafailov et al. 2023 precompute them once). Only a node whose every batched output
has one row per data row (first axis `Bp`) can be kept by the row's `uid`: a `repeat` of
a data column gives N rows per data row (`Bp*N`) and stays in the loop. The pass decides
every node's mark afresh, so a wrong `hoisted: true` in a file is cleared.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.checker.shapes import has_batch_axis, topo_order
from flowgraph.dims import Poly
from flowgraph.ir import NodeSpec, PortRef
from flowgraph.passes.program import Program
from flowgraph.registry import HOISTABLE_CATEGORIES

_BP = Poly.sym("Bp")
"""The first axis of one row per data row (a data source's batch of prompts or pairs)."""


@dataclass(frozen=True, slots=True)
class HoistInvariants:
    """Mark loop-invariant nodes `hoisted`: computed once, before the training loop."""

    name: ClassVar[str] = "hoist"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        graph = program.graph
        invariant = {d.name for d in graph.data}
        # Topological order: a node's producers are decided before the node.
        for node in topo_order(graph, set()):
            if _invariant(node, program, invariant):
                invariant.add(node.name)
        nodes = tuple(replace(n, hoisted=n.name in invariant) for n in graph.nodes)
        return replace(program, graph=replace(graph, nodes=nodes))


def _invariant(node: NodeSpec, program: Program, invariant: set[str]) -> bool:
    kind = program.kind(node.name)
    if kind.category not in HOISTABLE_CATEGORIES or kind.trains:
        return False
    model = program.graph.model(node.model) if node.model else None
    if model is not None and model.trainable:
        return False
    return all(ref.node in invariant for _, ref in node.inputs) and _per_data_row(node, program)


def _per_data_row(node: NodeSpec, program: Program) -> bool:
    """Every batched output has one row per data row: the prologue keeps outputs by the
    data row's `uid`, so N rows of one data row (`Bp*N`) would come back as one."""
    assert program.check is not None  # `validate` ran: `program.kind` said so
    shapes = program.check.shapes
    for port in program.kind(node.name).outputs:
        ref = PortRef(node.name, port.name)
        shape = shapes.outputs.get((node.name, port.name))
        if not has_batch_axis(shapes, ref):
            continue
        if shape is None or shape.variadic or shape.dims[0] != _BP:
            return False
    return True

