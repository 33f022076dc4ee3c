"""Rollouts: n sampled responses per prompt, from Hugging Face or vLLM.

The `hf` backend is a decoding loop over the Hugging Face model written here: one
prefill of the left-padded prompts (attention mask, position ids counted over real
tokens, as `logprob` counts them), then one token at a time with the KV cache. The
`vllm` backend is the executor's engine (`ctx.rollout_engine("vllm")`: vLLM's offline
engine, one request per (prompt, sample), in `flowgraph.compilers.vllm.engine`).

Every sample draws its randomness from its own seed, a hash of (run seed, step, the
prompt's row in the global batch, sample j); the hf backend picks each token by
inverse CDF,

    y_t = min{v : Σ_{w ≤ v} softmax(z̃)_w > u},   u = U(seed, t),

with counter-based noise: u is splitmix64 (Steele et al. 2014) of the sample's seed and
the position t, so the whole batch's draw is one vectorised computation (one number per
row and token) and each sample's numbers are still its own. z̃ are the logits divided
by τ and filtered by top-k then top-p (Hugging Face's `TopKLogitsWarper`,
`TopPLogitsWarper`), so a sample's tokens do not depend on the batch it is generated in
nor on how the batch is split across data-parallel ranks.
Greedy decoding (`do_sample` false or τ = 0) takes argmax_v z_v.

`rollout_log_prob` is log π(y_t) under the distribution that drew y_t: log_softmax(z̃),
which with top_k = 0 and top_p = 1 is what `logprob(temperature=τ)` recomputes; for
greedy decoding the untempered log_softmax(z), as `logprob(temperature=0)` scores it.
vLLM's `processed_logprobs` mode reports the same numbers.

Notation: b prompts given to the node, n samples per prompt, r = b·n rows, P prompt
length, T response length (max_new_tokens), V vocabulary, τ temperature.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from flowgraph.nodes.logprob import first_prompt_column
from flowgraph.nodes.shaping import repeat_rows
from flowgraph.runtime.context import NodeContext, Workers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["SamplingSpec", "counter_uniform", "decode", "eval_mode", "filter_logits", "generate",
           "pad_id", "sample_seed", "stop_ids"]


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How to pick tokens; shared by both backends."""

    max_new_tokens: int
    """T: every response is padded (or cut) to this many tokens."""
    temperature: float
    top_p: float
    """Nucleus mass kept, in (0, 1]; 1 keeps everything."""
    top_k: int
    """Most likely tokens kept; 0 keeps everything."""
    greedy: bool
    stop_ids: tuple[int, ...]
    """End-of-sequence ids: the response ends with (and includes) the first one."""
    pad_id: int

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not self.stop_ids:
            problems.append("the tokenizer has no eos_token_id; responses could never end")
        if problems:
            raise ValueError("generate: " + "; ".join(problems))


def sample_seed(seed: int, step: int, row: int, j: int) -> int:
    """A 63-bit seed for sample j of the prompt at `row` of the global batch."""
    digest = hashlib.blake2b(f"{seed}:{step}:{row}:{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def filter_logits(scores: Tensor, top_k: int, top_p: float) -> Tensor:
    """(r, V) scores with tokens outside top-k, then outside the top-p nucleus, at −inf.

    As Hugging Face's warpers: top-k keeps ties with the k-th score; top-p drops the
    least likely tokens whose cumulative mass is ≤ 1 − p and always keeps the best one.
    """
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.size(-1))).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                   0x94D049BB133111EB))
"""splitmix64's constants as int64 (torch multiplies int64 modulo 2**64)."""


def _shift(x: Tensor, k: int) -> Tensor:
    """x >> k as on unsigned 64-bit integers (torch's >> keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seeds: Tensor, t: int | Sequence[int]) -> Tensor:
    """float64 in (0, 1): (r,) for one position t, (r, n) for n positions; u[i] (u[i, j])
    a function of (seeds[i], t) (of (seeds[i], t[j])) alone.

    splitmix64's output function applied to seed + γ·(t + 1), γ the golden ratio
    constant (Steele, Lea & Flood 2014); the top 52 bits give (k + ½)/2**52.
    """
    ts = [t] if isinstance(t, int) else list(t)
    steps = [(i + 1) * _GOLDEN % (1 << 64) for i in ts]  # γ·(t + 1) mod 2**64
    x = seeds[:, None] + torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in steps],
                                      dtype=torch.int64, device=seeds.device)  # as int64
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    x = x ^ _shift(x, 31)
    u = (_shift(x, 12).to(torch.float64) + 0.5) * 2.0**-52
    return u[:, 0] if isinstance(t, int) else u


def _pick(logits: Tensor, u: Tensor, spec: SamplingSpec) -> tuple[Tensor, Tensor]:
    """Next tokens (r,) and their log-probs (r,) from last-position logits (r, V); `u`
    (r,) float64 are the rows' uniforms for this position (`counter_uniform`)."""
    if spec.greedy:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
    scores = logits if spec.temperature == 1.0 else logits / spec.temperature
    log_p = filter_logits(scores, spec.top_k, spec.top_p).log_softmax(-1)
    # Inverse CDF: the first token whose cumulative probability exceeds u·(total mass).
    # A filtered token has no width, so it is never the first; the bound below keeps a
    # product rounded up to the total on the last token that has some.
    cdf = log_p.exp().cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, total.new_zeros(())))
    token = torch.searchsorted(cdf, x, right=True)[:, 0]
    return token, log_p.gather(-1, token[:, None])[:, 0]


