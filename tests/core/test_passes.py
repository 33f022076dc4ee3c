"""The compile passes: dce, hoist, placement, schedule, memory, and the pipeline itself."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from flowgraph.errors import FlowgraphError, PlanError, UsageError
from flowgraph.frontend import graph_from_yaml
from flowgraph.ir import Graph
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.passes import PASSES, CompileResult, PassPipeline, Program, compile_graph
from flowgraph.passes.memory import (
    ModelConfig,
    count_parameters,
    layer_activation_bytes,
    read_config,
    training_activation_bytes,
)
from flowgraph.passes.placement import PlaceNodes
from flowgraph.plan import GIB, Bundle, ExecutionPlan, plan_summary, verify, verify_kinds
from flowgraph.registry import _DECLARED

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2}


def doc_of(name: str) -> dict[str, Any]:
    data = yaml.safe_load((GRAPHS / f"{name}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def graph_of(doc: dict[str, Any]) -> Graph:
    return graph_from_yaml(yaml.safe_dump(doc, sort_keys=False), "test.yaml")


SMALL = {
    "ppo.yaml": ("dims.Bp=16", "nodes.update_actor.params.mini_batch_size=8",
                 "nodes.update_critic.params.mini_batch_size=8"),
    "grpo.yaml": ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=8"),
}
SMALL["grpo_lora.yaml"] = SMALL["grpo.yaml"]
"""graphs/ppo.yaml and grpo.yaml at the small dims the numbers below are of (the shipped
graphs use larger batches, so that they learn), the test's own overrides after them."""


def small(file: str, overrides: Any = ()) -> list[str]:
    return [*SMALL.get(file, ()), *overrides]


def plan_of(file: str | Graph, **kw: Any) -> ExecutionPlan:
    if isinstance(file, str):
        kw["overrides"] = small(file, kw.get("overrides", ()))
    result = compile_graph(GRAPHS / file if isinstance(file, str) else file, **kw)
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


# --- dce -------------------------------------------------------------------------------------


def ppo_with_dead_nodes() -> Graph:
    """PPO plus a reward model whose score feeds only a token_reward nobody reads."""
    doc = doc_of("ppo")
    doc["models"]["rm"] = {"path": "builtin:tiny-lm"}
    seq = {p: f"gen.{p}" for p in ("prompts", "prompt_mask", "responses", "response_mask")}
    doc["nodes"]["dead_rm"] = {"kind": "reward_model", "model": "rm", "inputs": seq}
    doc["nodes"]["dead_tok"] = {"kind": "token_reward", "inputs": {
        "scores": "dead_rm.scores", "response_mask": "gen.response_mask"}}
    return graph_of(doc)


def test_dce_drops_a_dead_chain_transitively() -> None:
    plan = plan_of(ppo_with_dead_nodes(), target="ray", nproc=2)
    assert plan.dropped == ("dead_rm", "dead_tok")
    assert {"dead_rm", "dead_tok"}.isdisjoint(n.name for n in plan.nodes)
    assert not {"dead_rm", "dead_tok"} & {n.name for n in plan.nodes}
    # The reward model only the dead node used gets no pool (no `reward` pool at all).
    assert [p.name for p in plan.pools] == ["driver", "actor_rollout_ref", "critic"]


def test_dce_keeps_everything_without_a_sink() -> None:
    doc = doc_of("grpo")
    doc["models"]["actor"]["trainable"] = False
    for name in ("reward", "adv", "update_actor"):
        del doc["nodes"][name]
    result = compile_graph(graph_of(doc))
    assert result.plan is not None and result.plan.dropped == ()
    assert [n.name for n in result.plan.nodes] == ["train", "gen", "old_logprob", "ref_logprob"]
    assert not any(d.is_error for d in result.diagnostics)


def test_dce_keeps_the_example_graphs_whole() -> None:
    # RLOO's update takes one optimizer step per rollout: pass `on_policy` drops its
    # old-log-prob forward (tested below); nothing else in the examples is dead.
    for file in sorted(GRAPHS.glob("*.yaml")):
        dropped = plan_of(file.name).dropped
        assert dropped == (("old_logprob",) if file.name == "rloo.yaml" else ()), file


# --- on_policy -------------------------------------------------------------------------------

ONE_STEP = ["nodes.update_actor.params.mini_batch_size=null"]
"""GRPO's update on its whole batch in one optimizer step: π_old is the policy it starts from."""


@pytest.mark.parametrize(("overrides", "elided"), [
    (ONE_STEP, True),
    ([], False),  # mini_batch_size 8 of 16: two optimizer steps, the second off-policy
    ([*ONE_STEP, "nodes.update_actor.params.ppo_epochs=2"], False),
    ([*ONE_STEP, "nodes.update_actor.params.mini_batch_size=16"], True),  # = the batch
    ([*ONE_STEP, "nodes.old_logprob.params.temperature=0.7"], False),  # another distribution
])
def test_on_policy_elides_the_old_log_prob_forward_of_one_step_updates(
        overrides: list[str], elided: bool) -> None:
    plan = plan_of("grpo.yaml", overrides=overrides)
    update = plan.node("update_actor")
    assert ("old_log_prob" not in dict(update.wiring())) == elided
    assert ("old_logprob" in plan.dropped) == elided
    assert [r.split(":")[0] for r in plan.rewrites] == (["on_policy"] if elided else [])
    if elided:
        assert "rewritten: on_policy: `update_actor` takes one optimizer step" in plan_summary(plan)


