"""Pass `hoist` (flowgraph/passes/hoist.py): nodes invariant across steps run once, in the
prologue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from flowgraph.ir import Graph
from flowgraph.plan import ExecutionPlan

DocOf = Callable[[str], dict[str, Any]]
GraphOf = Callable[[dict[str, Any]], Graph]
PlanOf = Callable[..., ExecutionPlan]


@pytest.mark.parametrize(("graph", "hoisted"), [
    ("dpo", {"ref_chosen", "ref_rejected"}),
    ("ppo", set()),
    ("grpo", set()),
    ("rloo", set()),
    ("reinforce_pp", set()),
    ("remax", set()),
])
def test_hoisted_nodes(plan_of: PlanOf, graph: str, hoisted: set[str]) -> None:
    plan = plan_of(f"{graph}.yaml")
    assert {n.name for n in plan.nodes if n.hoisted} == hoisted
    assert {n.name for n in plan.nodes if n.hoisted} == hoisted
    prologue = [s for s in plan.stages if s.once]
    assert [set(s.nodes) for s in prologue] == ([hoisted] if hoisted else [])


def test_dpo_reference_runs_in_the_prologue_before_the_loop(plan_of: PlanOf) -> None:
    plan = plan_of("dpo.yaml")
    assert [(s.name, s.nodes, s.once) for s in plan.stages] == [
        ("prologue", ("ref_chosen", "ref_rejected"), True),
        ("step.0", ("pairs",), False),
        ("step.1", ("update",), False),
    ]


def test_a_trainable_model_is_not_invariant(plan_of: PlanOf, doc_of: DocOf,
        graph_of: GraphOf) -> None:
    doc = doc_of("dpo")
    doc["nodes"]["ref_chosen"]["model"] = "policy"
    plan = plan_of(graph_of(doc))
    assert {n.name for n in plan.nodes if n.hoisted} == {"ref_rejected"}


@pytest.fixture
def grpo_with_repeated_ground_truth(doc_of: DocOf, graph_of: GraphOf) -> Graph:
    """GRPO whose reward reads the data column repeated per sample (`repeat` of
    `train.ground_truth`: Bp rows in, Bp*N out) instead of the rollout's copy."""
    doc = doc_of("grpo")
    doc["dims"].update(Bp=4, N=4)
    doc["nodes"]["update_actor"]["params"]["mini_batch_size"] = 8
    doc["nodes"]["gt"] = {"kind": "repeat", "inputs": {"x": "train.ground_truth"}}
    doc["nodes"]["reward"]["inputs"]["ground_truth"] = "gt.x"
    return graph_of(doc)


def test_a_node_with_per_sample_output_is_not_hoisted(
        plan_of: PlanOf, grpo_with_repeated_ground_truth: Graph) -> None:
    # The prologue keeps one row per data row (by uid); `gt.x` has N rows per data row.
    plan = plan_of(grpo_with_repeated_ground_truth)
    assert not plan.node("gt").hoisted
    assert not any(s.once for s in plan.stages)


SAMPLED_EVAL = ("nodes.gen.params.val_n=2", "nodes.gen.params.val_temperature=1.0")


@pytest.mark.parametrize(("overrides", "n"), [((), 1), (SAMPLED_EVAL, 2)])
def test_repeat_follows_the_samples_per_prompt_at_evaluation(
        plan_of: PlanOf, overrides: tuple[str, ...], n: int) -> None:
    # ReMax: `gen` samples N=4 per prompt in training, val_n at evaluation (greedy: 1);
    # the greedy baseline (`gen_greedy`, n 1) is repeated to match, N times, then n times.
    baseline = plan_of("remax.yaml", overrides=overrides).node("baseline")
    assert baseline.param_values()["n"] is None  # the global N
    assert baseline.param_values(evaluation=True)["n"] == n


def test_a_wrong_hoisted_mark_in_the_file_is_cleared(plan_of: PlanOf, doc_of: DocOf,
        graph_of: GraphOf) -> None:
    doc = doc_of("ppo")
    doc["nodes"]["adv"]["hoisted"] = True
    assert not plan_of(graph_of(doc)).node("adv").hoisted
