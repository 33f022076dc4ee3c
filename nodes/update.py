"""Update nodes: PPO actor (Schulman et al. 2017), PPO critic, DPO (Rafailov et al. 2023),
SFT (cross-entropy on response tokens).

Each is a sink: it trains `ctx.model` with `ctx.optimizer` and reports through
`ctx.metrics`. All four share one loop, verl's `dp_actor.update_policy`:

    for epoch in range(ppo_epochs):              # permutation seeded by (seed, step, epoch)
        for each mini-batch of M sequences:       # one optimizer step
            for each micro-batch k of m:          # gradient accumulation
                (w_k · L_k).backward()
            ctx.optimizer_step(): the grad norm, clipped; non-finite → NonFiniteError,
                                  model untouched
    scheduler.step()                             # once per call: training steps, as verl

Micro-batch weights. L_k is micro-batch k's own loss, aggregated as `loss_agg_mode`
says, and w_k = n_k / Σ_j n_j, with n the aggregation's denominator: valid tokens
(token-mean), sequences with a valid token (both seq-mean modes), pairs (DPO). Then
Σ_k w_k L_k *is* the mini-batch loss, so the accumulated gradient equals the one-shot
mini-batch gradient for every mode and every m: verl's global normalisation (`agg_loss`
with `batch_num_tokens` / `global_batch_size`). Reported metrics are weighted the same way
within a mini-batch, then averaged over the optimizer steps.

The shuffle uses its own `torch.Generator`, so the global RNG is untouched and a
resumed step reshuffles exactly as the original run did.

Data parallel: the executor passes the whole batch to every worker with
`ctx.dp_rank/dp_size`; each worker trains on its contiguous share of every
mini-batch, so a run on N workers steps through the same mini-batches as on one.
The weights' denominators are the whole mini-batch's, the gradients are summed over
the workers by `ctx.optimizer_step` and the metrics by `ctx.workers.sum`: no
collective is called here.

Notation: B sequences (pairs for DPO) in the batch, M mini_batch_size (global), m
micro_batch_size (per worker), P prompt length, T response length.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import Tensor

from flowgraph.errors import NonFiniteError
from flowgraph.nodes._agg import agg_loss, masked_mean
from flowgraph.nodes.logprob import (
    forward_hidden,
    head_logprob,
    logprob,
    micro_batches,
    sequence_lengths,
    sequence_logprob,
)
from flowgraph.nodes.losses import dpo_loss, kl_penalty, value_loss
from flowgraph.nodes.policy_losses import rollout_is_weights
from flowgraph.nodes.values import ValueModel
from flowgraph.nodes.values import values as predict_values
from flowgraph.registry import loss_function, loss_names, loss_spec
from flowgraph.runtime import NodeContext
from flowgraph.runtime.context import Impl

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["dpo_update", "ppo_actor_update", "ppo_critic_update", "sft_update"]

Batch = dict[str, Tensor]
LossFn = Callable[[Batch], tuple[Tensor, dict[str, float]]]
"""A micro-batch → (its loss, aggregated over the micro-batch; metrics by full name)."""
SizeFn = Callable[[Batch], float]
"""A (micro-)batch → the denominator its loss aggregation divides by."""
SEQUENCES = ("prompts", "prompt_mask", "responses", "response_mask")


# --------------------------------------------------------------------------- the loop


def _schedule(
    B: int, ppo_epochs: int, mini: int | None, micro: int | None, dp_size: int = 1,
    max_token_len: int | None = None,
) -> tuple[int, int]:
    """(M, m): M | B global rows per mini-batch, m | M/dp_size rows per micro-batch on
    each worker (with `max_token_len` the budget cuts the micro-batches instead); the
    message names the numbers that do not fit."""
    M = mini or B
    if B < 1 or ppo_epochs < 1:
        raise ValueError(
            f"an update needs B >= 1 and ppo_epochs >= 1; got B={B}, ppo_epochs={ppo_epochs}"
        )
    if B % M:
        raise ValueError(
            f"mini_batch_size={M} does not divide the batch of {B} sequences; "
            f"use a divisor of {B}, or null for the whole batch"
        )
    if M % dp_size:
        raise ValueError(
            f"mini_batch_size={M} does not split evenly over {dp_size} data-parallel "
            f"workers; use a multiple of {dp_size}"
        )
    if max_token_len is not None and micro is not None:
        raise ValueError(f"micro_batch_size={micro} and max_token_len={max_token_len}: set "
                         "one (rows per micro-batch, or a token budget)")
    m = micro or M // dp_size
    if (M // dp_size) % m:
        raise ValueError(
            f"micro_batch_size={m} does not divide the {M // dp_size} rows of a mini-batch "
            f"on each of {dp_size} worker(s); use a divisor of {M // dp_size}, or null"
        )
    return M, m


def _permutation(ctx: NodeContext, epoch: int, B: int) -> Tensor:
    """A permutation of range(B) that depends on (seed, step, epoch) only."""
    key = hashlib.blake2b(f"{ctx.seed}/{ctx.step}/{epoch}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    return torch.randperm(B, generator=generator)


def _rows(batch: Batch, rows: Tensor) -> Batch:
    return {k: v[rows.to(v.device)] for k, v in batch.items()}


def _mini_batches(
    batch: Batch, order: Tensor, M: int, ctx: NodeContext, size_fn: SizeFn,
    split: Callable[[Batch], list[Tensor]],
) -> list[tuple[float, list[Batch]]]:
    """The rows of `batch` in `order` as B/M mini-batches, each as (its whole loss
    denominator, this worker's M/dp_size rows of it in the micro-batches `split` cuts)."""
    out = []
    for mini in order.split(M):
        mine = _rows(batch, mini.tensor_split(ctx.dp_size)[ctx.dp_rank])
        total = size_fn(_rows(batch, mini)) if ctx.dp_size > 1 else None
        micro = [_rows(mine, rows) for rows in split(mine)]
        out.append((total if total is not None else sum(map(size_fn, micro)), micro))
    return out


def _abort(ctx: NodeContext, what: str) -> NoReturn:
    ctx.model.zero_grad(set_to_none=True)  # nothing of the bad step survives
    raise NonFiniteError(ctx.node, ctx.step, what)


def _optimizer_step(
    ctx: NodeContext, total: float, micro_batches: list[Batch], loss_fn: LossFn,
    size_fn: SizeFn
) -> dict[str, float]:
    """Accumulate w_k·L_k over the micro-batches, then one optimizer step.

    `total` is the mini-batch's loss denominator over all workers and w_k = n_k/total,
    so the gradients summed over the workers (`ctx.optimizer_step`) are the whole
    mini-batch's gradient, and so are the metrics' weighted sums.
    """
    sizes = [size_fn(mb) for mb in micro_batches]
    sums: dict[str, float] = defaultdict(float)
    ctx.model.zero_grad(set_to_none=True)
    for mb, n in zip(micro_batches, sizes, strict=True):
        # No valid token anywhere: every L_k is 0, any weights do.
        w = n / total if total else 1 / (len(sizes) * ctx.dp_size)
        loss, stats = loss_fn(mb)
        if not ctx.workers.all(math.isfinite(loss.item())):  # all stop, or none waits
            _abort(ctx, "loss")
        if loss.requires_grad:  # else no valid token reached the model: a zero gradient
            (w * loss).backward()
        for name, value in stats.items():
            sums[name] += w * value
    metrics = ctx.workers.sum(sums)
    metrics["grad_norm"] = ctx.optimizer_step()
    metrics["lr"] = ctx.optimizer.param_groups[0]["lr"]  # the scheduler moves it later
    return metrics


def _train(
    ctx: NodeContext,
    batch: Batch,
    loss_fn: LossFn,
    size_fn: SizeFn,
    prefix: str,
    *,
    ppo_epochs: int,
    mini_batch_size: int | None,
    micro_batch_size: int | None,
    max_token_len: int | None = None,
    packing: bool = False,
    responses: tuple[str, ...] = ("response_mask",),
) -> None:
    """Epochs × shuffled mini-batches × micro-batches; metric means into `ctx.metrics`.

    Data-parallel (ctx.dp_size > 1): every worker gets the whole batch and draws the
    same permutation; each takes its contiguous 1/dp_size of every mini-batch. The
    mini-batches are those of a one-worker run, so the numbers are too. Micro-batches
    are `micro_batch_size` rows, or cut by the token budget `max_token_len` over the
    prompt and the `responses` masks of a row (all of them in one forward: DPO's pair),
    counting only valid tokens with `packing` (the loss then runs its forwards packed).
    """
    if ctx.model is None or ctx.optimizer is None:
        raise ValueError(
            f"update node `{ctx.node}` needs ctx.model and ctx.optimizer; got "
            f"model={type(ctx.model).__name__}, "
            f"optimizer={type(ctx.optimizer).__name__}"
        )
    B = len(next(iter(batch.values())))
    M, m = _schedule(B, ppo_epochs, mini_batch_size, micro_batch_size, ctx.dp_size,
                     max_token_len)

    def split(mine: Batch) -> list[Tensor]:
        lengths = sequence_lengths(mine["prompt_mask"], *(mine[r] for r in responses))
        return micro_batches(lengths, m, max_token_len, per_row=len(responses),
                             workers=ctx.workers, packing=packing)

    plan = (
        mini
        for epoch in range(ppo_epochs)
        for mini in _mini_batches(batch, _permutation(ctx, epoch, B), M, ctx, size_fn, split)
    )
    with torch.enable_grad():  # an executor may call nodes under no_grad
        steps = [_optimizer_step(ctx, total, micro, loss_fn, size_fn) for total, micro in plan]
    if ctx.scheduler is not None:  # once per training step, as verl's lr_scheduler
        ctx.scheduler.step()
    for name in steps[0]:
        full = f"{prefix}/{name}" if name in ("grad_norm", "lr") else name
        ctx.metrics[full] = sum(s[name] for s in steps) / len(steps)


def _agg_size(mode: str, mb: Batch, mask_key: str = "response_mask") -> float:
    """The denominator of `agg_loss(·, mb[mask_key], mode)` on this (micro-)batch."""
    mask = mb[mask_key]
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask != 0).any(-1).sum())  # both seq-mean modes: sequences with a token