def test_on_policy_keeps_a_forward_another_node_reads() -> None:
    # PPO's kl_penalty reads old_logprob.log_prob too: the forward runs anyway.
    plan = plan_of("ppo.yaml", overrides=["nodes.update_actor.params.mini_batch_size=null"])
    assert plan.rewrites == () and "old_logprob" not in plan.dropped


def test_on_policy_can_be_disabled_by_name() -> None:
    plan = plan_of("grpo.yaml", overrides=ONE_STEP,
                   pipeline=PassPipeline.default(disabled=("on_policy",)))
    assert plan.rewrites == () and "old_logprob" in {n.name for n in plan.nodes}


# --- hoist -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("graph", "hoisted"), [
    ("dpo", {"ref_chosen", "ref_rejected"}),
    ("ppo", set()),
    ("grpo", set()),
    ("rloo", set()),
    ("reinforce_pp", set()),
    ("remax", set()),
])
def test_hoisted_nodes(graph: str, hoisted: set[str]) -> None:
    plan = plan_of(f"{graph}.yaml")
    assert {n.name for n in plan.nodes if n.hoisted} == hoisted
    assert {n.name for n in plan.nodes if n.hoisted} == hoisted
    prologue = [s for s in plan.stages if s.once]
    assert [set(s.nodes) for s in prologue] == ([hoisted] if hoisted else [])


def test_dpo_reference_runs_in_the_prologue_before_the_loop() -> None:
    plan = plan_of("dpo.yaml")
    assert [(s.name, s.nodes, s.once) for s in plan.stages] == [
        ("prologue", ("ref_chosen", "ref_rejected"), True),
        ("step.0", ("pairs",), False),
        ("step.1", ("update",), False),
    ]


def test_a_trainable_model_is_not_invariant() -> None:
    doc = doc_of("dpo")
    doc["nodes"]["ref_chosen"]["model"] = "policy"
    plan = plan_of(graph_of(doc))
    assert {n.name for n in plan.nodes if n.hoisted} == {"ref_rejected"}


def grpo_with_repeated_ground_truth() -> Graph:
    """GRPO whose reward reads the data column repeated per sample (`repeat` of
    `train.ground_truth`: Bp rows in, Bp*N out) instead of the rollout's copy."""
    doc = doc_of("grpo")
    doc["dims"].update(Bp=4, N=4)
    doc["nodes"]["update_actor"]["params"]["mini_batch_size"] = 8
    doc["nodes"]["gt"] = {"kind": "repeat", "inputs": {"x": "train.ground_truth"}}
    doc["nodes"]["reward"]["inputs"]["ground_truth"] = "gt.x"
    return graph_of(doc)


def test_a_node_with_per_sample_output_is_not_hoisted() -> None:
    # The prologue keeps one row per data row (by uid); `gt.x` has N rows per data row.
    plan = plan_of(grpo_with_repeated_ground_truth())
    assert not plan.node("gt").hoisted
    assert not any(s.once for s in plan.stages)


SAMPLED_EVAL = ("nodes.gen.params.val_n=2", "nodes.gen.params.val_temperature=1.0")


@pytest.mark.parametrize(("overrides", "n"), [((), 1), (SAMPLED_EVAL, 2)])
def test_repeat_follows_the_samples_per_prompt_at_evaluation(overrides: tuple[str, ...],
                                                             n: int) -> None:
    # ReMax: `gen` samples N=4 per prompt in training, val_n at evaluation (greedy: 1);
    # the greedy baseline (`gen_greedy`, n 1) is repeated to match, N times, then n times.
    baseline = plan_of("remax.yaml", overrides=overrides).node("baseline")
    assert baseline.param_values()["n"] is None  # the global N
    assert baseline.param_values(evaluation=True)["n"] == n


def test_a_wrong_hoisted_mark_in_the_file_is_cleared() -> None:
    doc = doc_of("ppo")
    doc["nodes"]["adv"]["hoisted"] = True
    assert not plan_of(graph_of(doc)).node("adv").hoisted


# --- placement -------------------------------------------------------------------------------


def models_of(plan: ExecutionPlan, pool: str) -> list[tuple[str, str]]:
    return [(m.name, m.sharding) for m in plan.pool(pool).models]


