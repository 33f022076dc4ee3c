"""Pass `placement` (flowgraph/passes/placement.py): pools, sharding and model heads for each
target."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flowgraph.ir import Graph
from flowgraph.passes import PASSES, PassPipeline, compile_graph
from flowgraph.passes.placement import PlaceNodes
from flowgraph.plan import Bundle, ExecutionPlan
from flowgraph.registry import _DECLARED

DocOf = Callable[[str], dict[str, Any]]
GraphOf = Callable[[dict[str, Any]], Graph]
PlanOf = Callable[..., ExecutionPlan]


def models_of(plan: ExecutionPlan, pool: str) -> list[tuple[str, str]]:
    return [(m.name, m.sharding) for m in plan.pool(pool).models]


def test_placement_local(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml", target="local")
    (pool,) = plan.pools
    assert (pool.name, pool.size, pool.device, pool.bundles) == ("main", 1, "cpu", (Bundle(1, 0),))
    assert models_of(plan, "main") == [("actor", "none"), ("ref", "none"), ("critic", "none")]
    assert {(n.pool, n.data_parallel) for n in plan.nodes} == {("main", False)}


def test_placement_local_on_a_gpu(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml", target="local", device="cuda")
    assert (plan.device, plan.pools[0].device, plan.pools[0].bundles) == (
        "cuda", "cuda:0", (Bundle(1, 1),))


def test_placement_fsdp(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml", target="fsdp", nproc=2)
    (pool,) = plan.pools
    assert (pool.name, pool.size, pool.bundles) == ("spmd", 2, (Bundle(1, 0),) * 2)
    assert models_of(plan, "spmd") == [("actor", "full_shard"), ("ref", "full_shard"),
                                       ("critic", "full_shard")]
    dp = {n.name for n in plan.nodes if n.data_parallel}
    assert dp == {"gen", "old_logprob", "ref_logprob", "values", "update_actor", "update_critic"}


def test_placement_ray_infers_verl_pools(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml", target="ray", nproc=2)
    assert [(p.name, p.size, len(p.bundles)) for p in plan.pools] == [
        ("driver", 1, 0), ("actor_rollout_ref", 2, 2), ("critic", 2, 2)]
    assert [m for m, _ in models_of(plan, "actor_rollout_ref")] == ["actor", "ref"]
    assert [m for m, _ in models_of(plan, "critic")] == ["critic"]
    pool_of = {n.name: n.pool for n in plan.nodes}
    assert {n for n, p in pool_of.items() if p == "driver"} == {
        "train", "reward", "token_reward", "kl", "adv"}
    assert pool_of["values"] == pool_of["update_critic"] == "critic"
    assert pool_of["gen"] == pool_of["ref_logprob"] == "actor_rollout_ref"


def test_placement_ray_reward_model_pool_and_gpu_bundles(plan_of: PlanOf, doc_of: DocOf,
        graph_of: GraphOf) -> None:
    doc = doc_of("ppo")
    doc["models"]["rm"] = {"path": "builtin:tiny-lm"}
    seq = {p: f"gen.{p}" for p in ("prompts", "prompt_mask", "responses", "response_mask")}
    doc["nodes"]["reward"] = {"kind": "reward_model", "model": "rm", "inputs": seq}
    plan = plan_of(graph_of(doc), target="ray", nproc=2, device="cuda")
    assert models_of(plan, "reward") == [("rm", "full_shard")]
    assert plan.pool("reward").bundles == (Bundle(cpu=1, gpu=1),) * 2


def test_placement_can_keep_frozen_models_whole(plan_of: PlanOf) -> None:
    passes = tuple(PlaceNodes(shard_frozen=False) if cls is PlaceNodes else cls()
                   for cls in PASSES.values())
    plan = plan_of("ppo.yaml", target="fsdp", nproc=2, pipeline=PassPipeline(passes))
    assert dict(models_of(plan, "spmd")) == {"actor": "full_shard", "ref": "none",
                                             "critic": "full_shard"}


def test_declared_pools_are_used_on_ray(plan_of: PlanOf, doc_of: DocOf, graph_of: GraphOf) -> None:
    doc = doc_of("ppo")
    doc["resources"] = {"nproc": 2, "pools": {"gpus": {"size": 4, "models": ["actor", "ref"]},
                                              "small": {"size": 1, "models": ["critic"]}}}
    plan = plan_of(graph_of(doc), target="ray")
    assert [(p.name, p.size) for p in plan.pools] == [("driver", 1), ("gpus", 4), ("small", 1)]
    assert plan.node("values").pool == "small"
    assert plan.edge("gen.responses", "values.responses").dispatch == "reshard"


@pytest.mark.parametrize(("pools", "message"), [
    ({"driver": {"size": 1, "models": ["actor", "ref", "critic"]}},
     "pool name `driver` is reserved for the single controller"),
    ({"p": {"size": 0, "models": ["actor", "ref", "critic"]}}, "pool `p` has size 0"),
    ({"p": {"size": 1, "models": ["actor", "ref", "critic", "critc"]}},
     "pool `p` lists model `critc`, which is not declared under `models:`"),
    ({"p": {"size": 1, "models": ["actor", "ref", "critic"]}, "q": {"size": 1, "models": ["ref"]}},
     "model `ref` is in pools `p` and `q`"),
    ({"p": {"size": 1, "models": ["actor", "ref"]}},
     "model `critic` runs in node(s) values, update_critic but no pool in `resources.pools` "
     "lists it"),
])
def test_declared_pools_are_checked(doc_of: DocOf, graph_of: GraphOf, pools: dict[str, Any],
        message: str) -> None:
    doc = doc_of("ppo")
    doc["resources"] = {"pools": pools}
    result = compile_graph(graph_of(doc), target="ray")
    errors = [d for d in result.diagnostics if d.is_error]
    assert result.plan is None
    assert [(d.code, d.message) for d in errors] == [("FG403", message)]
    assert errors[0].pos is not None and errors[0].pos.line > 0


# --- model heads (KindSpec.head) --------------------------------------------------------------

CRITIC_PLUGIN = """
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.registry import register_kind
from dataclasses import replace