# --------------------------------------------------------------------------- PPO actor


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss an update uses, with its params; rollout correction, if on."""

    fn: Callable[..., tuple[Tensor, dict[str, float]]]
    params: dict[str, object]
    rollout_is: str | None = None
    threshold: float = 2.0
    threshold_lower: float | None = None

    @staticmethod
    def of(name: str, own: Mapping[str, object], shared: Mapping[str, float]) -> PolicyLoss:
        """`name` (built in, or a plugin's `@policy_loss`) with its own params and the
        update's clip ratios it takes."""
        spec = loss_spec(name)
        if spec is None:
            raise ValueError(f"unknown policy_loss `{name}`; known: {', '.join(loss_names())}")
        fn = loss_function(name) or Impl.load_function(spec.impl)
        accepts = inspect.signature(fn).parameters
        return PolicyLoss(fn, {**{k: v for k, v in shared.items() if k in accepts}, **own})

    def __call__(self, mb: Batch, log_prob: Tensor, mode: str, scale: float | None
                 ) -> tuple[Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        # No old_log_prob: one optimizer step per rollout, π_old is the policy we start from.
        old = mb.get("old_log_prob", log_prob.detach())
        pg_losses, metrics = self.fn(old, log_prob, mb["advantages"], mask, **self.params)
        if self.rollout_is is not None:
            weights, is_metrics = rollout_is_weights(
                old, mb["rollout_log_prob"], mask, self.rollout_is, self.threshold,
                self.threshold_lower)
            pg_losses, metrics = pg_losses * weights, {**metrics, **is_metrics}
        return agg_loss(pg_losses, mask, mode, scale), metrics


def _actor_loss(
    model: PreTrainedModel,
    mb: Batch,
    *,
    policy: PolicyLoss,
    entropy_coeff: float,
    kl_loss_coef: float,
    kl_loss_type: str,
    mode: str,
    scale: float | None = None,
    temperature: float = 1.0,
    packing: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """L = L_pg − c_H·H + c_KL·KL(π ‖ π_ref), each aggregated by `mode` (verl's actor)."""
    mask, responses, head = mb["response_mask"], mb["responses"], model.get_output_embeddings()
    hidden = forward_hidden(model, *(mb[k] for k in SEQUENCES), packing=packing)
    # one pass over the head for both; the entropy is in the backward only when in the loss
    out = head_logprob(head, hidden, responses, mask, temperature=temperature,
                       with_entropy=True, entropy_grad=entropy_coeff != 0)
    log_prob, entropy_t = out["log_prob"], out["entropy"]
    pg_loss, pg = policy(mb, log_prob, mode, scale)
    entropy = agg_loss(entropy_t, mask, mode, scale)
    metrics = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy.item()}
    metrics |= {f"actor/{k}": v for k, v in pg.items()}
    loss = pg_loss - entropy_coeff * entropy if entropy_coeff else pg_loss
    if "ref_log_prob" in mb:
        kl = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], kl_loss_type), mask, mode,
                      scale)
        loss = loss + kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.item()
    return loss, metrics