def test_placement_local() -> None:
    plan = plan_of("ppo.yaml", target="local")
    (pool,) = plan.pools
    assert (pool.name, pool.size, pool.device, pool.bundles) == ("main", 1, "cpu", (Bundle(1, 0),))
    assert models_of(plan, "main") == [("actor", "none"), ("ref", "none"), ("critic", "none")]
    assert {(n.pool, n.data_parallel) for n in plan.nodes} == {("main", False)}


def test_placement_local_on_a_gpu() -> None:
    plan = plan_of("ppo.yaml", target="local", device="cuda")
    assert (plan.device, plan.pools[0].device, plan.pools[0].bundles) == (
        "cuda", "cuda:0", (Bundle(1, 1),))


def test_placement_fsdp() -> None:
    plan = plan_of("ppo.yaml", target="fsdp", nproc=2)
    (pool,) = plan.pools
    assert (pool.name, pool.size, pool.bundles) == ("spmd", 2, (Bundle(1, 0),) * 2)
    assert models_of(plan, "spmd") == [("actor", "full_shard"), ("ref", "full_shard"),
                                       ("critic", "full_shard")]
    dp = {n.name for n in plan.nodes if n.data_parallel}
    assert dp == {"gen", "old_logprob", "ref_logprob", "values", "update_actor", "update_critic"}


def test_placement_ray_infers_verl_pools() -> None:
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


def test_placement_ray_reward_model_pool_and_gpu_bundles() -> None:
    doc = doc_of("ppo")
    doc["models"]["rm"] = {"path": "builtin:tiny-lm"}
    seq = {p: f"gen.{p}" for p in ("prompts", "prompt_mask", "responses", "response_mask")}
    doc["nodes"]["reward"] = {"kind": "reward_model", "model": "rm", "inputs": seq}
    plan = plan_of(graph_of(doc), target="ray", nproc=2, device="cuda")
    assert models_of(plan, "reward") == [("rm", "full_shard")]
    assert plan.pool("reward").bundles == (Bundle(cpu=1, gpu=1),) * 2


def test_placement_can_keep_frozen_models_whole() -> None:
    passes = tuple(PlaceNodes(shard_frozen=False) if cls is PlaceNodes else cls()
                   for cls in PASSES.values())
    plan = plan_of("ppo.yaml", target="fsdp", nproc=2, pipeline=PassPipeline(passes))
    assert dict(models_of(plan, "spmd")) == {"actor": "full_shard", "ref": "none",
                                             "critic": "full_shard"}


def test_declared_pools_are_used_on_ray() -> None:
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
def test_declared_pools_are_checked(pools: dict[str, Any], message: str) -> None:
    doc = doc_of("ppo")
    doc["resources"] = {"pools": pools}
    result = compile_graph(graph_of(doc), target="ray")
    errors = [d for d in result.diagnostics if d.is_error]
    assert result.plan is None
    assert [(d.code, d.message) for d in errors] == [("FG403", message)]
    assert errors[0].pos is not None and errors[0].pos.line > 0


# --- schedule --------------------------------------------------------------------------------


def test_ppo_stages_are_topological_generations() -> None:
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


def test_every_edge_is_local_on_the_local_target() -> None:
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
def test_grpo_dispatch_on_ray(src: str, dst: str, dispatch: str, aligned: bool) -> None:
    edge = plan_of("grpo.yaml", target="ray", nproc=2).edge(src, dst)
    assert (edge.dispatch, edge.group_aligned) == (dispatch, aligned)


def test_a_tensor_of_generated_groups_splits_group_aligned() -> None:
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


def test_a_tensor_without_batch_axis_is_broadcast(scalar_plugin: str) -> None:
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


def test_the_plan_loads_each_model_with_the_head_its_kinds_declare() -> None:
    plan = plan_of("ppo.yaml", target="ray", nproc=2)
    heads = {m.name: (p.name, m.head) for p in plan.pools for m in p.models}
    assert heads == {"actor": ("actor_rollout_ref", "lm"), "ref": ("actor_rollout_ref", "lm"),
                     "critic": ("critic", "scalar")}
    loads = {n.name: n.loads_model for n in plan.nodes}
    assert loads["values"] and loads["gen"] and not loads["reward"]  # reward: tokenizer only


def test_a_plugin_critic_is_placed_and_loaded_like_the_built_in(critic_plugin: str) -> None:
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


# --- memory ----------------------------------------------------------------------------------


def test_parameter_count_of_tiny_lm() -> None:
    # V=512, h=128, i=256, L=2, 2 heads of 64, 2 kv heads, untied:
    #   embeddings 512*128 = 65,536
    #   per layer: q, k, v, o 4*128*128 = 65,536; gate, up, down 3*128*256 = 98,304;
    #              2 RMSNorms 256 -> 164,096; two layers 328,192
    #   final norm 128; lm_head 512*128 = 65,536
    #   total 65,536 + 328,192 + 128 + 65,536 = 459,392 (= LlamaForCausalLM's numel)
    cfg = read_config(graph_of(doc_of("ppo")).models[0])
    assert isinstance(cfg, ModelConfig)
    assert count_parameters(cfg) == 459_392
    # A critic swaps the LM head for a 128 -> 1 value head: 459,392 - 65,536 + 128.
    assert count_parameters(cfg, lm_head=False) == 393_984