def _forward(model: nn.Module, ids: Tensor, attention: Tensor, positions: Tensor,
             cache: Any, keep: dict[str, int]) -> tuple[Tensor, Any]:
    out = model(input_ids=ids, attention_mask=attention, position_ids=positions,
                past_key_values=cache, use_cache=True, **keep)
    return out.logits[:, -1].float(), out.past_key_values


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """No dropout while sampling; the caller's mode (a trainable actor's) comes back."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def decode(model: nn.Module, prompts: Tensor, prompt_mask: Tensor, seeds: Sequence[int],
           spec: SamplingSpec, workers: Workers | None = None,
           finished: Callable[[Tensor, Tensor, list[int], int], None] | None = None
           ) -> dict[str, Tensor]:
    """The hf backend: prompts (r, P) left-padded, one seed per row -> responses,
    response_mask (r, T) int64 and rollout_log_prob (r, T) float32, on the model's device.

    Runs the model as it is; `generate` puts it in eval mode (no dropout) first.
    `workers` (`ctx.workers`; one process when None) say whether a flag holds on every
    worker: decoding stops when every row on every worker has, since a sharded (FSDP)
    model runs collectives in each forward and all workers must take as many steps.

    What makes it lean changes no sample: the prompt columns that are padding in every
    row are dropped (a row's positions are counted over its tokens and its attention
    skips padding, so its states are the same); the KV cache grows in buffers reserved
    for the whole decode; an SDPA model gets its attention mask prepared once; it runs
    in the workers' inference mode (`torch.inference_mode` unless the model is
    sharded), returning ordinary tensors.

    `finished(responses, log_prob, rows, t)` is called as rows end: with the rows that
    sampled a stop token at position t (an agent rollout starts their tool calls while
    the others still decode); it must copy what it keeps.
    """
    workers = workers or Workers()
    with workers.inference(model):
        out = _decode(model, prompts, prompt_mask, seeds, spec, workers.all, finished)
    return {name: value.clone() if value.is_inference() else value
            for name, value in out.items()}


def _decode(model: nn.Module, prompts: Tensor, prompt_mask: Tensor, seeds: Sequence[int],
            spec: SamplingSpec, everywhere: Callable[[bool], bool],
            finished: Callable[[Tensor, Tensor, list[int], int], None] | None = None
            ) -> dict[str, Tensor]:
    device = next(model.parameters()).device
    r, T = len(prompts), spec.max_new_tokens
    lo = first_prompt_column(prompt_mask)
    prompts, prompt_mask = prompts[:, lo:], prompt_mask[:, lo:]
    P = prompts.shape[1]
    # every row's uniform for every position, in one go: a row's draws are its own
    noise = counter_uniform(torch.tensor(list(seeds), dtype=torch.int64, device=device),
                            range(T))
    # Only the last position's logits are needed; most HF models can skip the rest.
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    keep = {"logits_to_keep": 1} if takes_keep else {}
    responses = torch.full((r, T), spec.pad_id, dtype=torch.int64, device=device)
    mask = torch.zeros((r, T), dtype=torch.int64, device=device)
    log_prob = torch.zeros((r, T), dtype=torch.float32, device=device)
    attention = torch.ones((r, P + T), dtype=torch.int64, device=device)
    attention[:, :P] = prompt_mask
    positions = (attention[:, :P].cumsum(-1) - 1).clamp_min(0)
    done = torch.zeros(r, dtype=torch.bool, device=device)
    stop = torch.tensor(spec.stop_ids, device=device)
    if _takes_boolean_masks(model):  # prepared here, not rebuilt by the model every token
        attention = attention.bool()[:, None, None, :]
        causal = torch.ones((P, P), dtype=torch.bool, device=device).tril()
        logits, cache = _forward(model, prompts.to(device), attention[..., :P] & causal,
                                 positions, None, keep)
    else:
        logits, cache = _forward(model, prompts.to(device), attention[:, :P], positions,
                                 None, keep)
    _reserve(cache, P + T)
    for t in range(T):
        token, token_log_prob = _pick(logits, noise[:, t], spec)
        responses[:, t] = token.masked_fill(done, spec.pad_id)
        mask[:, t] = (~done).long()
        log_prob[:, t] = token_log_prob.masked_fill(done, 0.0)
        ended = torch.isin(token, stop) & ~done
        done |= ended
        if finished is not None and bool(ended.any()):
            finished(responses, log_prob, ended.nonzero()[:, 0].tolist(), t)
        if t == T - 1 or everywhere(bool(done.all())):
            break
        positions = positions[:, -1:] + 1
        step_ids = responses[:, t : t + 1]
        logits, cache = _forward(model, step_ids, attention[..., : P + t + 1], positions,
                                 cache, keep)
    return {"responses": responses, "response_mask": mask, "rollout_log_prob": log_prob}


def _takes_boolean_masks(model: Any) -> bool:
    """Whether the decode may give the model its attention as a prepared (r, 1, q, k)
    boolean mask: Hugging Face's mask builders return a 4-D mask as it is, and SDPA reads
    True as "attend". Only for SDPA attention with every layer attending to all earlier
    tokens (a sliding-window layer needs a mask of its own)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None