def ppo_actor_update(
    ctx: NodeContext,
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    advantages: Tensor,
    old_log_prob: Tensor | None = None,
    ref_log_prob: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
    policy_loss: str = "vanilla",
    policy_loss_params: Mapping[str, object] | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_is_threshold_lower: float | None = None,
    loss_scale_factor: float | None = None,
    entropy_coeff: float = 0.0,
    kl_loss_coef: float = 0.001,
    kl_loss_type: str = "low_var_kl",
    temperature: float = 1.0,
    ppo_epochs: int = 1,
    mini_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    loss_agg_mode: str = "token-mean",
) -> dict[str, Tensor]:
    """Dual-clip PPO on the actor `ctx.model` (a causal LM); all tensors (B, P) or (B, T).

    Log-probs are recomputed at `temperature` (the rollout's: verl passes it to the
    actor the same way; 0, greedy, scores at 1). A wired `ref_log_prob` adds GRPO's KL
    loss. Without `old_log_prob` (pass `on_policy`) the update must take one optimizer
    step, whose own log-probs, detached, are π_old's. Metrics: actor/{pg_loss,
    pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, kl_loss (with ref_log_prob),
    grad_norm, lr}.
    """
    batch = {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "advantages": advantages,
    }
    for name, value in (("old_log_prob", old_log_prob), ("ref_log_prob", ref_log_prob),
                        ("rollout_log_prob", rollout_log_prob)):
        if value is not None:
            batch[name] = value
    if rollout_is is not None and rollout_log_prob is None:
        raise ValueError(f"ppo_actor_update: rollout_is={rollout_is!r} weighs by pi_old / "
                         "pi_rollout: wire generate's rollout_log_prob")
    if old_log_prob is None and (ppo_epochs != 1 or (mini_batch_size or len(prompts))
                                 < len(prompts)):
        raise ValueError(
            f"ppo_actor_update without old_log_prob takes its own log-probs as the old "
            f"policy's, which holds for one optimizer step only; got ppo_epochs="
            f"{ppo_epochs}, mini_batch_size={mini_batch_size} of {len(prompts)} rows: "
            f"wire old_log_prob")
    clip = {
        "clip_ratio_low": clip_ratio_low,
        "clip_ratio_high": clip_ratio_high,
        "clip_ratio_c": clip_ratio_c,
    }
    policy = replace(PolicyLoss.of(policy_loss, dict(policy_loss_params or {}), clip),
                     rollout_is=rollout_is, threshold=rollout_is_threshold,
                     threshold_lower=rollout_is_threshold_lower)
    loss_fn = partial(
        _actor_loss,
        ctx.model,
        policy=policy,
        scale=loss_scale_factor,
        entropy_coeff=entropy_coeff,
        kl_loss_coef=kl_loss_coef,
        kl_loss_type=kl_loss_type,
        temperature=temperature,
        mode=loss_agg_mode,
        packing=packing,
    )
    _train(
        ctx,
        batch,
        loss_fn,
        partial(_agg_size, loss_agg_mode),
        "actor",
        ppo_epochs=ppo_epochs,
        mini_batch_size=mini_batch_size,
        micro_batch_size=micro_batch_size,
        max_token_len=max_token_len,
        packing=packing,
    )
    return {}