def test_parameter_count_with_gqa_and_tied_embeddings() -> None:
    # h=256, 2 heads of 128, 1 kv head: q, o 2*256*256 = 131,072; k, v 2*256*128 = 65,536;
    # MLP 3*256*256 = 196,608; norms 512 -> 393,728 per layer, 787,456 for two;
    # embeddings 512*256 = 131,072; final norm 256; tied head 0 -> 918,784.
    cfg = ModelConfig.parse({**TINY, "hidden_size": 256, "num_key_value_heads": 1,
                             "tie_word_embeddings": True})
    assert isinstance(cfg, ModelConfig)
    assert count_parameters(cfg) == 918_784


def test_activation_formulas() -> None:
    cfg = ModelConfig.parse(TINY)
    assert isinstance(cfg, ModelConfig)
    # One layer, s=24, b=8, fp32 (d=4), SDPA, h=128, kv=2*64=128, i=256, bytes a token:
    # norms 2*128*(4+2*4) = 3,072, attention (3*128+2*128)*4 = 2,560, MLP 4*256*4 = 4,096;
    # 9,728 * 192 tokens = 1,867,776. Eager also keeps the fp32 softmax, a*s*4 = 192 a
    # token: 9,920 * 192 = 1,904,640.
    assert layer_activation_bytes(cfg, 8, 24, 4) == 1_867_776
    assert layer_activation_bytes(cfg, 8, 24, 4, "eager") == 1_904_640
    assert training_activation_bytes(cfg, 8, 24, 4, checkpointing=False) == 2 * 1_867_776
    # Checkpointing: the layer inputs L*s*b*h*4 = 2*24*8*128*4 = 196,608, plus one layer.
    assert training_activation_bytes(cfg, 8, 24, 4, checkpointing=True) == 196_608 + 1_867_776


def test_bf16_layers_keep_the_rmsnorm_fp32_upcast_and_the_eager_softmax_in_fp32() -> None:
    cfg = ModelConfig.parse(TINY)
    assert isinstance(cfg, ModelConfig)
    # bf16 (d=2), a token: norms 2*128*(4+2*2) = 2,048 (the fp32 upcast of each norm's
    # input, 4 bytes, and two bf16 tensors), attention (3*128+2*128)*2 = 1,280, MLP
    # 4*256*2 = 2,048: 5,376 * 192 tokens = 1,032,192. Eager: the fp32 softmax and its
    # bf16 cast, a*s*(4+2) = 288 a token: 5,664 * 192 = 1,087,488.
    assert layer_activation_bytes(cfg, 8, 24, 2) == 1_032_192
    assert layer_activation_bytes(cfg, 8, 24, 2, "eager") == 1_087_488


def test_memory_of_ppo_on_local() -> None:
    # Persistent, fp32: actor 459,392 * (4 weights + 4 grads + 8 AdamW) = 7,350,272;
    # ref 459,392 * 4 = 1,837,568; critic (value head) 393,984 * 16 = 6,303,744.
    # Peak node: old_logprob over the whole batch of 16 (s = 24, SDPA): one layer
    # 24*16*9,728 = 3,735,552 (test_activation_formulas) plus logits min(1024, 16*8)*512*4
    # = 262,144; update_actor (micro 8: 2 layers of 24*8*9,728 = 3,735,552, plus a 64-token
    # chunk of logits and its gradient 2*64*512*4 = 262,144) ties with it, and the first in
    # plan order is named.
    (mem,) = plan_of("ppo.yaml", target="local").memory
    assert mem.pool == "main" and mem.peak_node == "old_logprob"
    assert mem.total_bytes == 7_350_272 + 1_837_568 + 6_303_744 + 3_735_552 + 262_144
    assert mem.missing == ()


def test_a_token_budget_is_estimated_as_the_full_length_rows_it_holds() -> None:
    """max_token_len 48 holds two rows of P + T = 24: estimated as micro_batch_size 2."""
    nodes = ("old_logprob", "ref_logprob", "values", "update_actor", "update_critic")

    def memory(param: str, value: int) -> tuple[int, str]:
        (mem,) = plan_of("ppo.yaml", target="local", overrides=[
            f"nodes.{n}.params.{param}={value}" for n in nodes]).memory
        return mem.total_bytes, mem.peak_node

    assert memory("max_token_len", 48) == memory("micro_batch_size", 2)
    assert memory("max_token_len", 48)[0] < plan_of("ppo.yaml").memory[0].total_bytes


