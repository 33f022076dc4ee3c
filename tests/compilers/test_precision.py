"""`models.<m>.dtype` as it runs: `bfloat16` on a trained model is bf16 compute over fp32
masters (fp32 parameters, gradients, optimizer state and checkpoint; the frozen reference
plain bf16), `pure_bf16` the old all-bf16 training; the weights a rollout engine receives;
CPU offload on a sharded model (one fsdp(2) run)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.compilers.build import compute_dtype, load_model
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.compilers.targets.local import LocalTarget
from flowgraph.compilers.worker import ExecOptions
from flowgraph.ir import LoraSpec, ModelSpec
from flowgraph.passes import compile_graph
from flowgraph.plan import ModelPlacement

ROOT = Path(__file__).resolve().parents[2]
DPO = ROOT / "graphs" / "dpo.yaml"
STEPS = 3


@dataclass
class Trained:
    target: LocalTarget
    rows: list[dict[str, Any]]
    start: dict[str, torch.Tensor]
    """The policy's parameters before the first step, in fp32."""
    seen: set[torch.dtype]
    """The dtypes the policy's q_proj computed in during the update."""


def _train(run_dir: Path, dtype: str) -> Trained:
    """dpo.yaml on the local target for STEPS steps, the policy in `dtype`, the frozen
    reference in bf16 (fp32 with the fp32 policy); a checkpoint at the end."""
    ref = "float32" if dtype == "float32" else "bfloat16"
    result = compile_graph(DPO, overrides=[
        f"trainer.run_dir={run_dir}", f"trainer.steps={STEPS}", "trainer.eval_every=0",
        f"models.policy.dtype={dtype}", f"models.ref.dtype={ref}"])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    with open(os.devnull, "w") as out:
        opts = ExecOptions(run_dir, "cpu", out=out, tensorboard=False)
        target = LocalTarget(result.plan, opts)
        loop = TrainingLoop(result.plan, target, opts)
        loop.setup()
        policy = target.worker.models["policy"]
        start = {n: p.detach().float().clone() for n, p in policy.named_parameters()}
        seen: set[torch.dtype] = set()
        q_proj = policy.model.layers[0].self_attn.q_proj
        hook = q_proj.register_forward_hook(
            lambda m, i, o: seen.add(o.dtype) if torch.is_grad_enabled() else None)
        loop.run()
        hook.remove()
    return Trained(target, read_metrics(run_dir), start, seen)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    root = tmp_path_factory.mktemp("precision")
    return {d: _train(root / d, d) for d in ("float32", "bfloat16", "pure_bf16")}


def _state_dtypes(opt: torch.optim.Optimizer) -> set[torch.dtype]:
    return {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}


def test_bf16_trains_fp32_masters_computes_in_bf16_and_checkpoints_them(
        trained: dict[str, Trained], tmp_path: Path) -> None:
    run = trained["bfloat16"]
    w = run.target.worker
    policy, ref = w.models["policy"], w.models["ref"]
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}  # frozen: plain bf16
    assert _state_dtypes(w.optimizers["policy"]) == {torch.float32}
    assert run.seen == {torch.bfloat16}  # the update's forward ran in bf16
    # The checkpoint holds the masters: a fresh fp32 model loads them bit for bit, values
    # that bf16 could not hold among them.
    fresh = LocalTarget(run.target.worker.plan, ExecOptions(tmp_path, "cpu"))
    fresh.start()
    fresh.load(run_dir_checkpoint(run))
    saved = dict(fresh.worker.models["policy"].named_parameters())
    for name, p in policy.named_parameters():
        assert torch.equal(saved[name], p), name
    weight = policy.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(weight, weight.bfloat16().float())
    state = fresh.worker.optimizers["policy"].state
    assert _state_dtypes(fresh.worker.optimizers["policy"]) == {torch.float32} and state


def run_dir_checkpoint(run: Trained) -> Path:
    from flowgraph.compilers.checkpoint.store import latest_checkpoint

    found = latest_checkpoint(run.target.opts.run_dir)
    assert found is not None
    return found[1]


