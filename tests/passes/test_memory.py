"""Pass `memory` (flowgraph/passes/memory.py): parameter and activation counts, the estimate
per pool and FG401/FG402, and the benchmark that measures it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flowgraph.ir import Graph
from flowgraph.passes import compile_graph
from flowgraph.passes.memory import (
    ModelConfig,
    count_parameters,
    layer_activation_bytes,
    read_config,
    training_activation_bytes,
)
from flowgraph.plan import GIB, ExecutionPlan

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
DocOf = Callable[[str], dict[str, Any]]
GraphOf = Callable[[dict[str, Any]], Graph]
PlanOf = Callable[..., ExecutionPlan]
Small = Callable[..., list[str]]
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2}


def test_parameter_count_of_tiny_lm(doc_of: DocOf, graph_of: GraphOf) -> None:
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


def test_memory_of_ppo_on_local(plan_of: PlanOf) -> None:
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


def test_a_token_budget_is_estimated_as_the_full_length_rows_it_holds(plan_of: PlanOf) -> None:
    """max_token_len 48 holds two rows of P + T = 24: estimated as micro_batch_size 2."""
    nodes = ("old_logprob", "ref_logprob", "values", "update_actor", "update_critic")

    def memory(param: str, value: int) -> tuple[int, str]:
        (mem,) = plan_of("ppo.yaml", target="local", overrides=[
            f"nodes.{n}.params.{param}={value}" for n in nodes]).memory
        return mem.total_bytes, mem.peak_node

    assert memory("max_token_len", 48) == memory("micro_batch_size", 2)
    assert memory("max_token_len", 48)[0] < plan_of("ppo.yaml").memory[0].total_bytes


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_node_is_estimated_as_one_row_of_its_tokens(plan_of: PlanOf,
        attention: str) -> None:
    """The per-token terms do not change; eager's scores span the whole packed row
    (m*s)^2 instead of m x s^2, so only there does the estimate grow."""
    def memory(*overrides: str) -> int:
        (mem,) = plan_of("ppo.yaml", target="local", overrides=[
            f"models.actor.attn_implementation={attention}", *overrides]).memory
        return next(i.bytes for i in mem.items if i.what == "activations"
                    and i.owner == "update_actor")

    padded, packed = memory(), memory("nodes.update_actor.params.packing=true")
    assert (packed > padded) if attention == "eager" else (packed == padded)


def test_memory_shards_state_over_the_pool(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml", target="ray", nproc=2)
    weights = {(m.pool, i.owner): i.bytes for m in plan.memory for i in m.items
               if i.what == "weights"}
    # FSDP shards all but the heads (compilers/targets/process_groups.py): tiny-lm's 459,392
    # parameters less its V*h = 512*128 = 65,536 LM head are halved, the head is whole on each
    # worker:
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


def test_memory_over_the_declared_device_is_fg401(small: Small) -> None:
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


@pytest.fixture
def fg401_hint(small: Small) -> Callable[..., str]:
    """`fg401_hint(file, *overrides, **compile_graph_kw)`: FG401's hint at 0.001 GiB."""
    def hint(file: str, *overrides: str, **kw: Any) -> str:
        result = compile_graph(GRAPHS / file, overrides=small(file, [
            "resources.memory_gib=0.001", *overrides]), **kw)
        (err,) = [d for d in result.diagnostics if d.code == "FG401"][:1]
        assert err.hint is not None
        return err.hint

    return hint


def test_fg401_suggests_gradient_checkpointing_when_an_update_is_the_peak(
        fg401_hint: Callable[..., str]) -> None:
    # DPO's update runs chosen and rejected together (16 sequences): its 2 layers of
    # activations dwarf the reference nodes' one layer over 8, so checkpointing helps.
    assert "set models.policy.gradient_checkpointing: true (saves" in fg401_hint("dpo.yaml")


def test_fg401_suggests_more_workers_only_when_the_batch_still_splits(
        fg401_hint: Callable[..., str]) -> None:
    # PPO: 16 sequences, a (global) mini-batch of 8: 2 and 4 ranks fit, 16 would not
    # (FG301: the mini-batch does not split over 16 ranks).
    assert "use --nproc 1→2 (saves" in fg401_hint("ppo.yaml", target="ray", nproc=1)
    assert "use --nproc 2→4 (saves" in fg401_hint("ppo.yaml", target="ray", nproc=2)
    assert "--nproc" not in fg401_hint("ppo.yaml", target="ray", nproc=8)
    # DPO: 8 pairs, a mini-batch of 8 splits over 2 ranks; a mini-batch of 1 cannot.
    assert "--target fsdp --nproc 2" in fg401_hint("dpo.yaml")
    assert "--target fsdp" not in fg401_hint("dpo.yaml", "nodes.update.params.mini_batch_size=1")


def test_vllm_reserves_its_share_of_the_declared_device(plan_of: PlanOf) -> None:
    plan = plan_of("grpo.yaml", overrides=["nodes.gen.params.backend=vllm",
                                           "nodes.gen.params.gpu_memory_utilization=0.3",
                                           "resources.memory_gib=80"])
    (item,) = [i for i in plan.memory[0].items if i.what == "vllm"]
    assert (item.owner, item.bytes, item.transient) == ("gen", int(0.3 * 80 * GIB), False)


def test_vllm_reserves_a_kv_cache_sized_for_the_rollout(plan_of: PlanOf) -> None:
    # The engine's kv_cache_memory_bytes (compilers/vllm/engine.py asks for the same): 16 sequences
    # of P+T = 24 tokens in one 128-token block each, 2048 bytes a token (2 layers × K, V
    # × 2 KV heads × head_dim 64 × 4 bytes), × 1.25: 5 MiB; plus vLLM's copy of the
    # 459,392 fp32 weights.
    plan = plan_of("grpo.yaml", overrides=["nodes.gen.params.backend=vllm",
                                           "resources.memory_gib=80"])
    items = {i.what: i.bytes for i in plan.memory[0].items if i.owner == "gen"}
    assert items == {"kv_cache": 5 * 2**20, "vllm": 459_392 * 4}


@pytest.mark.parametrize("where", ["dir", "config"])
def test_model_config_from_a_directory_or_the_graph(plan_of: PlanOf, doc_of: DocOf,
        graph_of: GraphOf, tmp_path: Path, where: str) -> None:
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


def test_no_config_is_a_warning_and_a_lower_bound(doc_of: DocOf, graph_of: GraphOf) -> None:
    doc = doc_of("grpo")
    doc["models"]["ref"] = {"path": "Qwen/Qwen2.5-7B"}
    result = compile_graph(graph_of(doc))
    (warn,) = [d for d in result.diagnostics if d.code == "FG402"]
    assert warn.severity == "warning"
    assert warn.message.startswith("cannot estimate memory for model `ref`: ")
    assert result.plan is not None and result.plan.memory[0].missing == ("ref",)


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


def test_a_qwen2_5_7b_grpo_that_fits_is_not_refused(doc_of: DocOf, graph_of: GraphOf) -> None:
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