@pytest.mark.parametrize(("overrides", "disabled", "packed"), [
    # the actor's attention is varlen: its log-prob and update forwards are packed
    (("models.actor.attn_implementation=flash_attention_2",), (), {"old_logprob", "update_actor"}),
    # a node that sets packing keeps its choice
    (("models.actor.attn_implementation=flash_attention_2",
      "nodes.update_actor.params.packing=false"), (), {"old_logprob"}),
    (("models.actor.attn_implementation=flash_attention_2",), ("packing",), set()),
    ((), (), set()),  # SDPA: one N x N mask would cost more than the padding
])
def test_packing_is_set_where_the_attention_is_varlen(
        overrides: tuple[str, ...], disabled: tuple[str, ...], packed: set[str]) -> None:
    result = compile_graph(GRAPHS / "ppo.yaml", overrides=overrides,
                           pipeline=PassPipeline.default(disabled=disabled))
    assert result.plan is not None and result.program is not None
    got = {n.name for n in result.program.graph.nodes if n.params.get("packing") is True}
    assert got == packed
    rewritten = [r for r in result.plan.rewrites if r.startswith("packing")]
    assert [r.split("`")[1] for r in rewritten] == sorted(packed, key=["old_logprob",
                                                                       "update_actor"].index)
    if packed:
        assert rewritten[0] == ("packing: `old_logprob` runs its forwards as one row of valid "
                                "tokens (flash_attention_2 on `actor` attends within each "
                                "sequence)")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_node_is_estimated_as_one_row_of_its_tokens(attention: str) -> None:
    """The per-token terms do not change; eager's scores span the whole packed row
    (m*s)^2 instead of m x s^2, so only there does the estimate grow."""
    def memory(*overrides: str) -> int:
        (mem,) = plan_of("ppo.yaml", target="local", overrides=[
            f"models.actor.attn_implementation={attention}", *overrides]).memory
        return next(i.bytes for i in mem.items if i.what == "activations"
                    and i.owner == "update_actor")

    padded, packed = memory(), memory("nodes.update_actor.params.packing=true")
    assert (packed > padded) if attention == "eager" else (packed == padded)


@pytest.mark.parametrize(("overrides", "disabled", "fused"), [
    ((), (), ("ref_rejected",)),
    ((), ("fusion",), ()),
    (("nodes.ref_rejected.params.chunk_size=512",), (), ()),  # other params: apart
    # two nodes of one kind on one model, but one reads the chosen side's prompts from
    # another producer: they would not run at the same point of the plan
])
def test_fusion_groups_forwards_of_one_model_over_one_batch(
        overrides: tuple[str, ...], disabled: tuple[str, ...], fused: tuple[str, ...]) -> None:
    result = compile_graph(GRAPHS / "dpo.yaml", overrides=overrides,
                           pipeline=PassPipeline.default(disabled=disabled))
    assert result.plan is not None
    assert result.plan.node("ref_chosen").fused == fused
    assert result.plan.node("ref_rejected").fused == ()
    rewritten = [r for r in result.plan.rewrites if r.startswith("fusion")]
    assert rewritten == ([] if not fused else [
        "fusion: `ref_chosen`, `ref_rejected` run as one forward of model `ref` (kind "
        "sequence_logprob), their rows stacked"])
    summary = plan_summary(result.plan)
    assert ("fused      ref_chosen + ref_rejected: one forward" in summary) == bool(fused)
    # the estimate counts the fused forward's 2 x Bp rows
    ref = next(i.bytes for m in result.plan.memory for i in m.items
               if i.what == "activations" and i.owner == "ref_chosen")
    apart = plan_of("dpo.yaml", pipeline=PassPipeline.default(disabled=("fusion",)))
    assert ref == (2 if fused else 1) * next(
        i.bytes for m in apart.memory for i in m.items
        if i.what == "activations" and i.owner == "ref_chosen")


def test_a_fused_node_of_another_kind_is_refused_in_a_plan() -> None:
    plan = plan_of("ppo.yaml")
    nodes = tuple(replace(n, fused=("values",)) if n.name == "ref_logprob" else n
                  for n in plan.nodes)
    with pytest.raises(PlanError, match=r"node `ref_logprob` fuses `values`, which is not a "
                                         r"later node of its stage with its kind, model"):
        verify(replace(plan, nodes=nodes))


def test_a_fused_node_whose_kind_is_not_row_wise_is_refused_with_the_kinds() -> None:
    """The executor resolves the kinds: a group on a kind whose rows cannot be stacked
    (here `sequence_logprob` redeclared as a `custom` kind) is refused before it runs."""
    plan = plan_of("dpo.yaml")
    kinds = {n.name: BUILTIN_KINDS[n.kind] for n in plan.nodes}
    kinds["ref_chosen"] = replace(kinds["ref_chosen"], category="custom")
    with pytest.raises(PlanError, match=r"node `ref_chosen` \(kind `sequence_logprob`\) fuses "
                                        r"`ref_rejected`, but its kind does not run its model "
                                        r"row by row"):
        verify_kinds(plan, kinds)