def test_bf16_learns_as_fp32_does(trained: dict[str, Trained]) -> None:
    """Each step's DPO loss within 2e-3 of the fp32 run's (measured: 1.2e-4 at step 0,
    the reference being bf16, then <= 2e-4), and the weights moved as far: the distance
    between the two trained policies under 10% of how far fp32 training moved them
    (measured: 5.6%; Adam turns bf16's noise in small gradients into whole steps)."""
    fp32, bf16 = trained["float32"], trained["bfloat16"]
    for a, b in zip(fp32.rows, bf16.rows, strict=True):
        assert abs(a["actor/dpo_loss"] - b["actor/dpo_loss"]) < 2e-3, (a, b)
    end32 = dict(fp32.target.worker.models["policy"].named_parameters())
    moved = gap = 0.0
    for name, p in bf16.target.worker.models["policy"].named_parameters():
        moved += (end32[name] - fp32.start[name]).square().sum().item()
        gap += (end32[name] - p).square().sum().item()
    assert moved > 0 and gap ** 0.5 < 0.1 * moved ** 0.5


def test_pure_bf16_is_bf16_everywhere(trained: dict[str, Trained]) -> None:
    run = trained["pure_bf16"]
    w = run.target.worker
    assert {p.dtype for p in w.models["policy"].parameters()} == {torch.bfloat16}
    assert _state_dtypes(w.optimizers["policy"]) == {torch.bfloat16}
    assert run.seen == {torch.bfloat16}
    assert abs(run.rows[-1]["actor/dpo_loss"] - trained["float32"].rows[-1]["actor/dpo_loss"]
               ) < 2e-2


class _Engine:
    """What `weight_sync.load` calls on a vLLM `LLM`, recorded."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, str]] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> None:
        if method == "flowgraph_reload_tensor":
            self.tensors.append((args[0], args[1]))

    def reset_prefix_cache(self) -> None:
        pass


@pytest.mark.parametrize(("dtype", "sent"), [("bfloat16", "bfloat16"),
                                             ("pure_bf16", "bfloat16"),
                                             ("float32", "float32")])
def test_the_rollout_engine_gets_the_compute_dtype(dtype: str, sent: str) -> None:
    from flowgraph.compilers.vllm import weight_sync

    spec = ModelSpec("actor", "builtin:tiny-lm", trainable=True, dtype=dtype)
    model = load_model(spec, ModelPlacement("actor", True, "none"), "cpu")
    engine = _Engine()
    weight_sync.load(engine, model)  # type: ignore[arg-type]
    assert engine.tensors and {d for _, d in engine.tensors} == {sent}
    assert compute_dtype(model) == getattr(torch, sent)  # the dtype the engine starts in


def test_a_bf16_lora_model_trains_fp32_adapters_over_a_bf16_base() -> None:
    spec = ModelSpec("actor", "builtin:tiny-lm", trainable=True, dtype="bfloat16",
                     lora=LoraSpec(r=4))
    model = load_model(spec, ModelPlacement("actor", True, "none"), "cpu")
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}


@pytest.mark.multiprocess
def test_fsdp_bf16_with_offload_keeps_fp32_masters_and_learns_as_local(
        trained: dict[str, Trained], tmp_path: Path) -> None:
    """fsdp(2): FSDP2's MixedPrecisionPolicy over fp32 shards, the shards, gradients and
    optimizer state offloaded (CPUOffloadPolicy; on a CPU machine a placement that
    changes nothing, but the path that runs). Its losses are the local bf16 run's within
    bf16 noise (the local run computes under autocast, this one in FSDP's bf16 units),
    and its checkpoint holds fp32 weights and fp32 Adam moments."""
    import torch.distributed.checkpoint as dcp

    from flowgraph.compilers.checkpoint.store import latest_checkpoint

    run_dir = tmp_path / "run"
    overrides = (f"trainer.run_dir={run_dir}", f"trainer.steps={STEPS}",
                 "trainer.eval_every=0", "models.policy.dtype=bfloat16",
                 "models.ref.dtype=bfloat16", "models.policy.offload.params=true")
    result = compile_graph(DPO, target="fsdp", nproc=2, overrides=list(overrides))
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    with open(os.devnull, "w") as out:
        run(result.plan, RunOptions(overrides=overrides, tensorboard=False, out=out))
    rows = read_metrics(run_dir)
    for a, b in zip(trained["bfloat16"].rows, rows, strict=True):
        assert abs(a["actor/dpo_loss"] - b["actor/dpo_loss"]) < 2e-3, (a, b)
    found = latest_checkpoint(run_dir)
    assert found is not None
    meta = dcp.FileSystemReader(str(found[1] / "dcp" / "policy")).read_metadata()
    dtypes = {(k.split(".")[0], v.properties.dtype)
              for k, v in meta.state_dict_metadata.items() if hasattr(v, "properties")}
    assert dtypes == {("model", torch.float32), ("optim", torch.float32)}
