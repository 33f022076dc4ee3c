"""Update kinds: PPO actor (Schulman et al. 2017), PPO critic, DPO (Rafailov et al. 2023),
SFT (cross-entropy on response tokens).

Each kind is its loss and the rows it trains on. Its implementation returns an `Update`
(`flowgraph.runtime.update`): the batch, every tensor its loss reads, and the loss, a
frozen record of the loss's params whose call is the maths on one micro-batch
(torchtune's `PPOLoss`), with the denominator of its aggregation (the micro-batch
weights) and the metrics it reports on held-out data. The executor's update loop
(`flowgraph.compilers.update_loop`) trains every kind the same way: epochs, the seeded
shuffle, mini-batches and each data-parallel worker's share, micro-batches or token
budgets, gradient accumulation, clipping, the optimizer and scheduler steps, the metric
means. A kind takes only the params its loss uses; the loop's (`MiniBatching`) are
declared beside them and read by the loop.

Notation: B sequences (pairs for DPO) in the batch, P prompt length, T response length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flowgraph.nodes._agg import agg_loss, masked_mean
from flowgraph.nodes.logprob import forward_hidden, head_logprob, logprob, sequence_logprob
from flowgraph.nodes.losses import dpo_loss, kl_penalty, value_loss
from flowgraph.nodes.policy_losses import rollout_is_weights, vanilla
from flowgraph.nodes.values import ValueModel
from flowgraph.nodes.values import values as predict_values
from flowgraph.runtime.context import Impl
from flowgraph.runtime.update import Batch, Update, policy_loss_problem

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ActorLoss", "CriticLoss", "DPOLoss", "SFTLoss", "dpo_update", "ppo_actor_update",
           "ppo_critic_update", "sft_update"]

SEQUENCES = ("prompts", "prompt_mask", "responses", "response_mask")
LossFunction = Callable[..., tuple[Tensor, dict[str, float]]]
"""A policy loss (`flowgraph.nodes.policy_losses`): per-token loss (B, T) and metrics."""


def _agg_size(mode: str, mask: Tensor) -> float:
    """The denominator of `agg_loss(·, mask, mode)`."""
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask != 0).any(-1).sum())  # both seq-mean modes: sequences with a token


# --------------------------------------------------------------------------- PPO actor


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss an update uses, with its params; rollout correction, if on."""

    fn: LossFunction
    params: dict[str, object]
    rollout_is: str | None = None
    threshold: float = 2.0
    threshold_lower: float | None = None

    @staticmethod
    def of(loss: LossFunction | str, own: Mapping[str, object], shared: Mapping[str, float]
           ) -> PolicyLoss:
        """`loss` (its function, or its implementation's `module:function`, as the
        compiler writes the one a graph names) with its own params and the update's clip
        ratios it takes."""
        fn = loss if callable(loss) else Impl.load_function(loss)
        accepts = inspect.signature(fn).parameters
        return PolicyLoss(fn, {**{k: v for k, v in shared.items() if k in accepts}, **own})

    def __call__(self, mb: Batch, log_prob: Tensor, mode: str, scale: float | None
                 ) -> tuple[Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        # No old_log_prob: one optimizer step per rollout, π_old is the policy we start from.
        old = mb.get("old_log_prob", log_prob.detach())
        returned = self.fn(old, log_prob, mb["advantages"], mask, **self.params)
        problem = policy_loss_problem(self.fn, returned, mask)
        if problem is not None:
            raise ValueError(problem)
        pg_losses, metrics = returned
        if self.rollout_is is not None:
            weights, is_metrics = rollout_is_weights(
                old, mb["rollout_log_prob"], mask, self.rollout_is, self.threshold,
                self.threshold_lower)
            pg_losses, metrics = pg_losses * weights, {**metrics, **is_metrics}
        return agg_loss(pg_losses, mask, mode, scale), metrics


@dataclass(frozen=True, slots=True)
class ActorLoss:
    """L = L_pg − c_H·H + c_KL·KL(π ‖ π_ref), each aggregated by `mode` (verl's actor)."""

    policy: PolicyLoss
    entropy_coeff: float
    kl_loss_coef: float
    kl_loss_type: str
    mode: str
    """loss_agg_mode."""
    scale: float | None = None
    """loss_scale_factor of seq-mean-token-sum-norm."""
    temperature: float = 1.0
    packing: bool = False

    def __call__(self, model: PreTrainedModel, mb: Batch) -> tuple[Tensor, dict[str, float]]:
        mask, responses = mb["response_mask"], mb["responses"]
        hidden = forward_hidden(model, *(mb[k] for k in SEQUENCES), packing=self.packing)
        # one pass over the head for both; the entropy is in the backward only when in the loss
        out = head_logprob(model.get_output_embeddings(), hidden, responses, mask,
                           temperature=self.temperature, with_entropy=True,
                           entropy_grad=self.entropy_coeff != 0)
        log_prob, entropy_t = out["log_prob"], out["entropy"]
        pg_loss, pg = self.policy(mb, log_prob, self.mode, self.scale)
        entropy = agg_loss(entropy_t, mask, self.mode, self.scale)
        metrics = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy.item()}
        metrics |= {f"actor/{k}": v for k, v in pg.items()}
        loss = pg_loss - self.entropy_coeff * entropy if self.entropy_coeff else pg_loss
        if "ref_log_prob" in mb:
            kl = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], self.kl_loss_type), mask,
                          self.mode, self.scale)
            loss = loss + self.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
        return loss, metrics

    def denominator(self, mb: Batch) -> float:
        return _agg_size(self.mode, mb["response_mask"])

    def held_out(self, model: PreTrainedModel, batch: Batch) -> dict[str, float]:
        """`log_ratio_to_ref`, the mean over valid tokens of log π − log π_ref, when
        `ref_log_prob` is wired. The executor reads it from an actor log-prob node when
        the graph has one; with that forward elided (pass `on_policy`), from here."""
        if "ref_log_prob" not in batch:
            return {}
        log_prob = logprob(model, batch["prompts"], batch["prompt_mask"], batch["responses"],
                           batch["response_mask"], temperature=self.temperature,
                           packing=self.packing)["log_prob"]
        return {"log_ratio_to_ref": masked_mean(log_prob - batch["ref_log_prob"],
                                                batch["response_mask"]).item()}