def test_memory_shards_state_over_the_pool() -> None:
    plan = plan_of("ppo.yaml", target="ray", nproc=2)
    weights = {(m.pool, i.owner): i.bytes for m in plan.memory for i in m.items
               if i.what == "weights"}
    # FSDP shards all but the heads (compilers/_dist.py): tiny-lm's 459,392 parameters less
    # its V*h = 512*128 = 65,536 LM head are halved, the head is whole on each worker:
    # (393,856 / 2 + 65,536) * 4 = 1,049,856; the critic's value head is h = 128:
    # (393,856 / 2 + 128) * 4 = 788,224.
    assert weights == {("actor_rollout_ref", "actor"): 1_049_856,
                       ("actor_rollout_ref", "ref"): 1_049_856,
                       ("critic", "critic"): 788_224}
    # A tied head's shared embedding stays whole too: (393,856 - 65,536) / 2 + 65,536.
    tied = plan_of("ppo.yaml", target="ray", nproc=2, overrides=[
        "models.actor.path=builtin:tiny-tied"])
    assert {i.bytes for m in tied.memory for i in m.items
            if (i.what, i.owner) == ("weights", "actor")} == {229_696 * 4}


def test_memory_over_the_declared_device_is_fg401() -> None:
    result = compile_graph(GRAPHS / "ppo.yaml", overrides=small("ppo.yaml",
                                                                ["resources.memory_gib=0.0001"]))
    (err,) = [d for d in result.diagnostics if d.is_error]
    need = 19_489_280 / GIB  # the total of test_memory_of_ppo_on_local
    assert result.plan is None and err.code == "FG401"
    assert err.message == (f"plan needs {need:.3g} GiB on each device of pool `main`, declared "
                           f"0.0001 GiB: over by {need - 0.0001:.3g} GiB")
    # Fixes, re-estimated: fsdp over 2 halves the 15,491,584 resident bytes but the heads
    # (test_memory_shards_state_over_the_pool: actor (393,856/2 + 65,536) * 16, ref that * 4,
    # critic (393,856/2 + 128) * 16: 8,402,176 left) and the batch (an update's
    # micro-batch too: each rank takes 8/2 of every global mini-batch of 8), saving
    # 7,089,408 + (3,997,696 - 1,998,848) bytes = 0.00846 GiB. Halving every
    # micro-batch leaves old_logprob at 1,867,776 + 131,072 = 1,998,848 as the peak:
    # saves 3,997,696 - 1,998,848 = 1,998,848 (0.00186 GiB).
    assert err.hint == (
        "compile with --target fsdp --nproc 2 (saves 0.00846 GiB); set params.micro_batch_size "
        "of old_logprob 16→8, ref_logprob 16→8, values 16→8, update_actor 8→4, update_critic "
        "8→4 (saves 0.00186 GiB); or declare resources.memory_gib >= 0.019")


def fg401_hint(file: str, *overrides: str, **kw: Any) -> str:
    result = compile_graph(GRAPHS / file, overrides=small(file, ["resources.memory_gib=0.001",
                                                             *overrides]),
                           **kw)
    (err,) = [d for d in result.diagnostics if d.code == "FG401"][:1]
    assert err.hint is not None
    return err.hint


def test_fg401_suggests_gradient_checkpointing_when_an_update_is_the_peak() -> None:
    # DPO's update runs chosen and rejected together (16 sequences): its 2 layers of
    # activations dwarf the reference nodes' one layer over 8, so checkpointing helps.
    assert "set models.policy.gradient_checkpointing: true (saves" in fg401_hint("dpo.yaml")


def test_fg401_suggests_more_workers_only_when_the_batch_still_splits() -> None:
    # PPO: 16 sequences, a (global) mini-batch of 8: 2 and 4 ranks fit, 16 would not
    # (FG301: the mini-batch does not split over 16 ranks).
    assert "use --nproc 1→2 (saves" in fg401_hint("ppo.yaml", target="ray", nproc=1)
    assert "use --nproc 2→4 (saves" in fg401_hint("ppo.yaml", target="ray", nproc=2)
    assert "--nproc" not in fg401_hint("ppo.yaml", target="ray", nproc=8)
    # DPO: 8 pairs, a mini-batch of 8 splits over 2 ranks; a mini-batch of 1 cannot.
    assert "--target fsdp --nproc 2" in fg401_hint("dpo.yaml")
    assert "--target fsdp" not in fg401_hint("dpo.yaml", "nodes.update.params.mini_batch_size=1")


def test_vllm_reserves_its_share_of_the_declared_device() -> None:
    plan = plan_of("grpo.yaml", overrides=["nodes.gen.params.backend=vllm",
                                           "nodes.gen.params.gpu_memory_utilization=0.3",
                                           "resources.memory_gib=80"])
    (item,) = [i for i in plan.memory[0].items if i.what == "vllm"]
    assert (item.owner, item.bytes, item.transient) == ("gen", int(0.3 * 80 * GIB), False)


