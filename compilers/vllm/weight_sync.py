"""Weight sync into a running vLLM engine, and its check (`flowgraph.compilers.vllm.engine`
says when they run).

`load` streams `model.named_parameters()` into the engine, one tensor per RPC, through
vLLM's layerwise in-place reload (`vllm.model_executor.model_loader.reload`, what
`Worker.reload_weights` runs): `initialize_layerwise_reload` puts every layer back in
checkpoint format, the model's own `load_weights` takes each tensor (fusing q/k/v and
gate/up as at load time) and re-runs a layer's post-load processing (on CPU: weight
prepacking for oneDNN) once all its tensors arrived, and `finalize_layerwise_reload`
finishes the rest. The three steps run in the engine's worker process through
`LLM.collective_rpc` and `WeightSyncExtension`, mixed into vLLM's worker with the engine
argument `worker_extension_cls`. The prefix cache holds keys and values computed with the
old weights, so it is reset afterwards. A LoRA model's layers are merged on the way
(W + scale·B·A); a sharded (FSDP2) parameter is made whole one at a time (a collective).
The engine gets the weights in the model's compute dtype (bf16 cast from the fp32 masters
of a `dtype: bfloat16` model). `fingerprint` says whether the weights changed since the
last sync (all-reduced sums: every worker agrees). `verify` compares the engine's
log-probs of a probe batch with the trainer's, so weights that did not arrive stop the
run instead of silently sampling another policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import Tensor, nn

from flowgraph.compilers.build import compute_dtype, merged_parameters
from flowgraph.errors import FlowgraphError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm import LLM
    from vllm.config import ModelConfig as VllmModelConfig
    from vllm.config import VllmConfig
    from vllm.logprobs import LogprobsOnePosition
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class _VllmModel(Protocol):
        """What every vLLM model class defines; its loader feeds it (name, tensor) pairs."""

        def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]: ...


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
    processing (on CPU: the weight packed for oneDNN). `verify` caught this."""
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


def whole(tensor: Tensor) -> Tensor:
    """A sharded (DTensor) value made whole on every worker (a collective); a plain
    tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def reshard(model: nn.Module) -> None:
    """Free the unsharded parameters FSDP keeps after a forward (the root module's, until
    the next backward), so `model.parameters()` are the sharded ones: a fingerprint
    taken in either state would differ, and a needless sync would follow. Local."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fingerprint(model: nn.Module) -> tuple[float, ...]:
    """Changes when a parameter is replaced, or modified in place, or its values change."""
    # The version counter catches in-place ops (optimizer.step, load_state_dict), but a
    # fused optimizer (`fused=True`) writes without bumping it: the float32 sums of the
    # parameters catch that, for one read of the weights. A sharded parameter's slice on
    # one worker may stay put while another's changes: it counts by its all-reduced sum
    # only, which every worker sees the same, so all of them sync or none does.
    params = [p.detach() for p in model.parameters()]
    sums = torch.stack([whole(p.sum(dtype=torch.float32)) for p in params]).tolist()
    plain = [p for p in params if not hasattr(p, "full_tensor")]
    return (id(model), *(p.data_ptr() for p in plain), *(p._version for p in plain), *sums)


def wire(name: str, tensor: Tensor) -> tuple[str, str, list[int], bytes]:
    """A tensor as plain msgpack values: vLLM's RPC decodes a bare tensor as a list.
    Read through a copy: `.numpy()` pins a storage's size for good, and FSDP frees an
    unsharded parameter by resizing its storage to 0."""
    data = tensor.detach().cpu().reshape(-1).view(torch.uint8).clone().numpy().tobytes()
    return name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data


def load(llm: LLM, model: nn.Module) -> None:
    """Load `model`'s current parameters into the running engine, one tensor at a time
    (a sharded one made whole first: a collective, see the module docstring); a LoRA
    model's layers merged (W + scale·B·A), so the engine samples the trained policy."""
    dtype = compute_dtype(model)  # bf16 from fp32 masters under `dtype: bfloat16`
    llm.collective_rpc("flowgraph_reload_begin")
    try:
        for name, tensor in merged_parameters(model, whole):
            llm.collective_rpc("flowgraph_reload_tensor", args=wire(name, tensor.to(dtype)))
    finally:
        # Also after a failure: layers that got no tensor get their old weights back.
        llm.collective_rpc("flowgraph_reload_end")
        llm.reset_prefix_cache()


SYNC_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 0.15, torch.float16: 0.1}
"""Largest |log-prob difference| between engine and trainer `verify` accepts, by
the model's compute dtype: kernels differ (float32 on CPU: ~1e-4 measured), wrong weights
differ by far more."""


class WeightSyncError(FlowgraphError):
    """The rollout engine does not hold the trainer's weights after a sync."""


def verify(llm: LLM, model: nn.Module, probe: list[list[int]], key: str) -> float:
    """Compare the engine's log-probs of the probe's tokens (each given its prefix) with
    the trainer's model's; the largest difference, or `WeightSyncError` past
    `SYNC_TOLERANCE`. One batched forward of `model` (a collective when it is sharded:
    every worker runs it once)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

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
    dtype = compute_dtype(model)
    tolerance = SYNC_TOLERANCE.get(dtype, 0.1)
    if not worst <= tolerance:
        raise WeightSyncError(
            f"weight sync check failed for model `{key}`: after the sync, the vLLM engine's "
            f"log-probs of a probe batch ({len(probe)} prompts) differ from the trainer's by "
            f"up to {worst:.3g} (tolerance {tolerance:g} for {dtype}): "
            "the engine is not sampling the policy being trained (a weight, or a LoRA "
            "adapter, that did not reach it); stopped before training on its samples")
    return worst
