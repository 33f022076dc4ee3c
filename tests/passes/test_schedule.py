"""Pass `schedule` (flowgraph/passes/schedule.py): stages as topological generations and each
edge's dispatch."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flowgraph.ir import Graph
from flowgraph.plan import ExecutionPlan
from flowgraph.registry import _DECLARED

DocOf = Callable[[str], dict[str, Any]]
GraphOf = Callable[[dict[str, Any]], Graph]
PlanOf = Callable[..., ExecutionPlan]


def test_ppo_stages_are_topological_generations(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml")
    assert [(s.name, s.nodes) for s in plan.stages] == [
        ("step.0", ("train",)),
        ("step.1", ("gen",)),
        ("step.2", ("old_logprob", "ref_logprob", "values", "reward")),
        ("step.3", ("token_reward",)),
        ("step.4", ("kl",)),
        ("step.5", ("adv",)),
        ("step.6", ("update_actor", "update_critic")),
    ]


def test_every_edge_is_local_on_the_local_target(plan_of: PlanOf) -> None:
    plan = plan_of("grpo.yaml", target="local")
    assert {e.dispatch for e in plan.edges} == {"local"}
    assert not any(e.group_aligned for e in plan.edges)


@pytest.mark.parametrize(("src", "dst", "dispatch", "aligned"), [
    ("train.input_ids", "gen.prompts", "split", False),   # prompts: no groups yet
    ("gen.responses", "old_logprob.responses", "reshard", True),  # gathered, split again
    ("gen.responses", "reward.responses", "gather", False),
    ("gen.index", "adv.index", "gather", False),
    ("reward.scores", "adv.scores", "local", False),       # both on the driver
    ("adv.advantages", "update_actor.advantages", "broadcast", False),  # an update: whole
])
def test_grpo_dispatch_on_ray(plan_of: PlanOf, src: str, dst: str, dispatch: str,
        aligned: bool) -> None:
    edge = plan_of("grpo.yaml", target="ray", nproc=2).edge(src, dst)
    assert (edge.dispatch, edge.group_aligned) == (dispatch, aligned)


def test_a_tensor_of_generated_groups_splits_group_aligned(plan_of: PlanOf, doc_of: DocOf,
        graph_of: GraphOf) -> None:
    """Critic values of GRPO samples (Bp*N rows, N = 4) computed on another pool: the
    reshard keeps each prompt's 4 samples on one worker; with N = 1 (PPO) it need not."""
    doc = doc_of("ppo")
    doc["dims"]["N"] = 4
    doc["dims"]["Bp"] = 4
    for update in ("update_actor", "update_critic"):
        doc["nodes"][update]["params"]["mini_batch_size"] = 8
    grouped = plan_of(graph_of(doc), target="ray", nproc=2)
    single = plan_of("ppo.yaml", target="ray", nproc=2)
    for plan, aligned in ((grouped, True), (single, False)):
        edge = plan.edge("gen.responses", "values.responses")
        assert (edge.dispatch, edge.group_aligned) == ("reshard", aligned)


SCALAR_PLUGIN = """
from flowgraph.contracts import TensorSpec
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.registry import KindSpec, PortSpec, register_kind

register_kind(KindSpec("fgtest_temperature", "custom", "A scalar.", source=__name__,
                       outputs=(PortSpec("t", TensorSpec("")),)))
register_kind(KindSpec("fgtest_scaled", "custom", "Log-probs at a temperature.",
                       inputs=(*BUILTIN_KINDS["logprob"].inputs, PortSpec("t", TensorSpec(""))),
                       outputs=(PortSpec("log_prob", TensorSpec("b T")),), model="required",
                       source=__name__))
"""


@pytest.fixture
def scalar_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A plugin module declaring a model-free kind with a scalar output and a model kind
    that takes it."""
    (tmp_path / "fgtest_scalar_plugin.py").write_text(SCALAR_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fgtest_scalar_plugin"
    for name in ("fgtest_temperature", "fgtest_scaled"):
        _DECLARED.pop(name, None)
    sys.modules.pop("fgtest_scalar_plugin", None)


def test_a_tensor_without_batch_axis_is_broadcast(plan_of: PlanOf, doc_of: DocOf,
        graph_of: GraphOf, scalar_plugin: str) -> None:
    doc = doc_of("grpo")
    doc["plugins"] = [scalar_plugin]
    doc["models"]["actor"]["trainable"] = False
    for name in ("reward", "adv", "update_actor", "old_logprob", "ref_logprob"):
        del doc["nodes"][name]
    seq = {p: f"gen.{p}" for p in ("prompts", "prompt_mask", "responses", "response_mask")}
    doc["nodes"]["temp"] = {"kind": "fgtest_temperature"}
    doc["nodes"]["lp"] = {"kind": "fgtest_scaled", "model": "actor",
                          "inputs": {**seq, "t": "temp.t"}}
    plan = plan_of(graph_of(doc), target="ray", nproc=2)
    assert plan.edge("temp.t", "lp.t").dispatch == "broadcast"
    assert plan.edge("gen.responses", "lp.responses").dispatch == "reshard"
    assert (plan.node("temp").pool, plan.node("lp").pool) == ("driver", "actor_rollout_ref")
