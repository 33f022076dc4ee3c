"""graphs/grpo_lora.yaml: GRPO training peft LoRA adapters on the actor. Only the
adapters train and are checkpointed, the reference runs as the actor's base (no second
copy), the memory estimate counts the adapters, a resumed run gives the uninterrupted
numbers, the export is the merged model or the adapter alone (both load with
transformers / peft and give the trained policy's logits), and fsdp(2) and ray(2) give
the local numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flowgraph.plan import plan_summary
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "graphs" / "grpo_lora.yaml"
SHORT = ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=8",
         "trainer.val_before_train=false", "trainer.steps=5", "trainer.checkpoint_every=2",
         "trainer.eval_every=0")
"""The compared runs: small batches (two optimizer steps a rollout), 5 steps,
checkpoints after steps 1, 3 and 4."""


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory, local_run: Any
          ) -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path_factory.mktemp("lora") / "local"
    return run_dir, local_run(GRAPH, run_dir, *SHORT)


@pytest.mark.parametrize("target", ["local", "fsdp", "ray"])
def test_the_reference_is_the_actors_base_and_memory_counts_adapters(
        tmp_path: Path, target: str, compile_plan: Any) -> None:
    plan = compile_plan(GRAPH, tmp_path, target=target)
    placed = {m.name: (p.name, m) for p in plan.pools for m in p.models}
    assert placed["ref"][1].base_of == "actor" and placed["ref"][0] == placed["actor"][0]
    assert "the base of `actor`, its adapters off" in plan_summary(plan)
    items = {(i.what, i.owner): i.bytes for p in plan.memory for i in p.items}
    assert ("weights", "ref") not in items  # no second copy
    # rank 8 on the 7 linear layers of 2 blocks (h 128, intermediate 256, 2 heads of 64,
    # 2 KV heads): 2 * 8 * (4 * 256 + 3 * 384) = 34816 adapter parameters, float32,
    # sharded over the workers where the plan shards the actor
    shards = 1 if target == "local" else 2
    assert items[("grads", "actor")] == 34816 * 4 // shards
    full = compile_plan(ROOT / "graphs" / "grpo.yaml", tmp_path, target=target)
    grads = {i.owner: i.bytes for p in full.memory for i in p.items if i.what == "grads"}
    assert grads["actor"] > 10 * items[("grads", "actor")]
    assert ("weights", "ref") in {(i.what, i.owner) for p in full.memory for i in p.items}


def test_only_adapters_train_and_are_checkpointed(
        local: tuple[Path, list[dict[str, Any]]]) -> None:
    run_dir, rows = local
    weights = load_file(run_dir / "checkpoints" / "step_4" / "model.actor.safetensors")
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), list(weights)
    assert sum(v.numel() for v in weights.values()) == 34816
    assert any(v.abs().sum() > 0 for k, v in weights.items() if ".lora_B." in k)
    # the reference is the base: the actor drifts from it once the adapters move
    kl = [r["actor/kl_loss"] for r in rows]
    assert kl[0] == 0.0 and kl[-1] > 0.0, kl


def test_a_resumed_run_gives_the_uninterrupted_numbers(
        local: tuple[Path, list[dict[str, Any]]], tmp_path: Path, local_run: Any) -> None:
    local_run(GRAPH, tmp_path / "run", *SHORT, "trainer.steps=2")
    rows = local_run(GRAPH, tmp_path / "run", *SHORT, resume=True)
    assert_same_numbers(rows, local[1], rel=0, abs_floor=0)


def test_export_merged_and_adapter_only(
        local: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Both exports give the trained policy: the base with the checkpoint's adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flowgraph.compilers.build import add_adapters
    from flowgraph.compilers.checkpoint.store import TrainedPart
    from flowgraph.compilers.export import export_model
    from flowgraph.errors import FlowgraphError
    from flowgraph.ir import LoraSpec
    from flowgraph.nodes.models import load_model

    run_dir = local[0]
    trained = add_adapters(load_model("builtin:tiny-lm-sft"), LoraSpec(), 0, "actor")
    TrainedPart(trained).load_state_dict(
        load_file(run_dir / "checkpoints" / "step_4" / "model.actor.safetensors"))
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    want = trained(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(
        export_model(run_dir, "actor", tmp_path / "merged"))
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    adapter = export_model(run_dir, "actor", tmp_path / "adapter", adapter_only=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in adapter.iterdir()}
    peft = PeftModel.from_pretrained(load_model("builtin:tiny-lm-sft"), str(adapter))
    torch.testing.assert_close(peft(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    base = load_model("builtin:tiny-lm-sft")(input_ids=ids).logits
    assert not torch.allclose(base, want, atol=1e-4)  # the adapters changed something
    with pytest.raises(FlowgraphError, match="model `ref` is frozen"):
        export_model(run_dir, "ref", tmp_path / "ref")


def test_adapters_off_runs_the_base_and_keeps_training_state() -> None:
    from flowgraph.compilers.build import adapters_off, add_adapters
    from flowgraph.ir import LoraSpec
    from flowgraph.nodes.models import load_model

    base = load_model("builtin:tiny-lm")
    model = add_adapters(load_model("builtin:tiny-lm", trainable=True),
                         LoraSpec(r=4, target_modules=("q_proj", "down_proj")), 0, "actor")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    ids = torch.tensor([[1, 2, 3, 4]])
    with adapters_off(model):
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits)
    assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trained


def _same_exports(run_dir: Path, local_dir: Path, tmp_path: Path) -> None:
    """A distributed run's checkpoint (DCP shards of the adapters alone) exports, merged
    and adapter-only, to the local run's policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flowgraph.compilers.export import export_model
    from flowgraph.nodes.models import load_model

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    want = AutoModelForCausalLM.from_pretrained(
        export_model(local_dir, "actor", tmp_path / "want"))(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(
        export_model(run_dir, "actor", tmp_path / "merged"))
    torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
    adapter = export_model(run_dir, "actor", tmp_path / "adapter", adapter_only=True)
    peft = PeftModel.from_pretrained(load_model("builtin:tiny-lm-sft"), str(adapter))
    torch.testing.assert_close(peft(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp_gives_the_numbers_of_the_local_run(
        local: tuple[Path, list[dict[str, Any]]], tmp_path: Path, local_run: Any) -> None:
    assert_same_numbers(local_run(GRAPH, tmp_path / "fsdp", *SHORT, target="fsdp"), local[1])
    _same_exports(tmp_path / "fsdp", local[0], tmp_path)


@pytest.mark.multiprocess
def test_ray_gives_the_numbers_of_the_local_run(
        local: tuple[Path, list[dict[str, Any]]], tmp_path: Path, local_run: Any) -> None:
    assert_same_numbers(local_run(GRAPH, tmp_path / "ray", *SHORT, target="ray"), local[1])
    _same_exports(tmp_path / "ray", local[0], tmp_path)