def test_vllm_reserves_a_kv_cache_sized_for_the_rollout() -> None:
    # The engine's kv_cache_memory_bytes (compilers/vllm_engine.py asks for the same): 16 sequences
    # of P+T = 24 tokens in one 128-token block each, 2048 bytes a token (2 layers × K, V
    # × 2 KV heads × head_dim 64 × 4 bytes), × 1.25: 5 MiB; plus vLLM's copy of the
    # 459,392 fp32 weights.
    plan = plan_of("grpo.yaml", overrides=["nodes.gen.params.backend=vllm",
                                           "resources.memory_gib=80"])
    items = {i.what: i.bytes for i in plan.memory[0].items if i.owner == "gen"}
    assert items == {"kv_cache": 5 * 2**20, "vllm": 459_392 * 4}


@pytest.mark.parametrize("where", ["dir", "config"])
def test_model_config_from_a_directory_or_the_graph(tmp_path: Path, where: str) -> None:
    import json

    cfg = {**TINY, "vocab_size": 1000}
    doc = doc_of("grpo")
    if where == "dir":
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        doc["models"]["ref"] = {"path": str(tmp_path)}
    else:
        doc["models"]["ref"] = {"path": "org/some-model", "config": cfg}
    plan = plan_of(graph_of(doc))
    weights = {i.owner: i.bytes for i in plan.memory[0].items if i.what == "weights"}
    # 459,392 + 2 * (1000 - 512) * 128 more embedding and head parameters, fp32.
    assert weights["ref"] == (459_392 + 2 * 488 * 128) * 4


def test_no_config_is_a_warning_and_a_lower_bound() -> None:
    doc = doc_of("grpo")
    doc["models"]["ref"] = {"path": "Qwen/Qwen2.5-7B"}
    result = compile_graph(graph_of(doc))
    (warn,) = [d for d in result.diagnostics if d.code == "FG402"]
    assert warn.severity == "warning"
    assert warn.message.startswith("cannot estimate memory for model `ref`: ")
    assert result.plan is not None and result.plan.memory[0].missing == ("ref",)


# --- the pipeline ----------------------------------------------------------------------------


def test_describe_numbers_the_passes_and_marks_disabled_ones() -> None:
    text = PassPipeline.default(disabled=("hoist",)).describe()
    lines = text.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["1.", "validate"], ["2.", "infer_dims"], ["3.", "asynchronous"], ["4.", "on_policy"],
        ["5.", "token_budget"], ["6.", "packing"], ["7.", "dce"], ["8.", "hoist"],
        ["9.", "fusion"], ["10.", "placement"], ["11.", "schedule"], ["12.", "memory"]]
    assert [line.endswith("[disabled]") for line in lines] == [
        False, False, False, False, False, False, False, True, False, False, False, False]


@pytest.mark.parametrize(("disabled", "message"), [
    (("hoisting",), "unknown pass `hoisting`; the passes are: validate, infer_dims, asynchronous, "
                    "on_policy, "
                    "token_budget, packing, dce, hoist, fusion, placement, schedule, memory"),
    (("validate",), "pass `validate` cannot be disabled: the plan is built from its result"),
    (("schedule",), "pass `schedule` cannot be disabled: the plan is built from its result"),
    (("infer_dims",), "pass `infer_dims` cannot be disabled while `memory` runs: `memory` reads "
                      "its result (disable `memory` too)"),
])
def test_disabling_a_pass_wrongly_is_a_usage_error(disabled: tuple[str, ...], message: str
                                                   ) -> None:
    with pytest.raises(UsageError) as exc:
        PassPipeline.default(disabled=disabled)
    assert str(exc.value) == message


def test_disabling_hoist_changes_the_plan() -> None:
    plan = plan_of("dpo.yaml", pipeline=PassPipeline.default(disabled=("hoist",)))
    assert not any(n.hoisted for n in plan.nodes)
    assert [s.name for s in plan.stages] == ["step.0", "step.1", "step.2"]
    assert plan.stages[1].nodes == ("ref_chosen", "ref_rejected")


def test_disabling_memory_and_infer_dims_gives_a_plan_without_them() -> None:
    plan = plan_of("ppo.yaml", pipeline=PassPipeline.default(disabled=("memory", "infer_dims")))
    assert plan.memory == () and plan.dims == ()
    assert {i.shape for n in plan.nodes for i in n.inputs} == {""}


def test_dump_after_writes_the_graph_as_yaml() -> None:
    out = io.StringIO()
    compile_graph(ppo_with_dead_nodes(), dump_after=("dce",), dump=out)
    text = out.getvalue()
    assert text.startswith("# --- after pass `dce` ---\n")
    dumped = yaml.safe_load(text)
    assert "dead_rm" not in dumped["nodes"] and "update_critic" in dumped["nodes"]
    assert "# dropped: dead_rm, dead_tok\n" in text


def test_dump_after_placement_shows_the_pools() -> None:
    out = io.StringIO()
    compile_graph(GRAPHS / "ppo.yaml", target="ray", nproc=2, dump_after=("placement",), dump=out)
    assert "# pool critic: 2 x cpu, models critic (full_shard)\n" in out.getvalue()
    assert "# node values -> critic (data-parallel)\n" in out.getvalue()


