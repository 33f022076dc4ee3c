"""Per-token log-probabilities (and entropy) of responses, computed in chunks.

The backbone runs once over `[prompt | response]` (prompts left-padded, responses
right-padded, position ids counted over the attention mask). The hidden state at
position P-1+t predicts response token t. Only the valid response tokens go through
the LM head, `chunk_size` tokens at a time:

    log π(y_t | ·) = z_{y_t}/τ − logsumexp(z/τ),    H_t = logsumexp(z/τ) − Σ_v p_v z_v/τ

so the extra peak memory is O(chunk_size·V) instead of O(B·T·V). With gradients each
chunk but the last is wrapped in `torch.utils.checkpoint`, so backward also materialises
one chunk of logits at a time (it recomputes that chunk's matmul; the last chunk's
logits are kept, as the backward pass starts with them), and the softmax part
has a hand-written backward (`_TokenStats`) that needs one (chunk, V) buffer. The LM
head is called as a module, so a tied head (or one with its own FSDP hooks) works
unchanged. This is the fused "linear + cross-entropy" of Liger-Kernel and Apple's
Cut-Cross-Entropy (Wijmans et al. 2024), in plain torch.

With `packing` the backbone runs on one row holding only the valid tokens, each
sequence's position ids restarting at 0 and no attention mask: transformers reads the
sequence boundaries off the position ids (flash-attention's varlen kernel on a GPU, a
block-diagonal mask for SDPA / eager), so no pad token is computed. The states are
those of the padded run (`tests/nodes/test_logprob.py`).

Notation: B sequences, P prompt length, T response length, H hidden size, V vocab,
n valid response tokens in the batch (n ≤ B·T), τ temperature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from flowgraph.runtime import NodeContext
    from flowgraph.runtime.context import Workers

__all__ = [
    "first_prompt_column",
    "forward_hidden",
    "head_logprob",
    "logprob",
    "micro_batched",
    "micro_batches",
    "response_span",
    "sequence_lengths",
    "sequence_logprob",
]


def _check_sequences(
    prompts: Tensor, prompt_mask: Tensor, responses: Tensor, response_mask: Tensor
) -> None:
    shapes = {
        "prompts": prompts.shape,
        "prompt_mask": prompt_mask.shape,
        "responses": responses.shape,
        "response_mask": response_mask.shape,
    }
    ok = (
        prompts.shape == prompt_mask.shape
        and responses.shape == response_mask.shape
        and prompts.dim() == 2
        and responses.dim() == 2
        and len(prompts) == len(responses)
    )
    if not ok:
        listed = ", ".join(f"{k}={tuple(v)}" for k, v in shapes.items())
        raise ValueError(
            f"expected prompts/prompt_mask (B, P) and responses/response_mask "
            f"(B, T) with one B; got {listed}"
        )


def forward_hidden(
    model: nn.Module,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    *,
    on_tokens: bool = False,
    packing: bool = False,
) -> Tensor:
    """Last hidden states (B, T, H) of the positions that predict the response tokens.

    `model` is a Hugging Face model (its `base_model` runs) or a bare backbone. With
    `on_tokens` the states sit on the response tokens instead (positions P .. P+T-1),
    which is where a sequence classifier reads its score. With `packing` the sequences
    run as one row without padding (`_packed_hidden`); masked positions come back as
    zeros then, where the padded forward has the states of its pad tokens (which no
    caller reads).
    """
    _check_sequences(prompts, prompt_mask, responses, response_mask)
    if packing:
        return _packed_hidden(model, prompts, prompt_mask, responses, response_mask, on_tokens)
    P, T = prompts.shape[1], responses.shape[1]
    # Padding trimmed: the leading prompt columns and trailing response columns that
    # are padding in every row change no valid position's state (positions are counted
    # over the mask, attention is causal), so the backbone runs on the batch's longest
    # sequence only; the trimmed response positions come back as zeros.
    lo, t = _trimmed(prompt_mask, response_mask)
    backbone = getattr(model, "base_model", model)
    input_ids = torch.cat([prompts[:, lo:], responses[:, :t]], dim=1)
    attention_mask = torch.cat([prompt_mask[:, lo:], response_span(response_mask)[:, :t]],
                               dim=1).long()
    # Left padding: count positions over real tokens only (HF generate does the same).
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    start = P - lo if on_tokens else P - lo - 1
    hidden: Tensor = out.last_hidden_state[:, start : start + t]
    return hidden if t == T else torch.nn.functional.pad(hidden, (0, 0, 0, T - t))


def _packed_hidden(
    model: nn.Module, prompts: Tensor, prompt_mask: Tensor, responses: Tensor,
    response_mask: Tensor, on_tokens: bool,
) -> Tensor:
    """`forward_hidden` on one row (1, N) of the N valid tokens, row after row, with
    position ids 0 .. n_i − 1 for row i's n_i = p_i + r_i tokens and no attention mask
    (the padded forward's positions, counted over the mask; transformers reads the
    boundaries off the restarts). Prompts must be left-padded and responses
    right-padded (a response with holes packs every token up to its last valid one:
    `response_span`), and a row with a response token must have a prompt token: the
    padded forward predicts a response token from the column before it, which is
    then a valid token, and that is the state this row holds."""
    pm, rm = prompt_mask.bool(), response_span(response_mask).bool()
    (B, P), T = pm.shape, rm.shape[1]
    p, r = pm.sum(-1), rm.sum(-1)
    prompt_ok = pm == (torch.arange(P, device=pm.device) >= (P - p).unsqueeze(-1))
    response_ok = rm == (torch.arange(T, device=rm.device) < r.unsqueeze(-1))
    bad = (~prompt_ok.all(-1)) | (~response_ok.all(-1)) | ((p == 0) & (r > 0))
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(
            f"packing needs left-padded prompts and right-padded responses, each response "
            f"after at least one prompt token; row {row} has prompt_mask "
            f"{pm[row].int().tolist()} and response_mask {rm[row].int().tolist()}: set "
            f"`packing: false` on this node (padding gives these rows their usual states)")
    n = p + r
    starts = n.cumsum(0) - n  # (B,): where each row's tokens begin in the packed row
    ids = torch.cat([prompts, responses], dim=1)[torch.cat([pm, rm], dim=1)]  # (N,)
    N = len(ids)
    position_ids = torch.arange(N, device=ids.device) - starts.repeat_interleave(n)
    backbone = getattr(model, "base_model", model)
    out = backbone(input_ids=ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                   attention_mask=None, use_cache=False)
    flat: Tensor = out.last_hidden_state[0]  # (N, H)
    # response token t of row i sits at starts_i + p_i + t; its predictor one before
    first = starts + p - (0 if on_tokens else 1)
    index = first.unsqueeze(-1) + torch.arange(T, device=ids.device)  # (B, T)
    hidden = flat.new_zeros(B, T, flat.shape[-1])
    return hidden.masked_scatter(rm.unsqueeze(-1), flat[index[rm]])


def response_span(response_mask: Tensor) -> Tensor:
    """(B, T): 1 on every response position up to a row's last valid token. The tokens a
    forward attends to: an agent's response mask has holes (tool and user tokens, which
    no loss reads but which the policy saw), a generated one is its own span."""
    return response_mask.flip(-1).cummax(-1).values.flip(-1)


def first_prompt_column(prompt_mask: Tensor) -> int:
    """The first column of left-padded prompts (b, P) that holds a token in some row
    (at most P − 1): the columns before it are padding in every row."""
    P = prompt_mask.shape[1]
    valid = prompt_mask.bool().any(0).nonzero()
    return min(int(valid[0]), P - 1) if len(valid) else P - 1


def _trimmed(prompt_mask: Tensor, response_mask: Tensor) -> tuple[int, int]:
    """(lo, t): the batch's prompt columns from `lo` and response columns up to `t` hold
    every valid token; at least the last prompt column and one response column stay."""
    valid_r = response_mask.bool().any(0).nonzero()
    t = int(valid_r[-1]) + 1 if len(valid_r) else 1
    return first_prompt_column(prompt_mask), t


class _TokenStats(torch.autograd.Function):
    """log π(y) [and entropy] from one chunk of logits z (c, V), y (c,): (c,) [, (c,)].

    The backward is written out so that it allocates one (c, V) buffer (two with
    entropy), where autograd's logsumexp + gather would keep several. With s = τ⁻¹z,
    ℓ = s − logsumexp(s) (log-probs) and p = exp ℓ:
        ∂log π(y)/∂s = onehot(y) − p,        ∂H/∂s = −p ⊙ (ℓ + H).
    """

    @staticmethod
    def forward(
        ctx: Any, z: Tensor, y: Tensor, inv_tau: float, with_entropy: bool,
        entropy_grad: bool = True,
    ) -> Tensor | tuple[Tensor, Tensor]:
        s = z if inv_tau == 1.0 else z * inv_tau
        lse = torch.logsumexp(s, dim=-1)
        log_p = s.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
        # the entropy's backward only when it is in the loss (else a metric: no gradient)
        ctx.inv_tau, ctx.with_entropy = inv_tau, with_entropy and entropy_grad
        if not with_entropy:
            ctx.save_for_backward(z, y, lse)
            return log_p
        log_p_all = s - lse.unsqueeze(-1)
        entropy = (-log_p_all.exp().mul_(log_p_all).sum(-1)).clamp_min(0.0)  # rounding: -1e-7
        if entropy_grad:
            ctx.save_for_backward(z, y, lse, entropy)
        else:
            ctx.save_for_backward(z, y, lse)
            ctx.mark_non_differentiable(entropy)
        return log_p, entropy

    @staticmethod
    def backward(
        ctx: Any, g_log_p: Tensor, g_entropy: Tensor | None = None
    ) -> tuple[Tensor, None, None, None, None]:
        z, y, lse, *entropy = ctx.saved_tensors
        log_p_all = z.mul(ctx.inv_tau).sub_(lse.unsqueeze(-1))  # ℓ, the one (c, V) buffer
        if ctx.with_entropy:
            assert g_entropy is not None  # forward returned (log_p, entropy): both have grads
            p = log_p_all.exp()
            # −p ⊙ (g_logp + g_H (ℓ + H)), computed in ℓ's buffer
            grad = log_p_all.add_(entropy[0].unsqueeze(-1)).mul_(g_entropy.unsqueeze(-1))
            grad = grad.add_(g_log_p.unsqueeze(-1)).mul_(p).neg_()
        else:
            grad = log_p_all.exp_().mul_(-g_log_p.unsqueeze(-1))
        grad.scatter_add_(-1, y.unsqueeze(-1), g_log_p.unsqueeze(-1))
        return grad.mul_(ctx.inv_tau), None, None, None, None


def _chunk_stats(
    lm_head: nn.Module, h: Tensor, y: Tensor, inv_tau: float, with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[Tensor, ...]:
    """The head on one chunk of c tokens, h (c, H), in float32 whatever the model dtype."""
    # torch leaves Function.apply unannotated (and mypy cannot exclude it by module)
    out = _TokenStats.apply(lm_head(h).float(), y, inv_tau, with_entropy, entropy_grad)  # type: ignore[no-untyped-call]
    return out if with_entropy else (out,)


def head_logprob(
    lm_head: nn.Module,
    hidden: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> dict[str, Tensor]:
    """The chunked LM-head part: hidden (B, T, H) -> log_prob (B, T) [, entropy (B, T)].

    Float32 outputs, 0 on masked positions. `temperature` divides the logits as the
    sampler did; 0 (greedy sampling) scores the untempered distribution, as there is
    no τ→0 distribution to score. With `entropy_grad` false the entropy comes from the
    same logits as the log-probs but has no gradient (a metric, not a loss term).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    inv_tau = 1.0 / temperature if temperature > 0 else 1.0
    mask = response_mask.bool()
    h, y = hidden[mask], responses[mask]  # (n, H), (n,): padding never reaches the head
    grad = torch.is_grad_enabled() and (
        h.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    parts = []
    starts = range(0, len(y), chunk_size)
    for i in starts:
        args = (lm_head, h[i : i + chunk_size], y[i : i + chunk_size], inv_tau, with_entropy,
                entropy_grad)
        # The backward pass starts with the last chunk: its logits, kept, are freed where
        # a recomputation would have made them again, so the peak is the same.
        keep = not grad or i == starts[-1]
        parts.append(
            _chunk_stats(*args) if keep else checkpoint(_chunk_stats, *args, use_reentrant=False)
        )
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
    names = ("log_prob", "entropy")[: 1 + with_entropy]
    if not parts:  # no valid response token
        if grad and hidden.numel():
            # 0 × the head on one position: the zeros hang on every parameter's graph,
            # so that a sharded model's workers all run the same backward (its
            # collectives) though this one's tokens are all masked; a zero gradient.
            anchor = 0.0 * lm_head(hidden.reshape(-1, hidden.shape[-1])[:1]).float().sum()
            return {name: zeros + anchor for name in names}
        return {name: zeros.clone() for name in names}
    return {
        name: zeros.masked_scatter(mask, torch.cat(col))
        for name, col in zip(names, zip(*parts, strict=True), strict=True)
    }


def micro_batches(
    lengths: Tensor, micro_batch_size: int | None = None, max_token_len: int | None = None,
    per_row: int = 1, workers: Workers | None = None, packing: bool = False,
) -> list[Tensor]:
    """The row indices of each micro-batch, in order: `micro_batch_size` rows each (null:
    one), or with `max_token_len` (verl's dynamic batch size) consecutive rows as long as
    per_row × rows × (the longest prompt + the longest response among them) — the padded
    tokens `forward_hidden` runs after trimming — stays within the budget; with
    `packing`, as long as per_row × Σ (prompt + response) does (no padding). `lengths`
    (B, 2): each row's valid prompt and response tokens (`sequence_lengths`); `per_row`:
    sequences a row puts in the forward (a DPO pair: 2). With `workers`, a budget's cut
    is split further until every worker runs as many micro-batches as the one with the
    most (a sharded model's forward is a collective), the largest halved first."""
    B = len(lengths)
    if max_token_len is None:
        return list(torch.arange(B).split(micro_batch_size or max(B, 1)))
    out: list[list[int]] = [[]]
    prompt = response = tokens = 0  # the open micro-batch's longest prompt and response; tokens
    for row, (p, r) in enumerate(lengths.tolist()):
        if per_row * (p + r) > max_token_len:
            raise ValueError(f"max_token_len={max_token_len} is less than row {row}'s "
                             f"{per_row * (p + r)} tokens (prompt + response); use at least "
                             f"{per_row} x (P + T)")
        grown = tokens + p + r if packing else \
            (len(out[-1]) + 1) * (max(prompt, p) + max(response, r))
        if out[-1] and per_row * grown > max_token_len:
            out.append([])
            prompt = response = tokens = 0
        out[-1].append(row)
        prompt, response, tokens = max(prompt, p), max(response, r), tokens + p + r
    out = [rows for rows in out if rows]
    need = workers.max(len(out)) if workers is not None else len(out)
    while len(out) < need:
        i = max(range(len(out)), key=lambda k: len(out[k]))
        if len(out[i]) < 2:
            raise ValueError(f"max_token_len: another worker runs {need} micro-batches and "
                             f"this one has only {B} rows; give every worker as many rows")
        half = (len(out[i]) + 1) // 2
        out[i:i + 1] = [out[i][:half], out[i][half:]]
    return [torch.tensor(rows, dtype=torch.long) for rows in out]


def micro_batched(
    forward: Callable[[Tensor], dict[str, Tensor]],
    prompt_mask: Tensor,
    response_mask: Tensor,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    ctx: NodeContext | None = None,
) -> dict[str, Tensor]:
    """A forward node's rows, a micro-batch at a time: `forward(rows)` on each
    micro-batch's row indices (`micro_batches`, cut by the rows' lengths; with
    `ctx.workers`, as many micro-batches as the worker with the most), each output
    (b, ...) concatenated back to (B, ...), in row order."""
    lengths = sequence_lengths(prompt_mask, response_mask)
    workers = ctx.workers if ctx is not None else None
    parts = [forward(rows) for rows in micro_batches(lengths, micro_batch_size, max_token_len,
                                                     workers=workers, packing=packing)]
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def sequence_lengths(prompt_mask: Tensor, *response_masks: Tensor) -> Tensor:
    """(B, 2): each row's valid prompt tokens and the most tokens of its responses (up to
    the last valid one: `response_span`)."""
    responses = torch.stack([response_span(m).bool().sum(-1) for m in response_masks]).amax(0)
    return torch.stack([prompt_mask.bool().sum(-1), responses], dim=-1)


def logprob(
    model: PreTrainedModel,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    with_entropy: bool = False,
    max_token_len: int | None = None,
    packing: bool = False,
    ctx: NodeContext | None = None,
) -> dict[str, Tensor]:
    """log_prob (B, T) of each response token (0 where masked); entropy (B, T) if asked."""

    def forward(rows: Tensor) -> dict[str, Tensor]:
        hidden = forward_hidden(model, prompts[rows], prompt_mask[rows], responses[rows],
                                response_mask[rows], packing=packing)
        return head_logprob(model.get_output_embeddings(), hidden, responses[rows],
                            response_mask[rows], chunk_size, temperature, with_entropy)

    return micro_batched(forward, prompt_mask, response_mask, micro_batch_size,
                         max_token_len, packing, ctx)


def sequence_logprob(
    model: PreTrainedModel,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    chunk_size: int = 1024,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    ctx: NodeContext | None = None,
) -> dict[str, Tensor]:
    """Σ_t log π(y_t | ·) over the valid response tokens: log_prob (B,) (DPO's log π(y|x))."""
    tokens = logprob(
        model,
        prompts,
        prompt_mask,
        responses,
        response_mask,
        chunk_size=chunk_size,
        micro_batch_size=micro_batch_size,
        max_token_len=max_token_len,
        packing=packing,
        ctx=ctx,
    )
    return {"log_prob": tokens["log_prob"].sum(-1)}
