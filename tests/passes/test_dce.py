"""Pass `dce` (flowgraph/passes/dce.py): nodes whose outputs no sink reads are dropped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowgraph.ir import Graph
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
DocOf = Callable[[str], dict[str, Any]]
GraphOf = Callable[[dict[str, Any]], Graph]
PlanOf = Callable[..., ExecutionPlan]


def test_dce_drops_a_dead_chain_transitively(plan_of: PlanOf, ppo_with_dead_nodes: Graph) -> None:
    plan = plan_of(ppo_with_dead_nodes, target="ray", nproc=2)
    assert plan.dropped == ("dead_rm", "dead_tok")
    assert {"dead_rm", "dead_tok"}.isdisjoint(n.name for n in plan.nodes)
    assert not {"dead_rm", "dead_tok"} & {n.name for n in plan.nodes}
    # The reward model only the dead node used gets no pool (no `reward` pool at all).
    assert [p.name for p in plan.pools] == ["driver", "actor_rollout_ref", "critic"]


def test_dce_keeps_everything_without_a_sink(doc_of: DocOf, graph_of: GraphOf) -> None:
    doc = doc_of("grpo")
    doc["models"]["actor"]["trainable"] = False
    for name in ("reward", "adv", "update_actor"):
        del doc["nodes"][name]
    result = compile_graph(graph_of(doc))
    assert result.plan is not None and result.plan.dropped == ()
    assert [n.name for n in result.plan.nodes] == ["train", "gen", "old_logprob", "ref_logprob"]
    assert not any(d.is_error for d in result.diagnostics)


def test_dce_keeps_the_example_graphs_whole(plan_of: PlanOf) -> None:
    # RLOO's update takes one optimizer step per rollout: pass `on_policy` drops its
    # old-log-prob forward (tested below); nothing else in the examples is dead.
    for file in sorted(GRAPHS.glob("*.yaml")):
        dropped = plan_of(file.name).dropped
        assert dropped == (("old_logprob",) if file.name == "rloo.yaml" else ()), file