def ppo_actor_update(
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    advantages: Tensor,
    old_log_prob: Tensor | None = None,
    ref_log_prob: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
    policy_loss: LossFunction | str = vanilla,
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
    packing: bool = False,
    loss_agg_mode: str = "token-mean",
) -> Update:
    """Dual-clip PPO on the actor (a causal LM); all tensors (B, P) or (B, T).

    Log-probs are recomputed at `temperature` (the rollout's: verl passes it to the
    actor the same way; 0, greedy, scores at 1). A wired `ref_log_prob` adds GRPO's KL
    loss. Without `old_log_prob` (pass `on_policy`) the update must take one optimizer
    step, whose own log-probs, detached, are π_old's. Metrics: actor/{pg_loss,
    pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, kl_loss (with ref_log_prob),
    grad_norm, lr}; held out, log_ratio_to_ref (with ref_log_prob).
    """
    batch = dict(zip(SEQUENCES, (prompts, prompt_mask, responses, response_mask), strict=True))
    batch["advantages"] = advantages
    for name, value in (("old_log_prob", old_log_prob), ("ref_log_prob", ref_log_prob),
                        ("rollout_log_prob", rollout_log_prob)):
        if value is not None:
            batch[name] = value
    if rollout_is is not None and rollout_log_prob is None:
        raise ValueError(f"ppo_actor_update: rollout_is={rollout_is!r} weighs by pi_old / "
                         "pi_rollout: wire generate's rollout_log_prob")
    clip = {"clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high,
            "clip_ratio_c": clip_ratio_c}
    policy = replace(PolicyLoss.of(policy_loss, dict(policy_loss_params or {}), clip),
                     rollout_is=rollout_is, threshold=rollout_is_threshold,
                     threshold_lower=rollout_is_threshold_lower)
    loss = ActorLoss(policy, entropy_coeff, kl_loss_coef, kl_loss_type, loss_agg_mode,
                     loss_scale_factor, temperature, packing)
    one_step = "" if old_log_prob is not None else (
        "without old_log_prob it takes its own log-probs as the old policy's, which holds "
        "for one optimizer step only: wire old_log_prob")
    return Update(batch, loss, one_step=one_step)


# --------------------------------------------------------------------------- PPO critic


@dataclass(frozen=True, slots=True)
class CriticLoss:
    """½·agg(max((v̂ − R)², (clip(v̂, V ± c) − R)²)) with v̂ recomputed with grad."""

    cliprange_value: float
    mode: str
    """loss_agg_mode."""
    packing: bool = False

    def __call__(self, critic: ValueModel, mb: Batch) -> tuple[Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        vpreds = predict_values(critic, mb["prompts"], mb["prompt_mask"], mb["responses"],
                                mb["response_mask"], packing=self.packing)["values"]
        loss, clipfrac = value_loss(vpreds, mb["values"], mb["returns"], mask,
                                    self.cliprange_value, self.mode)
        return loss, {
            "critic/vf_loss": loss.item(),
            "critic/vf_clipfrac": clipfrac,
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask).item(),
        }

    def denominator(self, mb: Batch) -> float:
        return _agg_size(self.mode, mb["response_mask"])

    def held_out(self, critic: ValueModel, batch: Batch) -> dict[str, float]:
        """Nothing: the critic's held-out values are the `values` node's metrics."""
        return {}