def ppo_actor_update_eval(
    ctx: NodeContext,
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    ref_log_prob: Tensor | None = None,
    temperature: float = 1.0,
    packing: bool = False,
    **_: object,
) -> dict[str, Tensor]:
    """`ppo_actor_update`'s metric on held-out responses, without a step (the executor's
    eval hook): `log_ratio_to_ref`, the mean over valid tokens of log π − log π_ref,
    when `ref_log_prob` is wired. The executor reads it from an actor log-prob node
    when the graph has one; with that forward elided (pass `on_policy`), from here."""
    if ref_log_prob is None:
        return {}
    with torch.no_grad():
        log_prob = logprob(ctx.model, prompts, prompt_mask, responses, response_mask,
                           temperature=temperature, packing=packing)["log_prob"]
    ctx.metrics["log_ratio_to_ref"] = masked_mean(log_prob - ref_log_prob, response_mask).item()
    return {}


# --------------------------------------------------------------------------- PPO critic


def _critic_loss(
    critic: ValueModel, mb: Batch, *, cliprange_value: float, mode: str, packing: bool = False
) -> tuple[Tensor, dict[str, float]]:
    """½·agg(max((v̂ − R)², (clip(v̂, V ± c) − R)²)) with v̂ recomputed with grad."""
    mask = mb["response_mask"]
    vpreds = predict_values(critic, mb["prompts"], mb["prompt_mask"], mb["responses"],
                            mb["response_mask"], packing=packing)["values"]
    loss, clipfrac = value_loss(vpreds, mb["values"], mb["returns"], mask, cliprange_value, mode)
    return loss, {
        "critic/vf_loss": loss.item(),
        "critic/vf_clipfrac": clipfrac,
        "critic/vpred_mean": masked_mean(vpreds.detach(), mask).item(),
    }