@dataclass(frozen=True, slots=True)
class Broken:
    """Fails."""

    name: ClassVar[str] = "broken"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        raise KeyError("boom")


def test_a_failing_pass_is_named_with_the_passes_before_it() -> None:
    passes = (*(cls() for cls in list(PASSES.values())[:7]), Broken())
    with pytest.raises(FlowgraphError) as exc:
        compile_graph(GRAPHS / "ppo.yaml", pipeline=PassPipeline(passes))
    assert str(exc.value) == ("pass `broken` failed: KeyError: 'boom' (passes run before it: "
                              "validate, infer_dims, asynchronous, on_policy, token_budget, "
                              "packing, dce)")


def test_graph_errors_stop_the_pipeline_after_validate() -> None:
    result: CompileResult = compile_graph(GRAPHS / "dpo.yaml", nproc=3)
    assert result.plan is None and [d.code for d in result.diagnostics] == ["FG301"]
    assert result.program is not None and result.program.placement is None


@pytest.mark.parametrize(("kw", "message"), [
    ({"target": "slurm"}, "unknown target `slurm`; the targets are: local, fsdp, ray"),
    ({"nproc": 0}, "nproc must be >= 1, got 0"),
    ({"dump_after": ("nope",)}, "--dump-after `nope`: no such pass; the passes are: validate, "
                                "infer_dims, asynchronous, on_policy, token_budget, packing, "
                                "dce, hoist, fusion, "
                                "placement, "
                                "schedule, memory"),
])
def test_wrong_calls_are_usage_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError) as exc:
        compile_graph(GRAPHS / "ppo.yaml", **kw)
    assert str(exc.value) == message


QWEN_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4}


@pytest.mark.parametrize(("attention", "gib"), [("sdpa", 74.48), ("eager", 239.86)])
def test_activations_of_qwen2_5_7b_follow_the_attention_implementation(attention: str,
                                                                      gib: float) -> None:
    from flowgraph.passes.memory import ModelConfig, training_activation_bytes

    cfg = ModelConfig.parse(QWEN_7B)
    assert isinstance(cfg, ModelConfig)
    # bf16, s = P+T = 3072, micro-batch 4, 28 layers. SDPA / flash keep O(s) per layer,
    # a token 2h(4+4) + (3h + 2kv + 4i)·2 = 57,344 + (10,752 + 1,024 + 75,776)·2 = 232,448
    # bytes (h 3584, kv 4·128, i 18944), × 3072 · 4 tokens = 2,856,321,024 a layer, × 28
    # = 74.48 GiB. Eager keeps the fp32 softmax and its bf16 cast too: + a·s·6 = 516,096
    # bytes a token, 239.86 GiB in all.
    act = training_activation_bytes(cfg, 4, 3072, 2, checkpointing=False, attention=attention)
    assert act / GIB == pytest.approx(gib, abs=0.005)


def test_a_qwen2_5_7b_grpo_that_fits_is_not_refused() -> None:
    # 8 ranks of 80 GiB: the actor's fp32 masters, grads and Adam's moments (`bfloat16`:
    # bf16 compute over fp32 state) sharded 8 ways ((4+4+8) × 7.6e9 / 8 ≈ 14.2 GiB), the
    # bf16 reference (≈ 1.8 GiB) plus micro-batch 2's 37.24 GiB of activations (half the
    # 74.48 GiB above) fit; with eager's scores (119.93 GiB) they do not.
    doc = doc_of("grpo")
    for name in ("actor", "ref"):
        doc["models"][name] = {**doc["models"][name], "path": "org/qwen2.5-7b",
                               "dtype": "bfloat16", "config": QWEN_7B}
    doc["dims"] = {"Bp": 8, "N": 4, "P": 1024, "T": 2048}
    doc["resources"] = {**doc.get("resources", {}), "memory_gib": 80}
    doc["nodes"]["update_actor"]["params"] = {**doc["nodes"]["update_actor"].get("params", {}),
                                              "mini_batch_size": 32, "micro_batch_size": 2}
    result = compile_graph(graph_of(doc), target="fsdp", nproc=8)
    assert [d.code for d in result.diagnostics if d.is_error] == []
    eager = graph_of(doc)
    eager = replace(eager, models=tuple(replace(m, attn_implementation="eager")
                                         for m in eager.models))
    refused = compile_graph(eager, target="fsdp", nproc=8)
    assert "FG401" in [d.code for d in refused.diagnostics if d.is_error]


def test_the_memory_benchmark_counts_each_storage_once_while_it_lives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_memory import LiveBytes

    with LiveBytes(known=set()) as mode:
        x = torch.ones(1000)  # 4,000 bytes
        view = x[:10].view(2, 5)  # the same storage: counted once
        y = x * 2  # 4,000 more
        del x
        assert mode.live == 8_000  # x's storage lives on in `view`
        del view, y
    assert (mode.live, mode.peak) == (0, 8_000)
