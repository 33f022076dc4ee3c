"""What an executor builds before the first step, from the plan: the graph's plugins
imported, the models its process hosts (loaded with the head the plan says),
their optimizers and LR schedules, tokenizers, and the data sources' datasets."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from flowgraph.errors import FlowgraphError
from flowgraph.ir import DataSpec, LoraSpec, ModelSpec, OptimizerSpec
from flowgraph.plan import ExecutionPlan, ModelPlacement
from flowgraph.registry import import_plugin
from flowgraph.runtime.context import Impl


def import_plugins(plan: ExecutionPlan) -> None:
    """The graph's plugin modules imported, each one's folder first on `sys.path` (what
    they register — a reward function, a policy loss — and the implementations the plan
    names are then found, in this process and in every worker)."""
    for plugin in plan.plugins:
        import_plugin(plugin.module, plan.plugin_paths)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a tensor dtype name (`flowgraph.choices.TENSOR_BYTES`)."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def load_model(spec: ModelSpec, placed: ModelPlacement, device: str, seed: int = 0
               ) -> torch.nn.Module:
    """`spec`'s weights as the plan places them: a causal LM (`head: lm`) or a backbone
    with a scalar head (`scalar`: critic, reward model), on `device`; LoRA adapters
    (`spec.lora`) injected, their init seeded by `seed`.

    The parameters an optimizer trains are in the dtype's master dtype, the rest in its
    compute dtype (`flowgraph.choices.Precision`): `bfloat16` loads a trained model in
    fp32, a frozen one (and a LoRA model's base) in bf16, the adapters in fp32. The
    compute dtype is written into the model's config (`config.dtype`), which is what a
    rollout engine is started in and receives the weights in (`compute_dtype`)."""
    from transformers import PreTrainedModel

    from flowgraph.nodes.models import load_model as load_lm
    from flowgraph.nodes.values import ValueModel

    precision = spec.precision
    master = torch_dtype(precision.master)
    kw: dict[str, Any] = {
        "dtype": torch_dtype(precision.params(spec.trainable and spec.lora is None)),
        "trainable": spec.trainable, "attn_implementation": spec.attn_implementation}
    model: torch.nn.Module = (ValueModel.from_pretrained(spec.path, **kw)
                              if placed.head == "scalar" else load_lm(spec.path, **kw))
    if spec.lora is not None:
        model = add_adapters(model, spec.lora, seed, spec.name)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(master)
    if spec.gradient_checkpointing and isinstance(model, PreTrainedModel):
        model.gradient_checkpointing_enable()
    config = getattr(model, "config", None)
    if config is not None:
        config.dtype = torch_dtype(precision.compute)
    return model.to(device)


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype `model` computes in, and the one a rollout engine serves it in: what
    `load_model` wrote into its config (bf16 for `dtype: bfloat16` over fp32 masters),
    else its parameters' dtype."""
    dtype = getattr(getattr(model, "config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next(model.parameters()).dtype


def autocast(spec: ModelSpec | None, device: str) -> AbstractContextManager[Any]:
    """Where the nodes of `spec`'s model run: in its compute dtype over fp32 masters for a
    trained mixed-precision model (`dtype: bfloat16`), else as it is.

    torch.autocast (TRL's `bf16=True`, the simplest honest way on a whole model): the
    parameters stay fp32, so the optimizer, its state, the gradients and the checkpoint
    are fp32 as they are; matmuls and attention run in bf16 (each weight cast once per
    node call, kept while it runs), norms and softmax in fp32, and the gradient reaching
    each master is fp32. A sharded model also gets FSDP2's MixedPrecisionPolicy
    (`flowgraph.compilers.targets.process_groups.shard_model`: bf16 all-gathered units,
    fp32 gradient reduction); autocast there still covers the parts FSDP leaves whole (heads, tied
    embeddings)."""
    if spec is None or not spec.trainable or not spec.precision.mixed:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch_dtype(spec.precision.compute))


def lora_config(lora: LoraSpec) -> Any:
    """peft's `LoraConfig` of `models.<m>.lora`."""
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise FlowgraphError("`lora` needs the peft library: pip install 'flowgraph[lora]'"
                             ) from exc
    every = "all-linear" in lora.target_modules
    # peft types lora_alpha as int but scales by it as a number (alpha / r)
    alpha: Any = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return LoraConfig(r=lora.r, lora_alpha=alpha, lora_dropout=lora.dropout,
                      target_modules="all-linear" if every else list(lora.target_modules))


def add_adapters(model: torch.nn.Module, lora: LoraSpec, seed: int, name: str
                 ) -> torch.nn.Module:
    """`model` with LoRA adapters injected in place (peft), only they trainable. The model
    keeps its class, so nodes run it as any causal LM. A: peft's random init from a
    generator seeded by the run's seed and the model's name (the same on every target
    and worker, whatever else loaded first); B: zeros, so training starts at the base."""
    from peft import inject_adapter_in_model

    config = lora_config(lora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + zlib.crc32(name.encode()))
        try:
            inject_adapter_in_model(config, model)
        except ValueError as exc:  # no module matches target_modules
            raise FlowgraphError(f"models.{name}.lora ({lora.pos}): {exc}") from exc
    return model


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as its base: every LoRA layer's adapters off for the block (a frozen
    model placed as its base, `ModelPlacement.base_of`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    trained = [p for p in model.parameters() if p.requires_grad]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p in trained:  # as before: enable_adapters touches requires_grad
            p.requires_grad_(True)


def merged_parameters(model: torch.nn.Module, whole: Callable[[torch.Tensor], torch.Tensor]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under their Hugging Face names, each made whole by `whole`;
    a LoRA layer's weight merged (W + scale·B·A), its adapters not listed: what a rollout
    engine loads."""
    lora: dict[str, Any] = {name: m for name, m in model.named_modules()
                            if hasattr(m, "lora_A") and hasattr(m, "base_layer")}  # peft's
    for name, p in model.named_parameters():
        layer_name = next((n for n in lora if name.startswith(n + ".")), None)
        if layer_name is None:
            yield name, whole(p.detach())
            continue
        leaf = name.removeprefix(f"{layer_name}.base_layer.")
        if leaf == name:
            continue  # an adapter: merged into its layer's weight
        layer, weight = lora[layer_name], whole(p.detach())
        if leaf == "weight":
            for adapter in layer.active_adapters:
                a = whole(layer.lora_A[adapter].weight.detach())
                b = whole(layer.lora_B[adapter].weight.detach())
                weight = weight + layer.scaling[adapter] * (b @ a).to(weight.dtype)
        yield f"{layer_name}.{leaf}", weight


def make_optimizer(spec: ModelSpec, model: torch.nn.Module, total_steps: int
                   ) -> tuple[torch.optim.Optimizer, Any]:
    """The model's optimizer and its LR schedule (stepped once per training step)."""
    opt_spec = spec.optimizer or OptimizerSpec()
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer
    if opt_spec.name == "sgd":
        opt = torch.optim.SGD(params, lr=opt_spec.lr, weight_decay=opt_spec.weight_decay)
    else:
        cls = torch.optim.AdamW if opt_spec.name == "adamw" else torch.optim.Adam
        # One kernel per parameter instead of ~10 passes over all of them (TRL's default,
        # `adamw_torch_fused`): where every parameter is a plain float tensor on a CPU or
        # CUDA device. Not for FSDP's sharded parameters (DTensors): torch's fused kernel
        # refuses them next to its plain step counters; the two kernels differ by rounding.
        fused = ({p.device.type for p in params} <= {"cpu", "cuda"}
                 and all(p.is_floating_point() and not hasattr(p, "full_tensor")
                         for p in params))
        opt = cls(params, lr=opt_spec.lr, betas=opt_spec.betas, eps=opt_spec.eps,
                  weight_decay=opt_spec.weight_decay, fused=fused or None)
        # A checkpoint carries its writer's kernel in its param groups; a run resumed on
        # another target (local <-> fsdp) keeps the one chosen here.
        kernel = {key: opt.param_groups[0][key] for key in ("fused", "foreach")}

        def keep_kernel(loaded: torch.optim.Optimizer) -> None:
            for group in loaded.param_groups:
                group.update(kernel)

        opt.register_load_state_dict_post_hook(keep_kernel)
    if spec.offload is not None and spec.offload.optimizer and not spec.offload.params:
        park_state(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(opt_spec.warmup_steps, total_steps, opt_spec.schedule))
    return opt, sched


def park_state(opt: torch.optim.Optimizer) -> None:
    """`offload.optimizer` (verl's optimizer_offload): the optimizer's state in host
    memory between steps, moved to each parameter's device for the step and back after
    it. (With `offload.params` FSDP2 steps on the CPU and the state is there anyway.)
    The step counters stay where the optimizer keeps them."""
    def move(where: Callable[[torch.Tensor], torch.device | str]) -> Callable[..., None]:
        def hook(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            for p, state in optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        state[key] = value.to(where(p), non_blocking=True)
        return hook

    opt.register_step_pre_hook(move(lambda p: p.device))
    opt.register_step_post_hook(move(lambda p: "cpu"))


def lr_lambda(warmup: int, total: int, schedule: str) -> Callable[[int], float]:
    """The LR factor of training step i (the scheduler steps once per update node call).

    verl 0.9.1's `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup`
    (held to them in tests/compilers/test_local.py): i/w while i < w, then 1, or the
    half cosine over the remaining steps; `linear` decays to 0 as transformers'
    `get_linear_schedule_with_warmup` does (TRL's default). Linear and cosine equal
    transformers' own bit for bit, through a resume (tests/compilers/test_lr_schedule.py).
    """
    def factor(i: int) -> float:
        if i < warmup:
            return i / max(1, warmup)
        if schedule == "constant":
            return 1.0
        if schedule == "linear":  # transformers' expression, to the last bit
            return max(0.0, (total - i) / max(1, total - warmup))
        frac = (i - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * frac)))

    return factor


def load_tokenizers(models: tuple[ModelSpec, ...]) -> dict[str, Any]:
    """Every model's tokenizer (a model a node uses for its tokenizer only included)."""
    from flowgraph.nodes.models import load_tokenizer

    return {m.name: load_tokenizer(m.tokenizer or m.path) for m in models}


def _data_tokenizer(plan: ExecutionPlan, d: DataSpec, tokenizers: dict[str, Any]) -> Any:
    for node in plan.nodes:
        if node.model and any(i.ref[0] == d.name for i in node.inputs):
            return tokenizers[node.model]
    if not plan.models:
        raise FlowgraphError(f"data source `{d.name}` needs a tokenizer: declare a model")
    return tokenizers[plan.models[0].name]


def load_data(plan: ExecutionPlan, tokenizers: dict[str, Any]) -> dict[str, Any]:
    """Data source -> its `flowgraph.nodes.data.Splits`, tokenized and checked (lengths
    against P and T, the ground truth the graph's readers need) when it loads."""
    dims = {d.name: d.value for d in plan.dims}
    out = {}
    for d in plan.data:
        impl = Impl.at(plan.node(d.name).impl, f"data source `{d.name}`")
        params = {k: v for k, v in d.params.to_python().items() if k in impl.accepts}
        if "max_prompt_length" in impl.accepts:
            params.setdefault("max_prompt_length", dims.get("P"))
        if "max_response_length" in impl.accepts:
            params.setdefault("max_response_length", dims.get("T"))
        if "ground_truth_for" in impl.accepts:
            params["ground_truth_for"] = plan.readers(d.name, "ground_truth")
        if "loss_mask_read" in impl.accepts:
            params["loss_mask_read"] = bool(plan.readers(d.name, "loss_mask"))
        try:
            out[d.name] = impl.fn(d.path, tokenizer=_data_tokenizer(plan, d, tokenizers),
                                  seed=plan.trainer.seed, **params)
        except FlowgraphError as exc:  # the dataset's own words, then where the graph says it
            raise FlowgraphError(f"{exc} (data source `{d.name}` at {d.pos})") from exc
    return out


@dataclass
class Resources:
    """Everything loaded once per run."""

    models: dict[str, Any] = field(default_factory=dict)
    tokenizers: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    """Data source -> flowgraph.nodes.data.Splits."""