def ppo_critic_update(
    ctx: NodeContext,
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    values: Tensor,
    returns: Tensor,
    cliprange_value: float = 0.5,
    ppo_epochs: int = 1,
    mini_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    loss_agg_mode: str = "token-mean",
) -> dict[str, Tensor]:
    """Clipped value regression of the critic `ctx.model` (a `ValueModel`) onto `returns`.

    `values` (B, T) are the rollout-time values V, the centre of the clip. Metrics:
    critic/{vf_loss, vf_clipfrac, vpred_mean, grad_norm, lr}.
    """
    batch = {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "values": values,
        "returns": returns,
    }
    loss_fn = partial(_critic_loss, ctx.model, cliprange_value=cliprange_value, mode=loss_agg_mode,
                      packing=packing)
    _train(
        ctx,
        batch,
        loss_fn,
        partial(_agg_size, loss_agg_mode),
        "critic",
        ppo_epochs=ppo_epochs,
        mini_batch_size=mini_batch_size,
        micro_batch_size=micro_batch_size,
        max_token_len=max_token_len,
        packing=packing,
    )
    return {}


# --------------------------------------------------------------------------- DPO


def _dpo_loss(
    model: PreTrainedModel, mb: Batch, *, beta: float, loss_type: str, label_smoothing: float,
    packing: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Mean DPO loss over the pairs; chosen and rejected share one forward pass (TRL)."""
    n = len(mb["prompts"])
    logps = sequence_logprob(
        model,
        mb["prompts"].repeat(2, 1),
        mb["prompt_mask"].repeat(2, 1),
        torch.cat([mb["chosen"], mb["rejected"]]),
        torch.cat([mb["chosen_mask"], mb["rejected_mask"]]),
        packing=packing,
    )["log_prob"]
    losses, chosen, rejected = dpo_loss(
        logps[:n],
        logps[n:],
        mb["ref_chosen_logps"],
        mb["ref_rejected_logps"],
        beta,
        loss_type,
        label_smoothing,
    )
    loss = losses.mean()
    return loss, {
        "actor/dpo_loss": loss.item(),
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/accuracies": (chosen > rejected).float().mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
    }


def dpo_update(
    ctx: NodeContext,
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    chosen: Tensor,
    chosen_mask: Tensor,
    rejected: Tensor,
    rejected_mask: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    ppo_epochs: int = 1,
    mini_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    loss_agg_mode: str = "token-mean",
) -> dict[str, Tensor]:
    """DPO on the policy `ctx.model`: prompts (B, P), chosen/rejected (B, T), ref logps (B,).

    log π(y|x) is the sum over the valid response tokens (`sequence_logprob`), and the
    loss is the mean over pairs, so `loss_agg_mode` (a shared mini-batch param) has no
    effect here. Metrics (TRL names): actor/dpo_loss, rewards/{chosen, rejected,
    accuracies, margins}, actor/{grad_norm, lr}.
    """
    del loss_agg_mode  # per-pair loss: nothing to aggregate over tokens
    batch = {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "chosen": chosen,
        "chosen_mask": chosen_mask,
        "rejected": rejected,
        "rejected_mask": rejected_mask,
        "ref_chosen_logps": ref_chosen_logps,
        "ref_rejected_logps": ref_rejected_logps,
    }
    loss_fn = partial(
        _dpo_loss, ctx.model, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
        packing=packing,
    )
    _train(
        ctx,
        batch,
        loss_fn,
        lambda mb: float(len(mb["prompts"])),
        "actor",
        ppo_epochs=ppo_epochs,
        mini_batch_size=mini_batch_size,
        micro_batch_size=micro_batch_size,
        max_token_len=max_token_len,
        packing=packing,
        responses=("chosen_mask", "rejected_mask"),
    )
    return {}


DPO_INPUTS = (
    "prompts",
    "prompt_mask",
    "chosen",
    "chosen_mask",
    "rejected",
    "rejected_mask",
    "ref_chosen_logps",
    "ref_rejected_logps",
)
"""The input ports of `dpo_update`, in order."""


def dpo_update_eval(
    ctx: NodeContext,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    packing: bool = False,
    **inputs: Tensor,
) -> dict[str, Tensor]:
    """`dpo_update`'s metrics on held-out pairs, without a step (the executor's eval hook).

    Takes the same keyword arguments as `dpo_update`; the mini-batch params are ignored.
    """
    batch = {name: inputs[name] for name in DPO_INPUTS}
    with torch.no_grad():
        _, metrics = _dpo_loss(ctx.model, batch, beta=beta, loss_type=loss_type,
                               label_smoothing=label_smoothing, packing=packing)
    ctx.metrics.update(metrics)
    return {}


# --------------------------------------------------------------------------- SFT


def _sft_loss(model: PreTrainedModel, mb: Batch, *, mode: str, packing: bool = False
              ) -> tuple[Tensor, dict[str, float]]:
    """−log π(y_t | x, y_<t) over the trained response tokens (`loss_mask`: a
    conversation's assistant turns), aggregated by `mode`."""
    log_prob = logprob(model, mb["prompts"], mb["prompt_mask"], mb["responses"],
                       mb["response_mask"], packing=packing)["log_prob"]
    loss = agg_loss(-log_prob, mb["loss_mask"], mode)
    return loss, {"sft/loss": loss.item()}


def _sft_batch(prompts: Tensor, prompt_mask: Tensor, responses: Tensor, response_mask: Tensor,
               loss_mask: Tensor | None) -> Batch:
    """The trained tokens are those `loss_mask` marks among the valid response tokens
    (a padding position has no log-prob to train)."""
    trained = response_mask if loss_mask is None else loss_mask * response_mask
    return {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
            "response_mask": response_mask, "loss_mask": trained}


def sft_update(
    ctx: NodeContext,
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    loss_mask: Tensor | None = None,
    ppo_epochs: int = 1,
    mini_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    loss_agg_mode: str = "token-mean",
) -> dict[str, Tensor]:
    """Supervised fine-tuning of `ctx.model`: the cross-entropy of each trained response
    token (`loss_mask`, default every valid one) given the prompt and the tokens before
    it; prompt tokens carry no loss (HF's labels = -100), nor do the user turns inside a
    multi-turn response. token-mean is Hugging Face's / verl's SFT loss. Metrics:
    sft/loss, actor/{grad_norm, lr}."""
    batch = _sft_batch(prompts, prompt_mask, responses, response_mask, loss_mask)
    _train(
        ctx,
        batch,
        partial(_sft_loss, ctx.model, mode=loss_agg_mode, packing=packing),
        partial(_agg_size, loss_agg_mode, mask_key="loss_mask"),
        "actor",
        ppo_epochs=ppo_epochs,
        mini_batch_size=mini_batch_size,
        micro_batch_size=micro_batch_size,
        max_token_len=max_token_len,
        packing=packing,
    )
    return {}


def sft_update_eval(
    ctx: NodeContext,
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    loss_mask: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    packing: bool = False,
    **mini_batch: object,
) -> dict[str, Tensor]:
    """`sft_update`'s loss on held-out rows, without a step (the executor's eval hook);
    the mini-batch params are ignored."""
    del mini_batch
    batch = _sft_batch(prompts, prompt_mask, responses, response_mask, loss_mask)
    with torch.no_grad():
        _, metrics = _sft_loss(ctx.model, batch, mode=loss_agg_mode, packing=packing)
    ctx.metrics.update(metrics)
    return {}
