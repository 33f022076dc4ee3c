"""Strict mode holds each edge's tensor to the dims the plan wrote for that input
(`InputPlan.dims`), not to dims it works out again from the graph or the output."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flowgraph.errors import ContractViolation
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan
from flowgraph.runtime.strict import RuntimeContracts

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def _with_input_dims(plan: ExecutionPlan, node: str, port: str, dims: str) -> ExecutionPlan:
    """`plan` with one input's dims replaced (records only: no verifier runs)."""
    nodes = tuple(
        dataclasses.replace(n, inputs=tuple(dataclasses.replace(i, dims=dims)
                                            if i.port == port else i for i in n.inputs))
        if n.name == node else n for n in plan.nodes)
    return dataclasses.replace(plan, nodes=nodes)


def test_an_edge_is_held_to_its_inputs_dims_in_the_plan() -> None:
    plan = compile_graph(GRAPHS / "grpo.yaml").plan
    assert plan is not None
    wired = next(i for i in plan.node("reward").inputs if i.port == "responses")
    assert wired.dims == "Bp*N T"
    dims = {d.name: d.value for d in plan.dims}
    rows, t = dims["Bp"] * dims["N"], dims["T"]
    spec = wired.spec.tensor_spec()
    fits, longer = torch.zeros(rows, t, dtype=torch.long), torch.zeros(rows, t + 1,
                                                                       dtype=torch.long)

    RuntimeContracts.of(plan).check_edge(wired, "reward", spec, fits, 0)
    with pytest.raises(ContractViolation, match=r"edge `gen\.responses -> reward\.responses`"):
        RuntimeContracts.of(plan).check_edge(wired, "reward", spec, longer, 0)

    edited = _with_input_dims(plan, "reward", "responses", "Bp*N T+1")
    wired = next(i for i in edited.node("reward").inputs if i.port == "responses")
    RuntimeContracts.of(edited).check_edge(wired, "reward", spec, longer, 0)
    with pytest.raises(ContractViolation, match=r"edge `gen\.responses -> reward\.responses`"):
        RuntimeContracts.of(edited).check_edge(wired, "reward", spec, fits, 0)