def ppo_critic_update(
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    values: Tensor,
    returns: Tensor,
    cliprange_value: float = 0.5,
    packing: bool = False,
    loss_agg_mode: str = "token-mean",
) -> Update:
    """Clipped value regression of the critic (a `ValueModel`) onto `returns`.

    `values` (B, T) are the rollout-time values V, the centre of the clip. Metrics:
    critic/{vf_loss, vf_clipfrac, vpred_mean, grad_norm, lr}.
    """
    batch = dict(zip(SEQUENCES, (prompts, prompt_mask, responses, response_mask), strict=True))
    batch |= {"values": values, "returns": returns}
    return Update(batch, CriticLoss(cliprange_value, loss_agg_mode, packing), scope="critic")


# --------------------------------------------------------------------------- DPO


@dataclass(frozen=True, slots=True)
class DPOLoss:
    """Mean DPO loss over the pairs; chosen and rejected share one forward pass (TRL).
    log π(y|x) is the sum over the valid response tokens (`sequence_logprob`)."""

    beta: float
    loss_type: str
    label_smoothing: float
    packing: bool = False

    def __call__(self, model: PreTrainedModel, mb: Batch) -> tuple[Tensor, dict[str, float]]:
        n = len(mb["prompts"])
        logps = sequence_logprob(
            model,
            mb["prompts"].repeat(2, 1),
            mb["prompt_mask"].repeat(2, 1),
            torch.cat([mb["chosen"], mb["rejected"]]),
            torch.cat([mb["chosen_mask"], mb["rejected_mask"]]),
            packing=self.packing,
        )["log_prob"]
        losses, chosen, rejected = dpo_loss(logps[:n], logps[n:], mb["ref_chosen_logps"],
                                            mb["ref_rejected_logps"], self.beta,
                                            self.loss_type, self.label_smoothing)
        loss = losses.mean()
        return loss, {
            "actor/dpo_loss": loss.item(),
            "rewards/chosen": chosen.mean().item(),
            "rewards/rejected": rejected.mean().item(),
            "rewards/accuracies": (chosen > rejected).float().mean().item(),
            "rewards/margins": (chosen - rejected).mean().item(),
        }

    def denominator(self, mb: Batch) -> float:
        return float(len(mb["prompts"]))  # a mean over pairs

    def held_out(self, model: PreTrainedModel, batch: Batch) -> dict[str, float]:
        return self(model, batch)[1]


def dpo_update(
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
    packing: bool = False,
) -> Update:
    """DPO on the policy: prompts (B, P), chosen/rejected (B, T), ref logps (B,).

    Metrics (TRL names): actor/dpo_loss, rewards/{chosen, rejected, accuracies,
    margins}, actor/{grad_norm, lr}; the same (but the last two) held out.
    """
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
    return Update(batch, DPOLoss(beta, loss_type, label_smoothing, packing),
                  responses=("chosen_mask", "rejected_mask"))


# --------------------------------------------------------------------------- SFT


@dataclass(frozen=True, slots=True)
class SFTLoss:
    """−log π(y_t | x, y_<t) over the trained response tokens (`loss_mask`: a
    conversation's assistant turns), aggregated by `mode`."""

    mode: str
    """loss_agg_mode."""
    packing: bool = False

    def __call__(self, model: PreTrainedModel, mb: Batch) -> tuple[Tensor, dict[str, float]]:
        log_prob = logprob(model, mb["prompts"], mb["prompt_mask"], mb["responses"],
                           mb["response_mask"], packing=self.packing)["log_prob"]
        loss = agg_loss(-log_prob, mb["loss_mask"], self.mode)
        return loss, {"sft/loss": loss.item()}

    def denominator(self, mb: Batch) -> float:
        return _agg_size(self.mode, mb["loss_mask"])

    def held_out(self, model: PreTrainedModel, batch: Batch) -> dict[str, float]:
        return self(model, batch)[1]


def sft_update(
    *,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    loss_mask: Tensor | None = None,
    packing: bool = False,
    loss_agg_mode: str = "token-mean",
) -> Update:
    """Supervised fine-tuning: the cross-entropy of each trained response token
    (`loss_mask`, default every valid one) given the prompt and the tokens before it;
    prompt tokens carry no loss (HF's labels = -100), nor do the user turns inside a
    multi-turn response. token-mean is Hugging Face's / verl's SFT loss. Metrics:
    sft/loss, actor/{grad_norm, lr}; sft/loss held out."""
    # The trained tokens are those `loss_mask` marks among the valid response tokens
    # (a padding position has no log-prob to train).
    trained = response_mask if loss_mask is None else loss_mask * response_mask
    batch = dict(zip(SEQUENCES, (prompts, prompt_mask, responses, response_mask), strict=True))
    batch["loss_mask"] = trained
    return Update(batch, SFTLoss(loss_agg_mode, packing))