class _ReservedLayer(DynamicLayer):
    """Hugging Face's `DynamicLayer` with its keys and values in buffers reserved for
    the whole decode: a step writes its token's states in place and attends to a view
    of the filled part, where `DynamicLayer` copies the whole cache to add a token
    (quadratic in T). Same keys, same values, same attention: the same numbers."""

    def __init__(self, keys: Tensor, values: Tensor, capacity: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.length = keys.shape[-2]
        self.reserved = [x.new_empty((*x.shape[:-2], capacity, x.shape[-1]))
                         for x in (keys, values)]
        for buffer, x in zip(self.reserved, (keys, values), strict=True):
            buffer[..., : self.length, :] = x
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = (x[..., : self.length, :] for x in self.reserved)

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
               ) -> tuple[Tensor, Tensor]:
        start, self.length = self.length, self.length + key_states.shape[-2]
        for buffer, x in zip(self.reserved, (key_states, value_states), strict=True):
            buffer[..., start : self.length, :] = x
        self.keys, self.values = (x[..., : self.length, :] for x in self.reserved)
        return self.keys, self.values


def _reserve(cache: Any, capacity: int) -> None:
    """Turn the prefilled cache's plain dynamic layers into `_ReservedLayer`s of
    `capacity` tokens; other layers (sliding-window, a model's own cache) stay."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.keys is not None and layer.values is not None:
            layers[i] = _ReservedLayer(layer.keys, layer.values, capacity)


def stop_ids(model: nn.Module, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids of the tokenizer and of the model's generation config (HF may list several)."""
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])]
    return tuple(sorted({int(i) for i in ids if i is not None}))


def generate(
    ctx: NodeContext,
    model: PreTrainedModel,
    tokenizer: Any,
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    ground_truth: Sequence[str] | None = None,
    data_source: Sequence[str] | None = None,
    extra_info: Sequence[Any] | None = None,
    row: Sequence[Any] | None = None,
    backend: str = "hf",
    n: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int | None = None,
    do_sample: bool = True,
    gpu_memory_utilization: float | None = None,
) -> dict[str, Tensor | list[Any]]:
    """The `generate` kind: n responses per prompt; samples of a prompt are consecutive.

    prompts, prompt_mask (b, P) -> prompts, prompt_mask (r, P); responses, response_mask,
    rollout_log_prob (r, T); index (r,) the prompt's row in the global batch (this
    rank's rows start at `ctx.row_offset`: an executor splits a batch into contiguous
    parts); ground_truth, data_source, extra_info, row (r,) lists when given. vLLM reserves a
    KV cache for the r sequences of P+T tokens, or, with `gpu_memory_utilization`, that
    share of the accelerator's memory (on CPU: of NUMA node 0's RAM). The kind's `val_n`
    and `val_temperature` are the compiler's: at evaluation the node is called with the
    n and sampling they set (`NodePlan.eval_params`).
    """
    n = n or ctx.dims.get("N")
    T = max_new_tokens or ctx.dims.get("T")
    if n is None or T is None:
        raise ValueError("generate: set the params n and max_new_tokens, or bind the dims N and T")
    spec = SamplingSpec(T, temperature, top_p, top_k, not do_sample or temperature == 0,
                        stop_ids(model, tokenizer), pad_id(tokenizer))
    rows = ctx.row_offset + torch.arange(len(prompts))
    seeds = [sample_seed(ctx.seed, ctx.step, int(row), j) for row in rows for j in range(n)]
    prompts, prompt_mask = prompts.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
    if backend == "vllm":
        out = ctx.rollout_engine("vllm").rollout(model, tokenizer, prompts, prompt_mask, seeds,
                                                 spec, gpu_memory_utilization)
    elif backend == "hf":
        with eval_mode(model):
            out = decode(model, prompts, prompt_mask, seeds, spec, ctx.workers)
    else:
        raise ValueError(f"generate: backend must be `hf` or `vllm`, got `{backend}`")
    outputs: dict[str, Tensor | list[Any]] = {
        name: value.to(prompts.device) for name, value in out.items()}
    outputs |= {"prompts": prompts, "prompt_mask": prompt_mask.long(),
                "index": rows.repeat_interleave(n).to(prompts.device)}
    for name, rows_of in (("ground_truth", ground_truth), ("data_source", data_source),
                          ("extra_info", extra_info), ("row", row)):
        if rows_of is not None:  # one value per prompt -> one per sample, in sample order
            outputs[name] = repeat_rows(rows_of, n)
    return outputs


def pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)
