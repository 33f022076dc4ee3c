"""Pass `schedule`: stages in dependency order and how each edge's tensor moves.

Stages: hoisted nodes form the `prologue`, run once before the loop in topological
order; every other producer gets its topological generation (data sources 0, a node
one more than its latest loop producer; hoisted outputs are ready before the loop),
and generation K is stage `step.K`. Nodes of one stage are independent.

Dispatch of an edge, from the placement of its two ends and whether the tensor has a
batch axis (`flowgraph.plan.dispatch_of`, the rule the plan verifier holds plans to):

    whole batch -> whole batch                          local
    data-parallel -> whole batch, or -> an update       gather
    whole batch -> data-parallel                        split
    data-parallel -> data-parallel                      reshard (gather, then split)
    no batch axis, or whole batch -> an update          broadcast

A split or reshard is `group_aligned` when either end is a grouped kind (GRPO, RLOO:
its statistics are per group) or the tensor's batch axis is that of a `generate` with
more than one sample per prompt, so the N samples of a prompt stay on one worker.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.checker.shapes import has_batch_axis, topo_order
from flowgraph.dims import Poly
from flowgraph.ir import Graph, NodeSpec, PortRef
from flowgraph.passes.program import Placement, Program, Schedule
from flowgraph.plan import EdgePlan, StagePlan, dispatch_of


@dataclass(frozen=True, slots=True)
class ScheduleStages:
    """Order nodes into stages and pick each edge's dispatch (split, gather, ...)."""

    name: ClassVar[str] = "schedule"
    requires: ClassVar[tuple[str, ...]] = ("placement",)

    def apply(self, program: Program) -> Program:
        assert program.placement is not None
        groups = _group_batches(program)
        edges = tuple(_edge(program, program.placement, groups, ref, node, port)
                      for ref, node, port in program.graph.edges())
        return replace(program, schedule=Schedule(_stages(program.graph), edges))


def _stages(graph: Graph) -> tuple[StagePlan, ...]:
    order = topo_order(graph, set())
    level = {d.name: 0 for d in graph.data}
    for node in order:
        if not node.hoisted:
            level[node.name] = max((level[ref.node] + 1 for _, ref in node.inputs
                                    if ref.node in level), default=0)
    prologue = tuple(n.name for n in order if n.hoisted)
    stages = [StagePlan("prologue", prologue, once=True)] if prologue else []
    file_order = [d.name for d in graph.data] + [n.name for n in graph.nodes]
    for k in range(max(level.values(), default=-1) + 1):
        stages.append(StagePlan(f"step.{k}", tuple(n for n in file_order if level.get(n) == k)))
    return tuple(stages)


def _edge(program: Program, placement: Placement, groups: set[Poly], ref: PortRef,
          node: NodeSpec, port: str) -> EdgePlan:
    src, dst = placement.of(ref.node), placement.of(node.name)
    batched = _has_batch_axis(program, ref)
    dispatch = dispatch_of(src.data_parallel, dst.data_parallel, program.kind(node.name).trains,
                           batched)
    aligned = dispatch in ("split", "reshard") and (
        program.kind(ref.node).grouped or program.kind(node.name).grouped
        or _batch_axis(program, ref) in groups)
    return EdgePlan(str(ref), f"{node.name}.{port}", dispatch, aligned, batched)


def _batch_axis(program: Program, ref: PortRef) -> Poly | None:
    assert program.check is not None
    shape = program.check.shapes.outputs.get((ref.node, ref.port))
    return shape.dims[0] if shape is not None and shape.dims else None


def _has_batch_axis(program: Program, ref: PortRef) -> bool:
    assert program.check is not None
    return has_batch_axis(program.check.shapes, ref)


def _group_batches(program: Program) -> set[Poly]:
    """Batch axes made of groups: a rollout's outputs when its `n` is not 1."""
    assert program.check is not None
    env = program.check.shapes.env
    out: set[Poly] = set()
    for node in program.graph.nodes:
        n = env.value(env.locals_.get(f"{node.name}.n"))
        axis = _batch_axis(program, PortRef(node.name, "index"))
        if program.kind(node.name).category == "rollout" and n != 1 and axis is not None:
            out.add(axis)
    return out