register_kind(replace(BUILTIN_KINDS["values"], name="fgtest_values", source=__name__))
register_kind(replace(BUILTIN_KINDS["values"], name="fgtest_lm_values", head="lm",
                      source=__name__))
"""


@pytest.fixture
def critic_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A plugin kind that runs its model with a scalar head, as the built-in `values`."""
    (tmp_path / "fgtest_critic_plugin.py").write_text(CRITIC_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fgtest_critic_plugin"
    for name in ("fgtest_values", "fgtest_lm_values"):
        _DECLARED.pop(name, None)
    sys.modules.pop("fgtest_critic_plugin", None)


def test_the_plan_loads_each_model_with_the_head_its_kinds_declare(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml", target="ray", nproc=2)
    heads = {m.name: (p.name, m.head) for p in plan.pools for m in p.models}
    assert heads == {"actor": ("actor_rollout_ref", "lm"), "ref": ("actor_rollout_ref", "lm"),
                     "critic": ("critic", "scalar")}
    loads = {n.name: n.loads_model for n in plan.nodes}
    assert loads["values"] and loads["gen"] and not loads["reward"]  # reward: tokenizer only


def test_a_plugin_critic_is_placed_and_loaded_like_the_built_in(plan_of: PlanOf, doc_of: DocOf,
        graph_of: GraphOf, critic_plugin: str) -> None:
    doc = doc_of("ppo")
    doc["plugins"] = [critic_plugin]
    doc["nodes"]["values"]["kind"] = "fgtest_values"
    plan = plan_of(graph_of(doc), target="ray", nproc=2)
    assert {m.name: m.head for p in plan.pools if p.name == "critic" for m in p.models} == {
        "critic": "scalar"}
    doc["nodes"]["values"]["kind"] = "fgtest_lm_values"  # the same weights as an LM: no
    result = compile_graph(graph_of(doc))
    assert [d.code for d in result.diagnostics if d.is_error] == ["FG404"]
    assert "model `critic` runs as a " in result.diagnostics[0].message
