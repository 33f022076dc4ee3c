"""Policy losses of `ppo_actor_update`, by the names of verl 0.9.1's `core_algos`.

Every loss has one signature and returns the per-token loss and its metrics; the update
applies the rollout-correction weights and aggregates (`loss_agg_mode`), so a loss is
only its formula:

    loss(old_log_prob, log_prob, advantages, response_mask, **params)
        -> (pg_losses (B, T), metrics {name: float})

with ρ_t = π_θ(y_t) / π_old(y_t) and A the advantages:

* `vanilla`  — PPO's clipped objective with dual clip for A < 0 (Schulman et al. 2017;
  Ye et al. 2019): max(−Aρ, −A·clip(ρ, 1−ε_lo, 1+ε_hi)), capped at −A·c when A < 0.
* `gspo`     — GSPO (Zheng et al. 2025): the ratio of the sequence, s_i = exp(mean_t
  log ρ_t), clipped as PPO's, with the token gradient of log π_θ(y_t).
* `cispo`    — CISPO (MiniMax 2025): −sg[clip(ρ, 1−ε_lo, 1+ε_hi)]·A·log π_θ: the clip
  weighs the gradient instead of dropping it.
* `gpg`      — GPG (Chu et al. 2025): −A·log π_θ, no ratio.
* `clip_cov` — Clip-Cov (Cui et al. 2025): PPO's objective with the gradient of a random
  `clip_cov_ratio` share of the tokens whose centred cov(A, log π) lies in
  (clip_cov_lb, clip_cov_ub) cut off (the global RNG draws them, as verl).
* `kl_cov`   — KL-Cov (Cui et al. 2025): −Aρ, plus ppo_kl_coef·|log ρ| on the
  `kl_cov_ratio` share of tokens of largest cov(A, log π).

A loss of your own is a function of the same signature registered with
`@flowgraph.registry.policy_loss("name")`; its keyword params (with defaults) are what
`policy_loss_params` may set, checked before launch.

Notation: B sequences, T response length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowgraph.nodes._agg import masked_mean

__all__ = ["cispo", "clip_cov", "gpg", "gspo", "kl_cov", "rollout_is_weights", "vanilla"]

Metrics = dict[str, float]


def _mean(x: Tensor, mask: Tensor, like: Tensor | None = None) -> float:
    """Masked mean as a float, in at least float32 (a bool condition: in `like`'s dtype)."""
    dtype = torch.promote_types((like if x.dtype == torch.bool and like is not None
                                 else x).dtype, torch.float32)
    return float(masked_mean(x.detach().to(dtype), mask).item())


def vanilla(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
            clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
            clip_ratio_c: float = 3.0) -> tuple[Tensor, Metrics]:
    """Dual-clip PPO per token; metrics pg_clipfrac, pg_clipfrac_lower, ppo_kl."""
    # verl core_algos.compute_policy_loss_vanilla
    if clip_ratio_c <= 1.0:
        raise ValueError(f"vanilla: clip_ratio_c (dual-clip bound for A < 0) must be > 1; "
                         f"got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss3, clipped), clipped)
    return pg_losses, {
        "pg_clipfrac": _mean(loss2 > loss1, response_mask, log_prob),
        "pg_clipfrac_lower": _mean((clipped > loss3) & negative, response_mask, log_prob),
        "ppo_kl": _mean(-log_ratio, response_mask),
    }


def gspo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
         clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[Tensor, Metrics]:
    """s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)], clipped as PPO's; verl's recommended
    aggregation is seq-mean-token-mean and clip ratios 3e-4 / 4e-4."""
    # Zheng et al. 2025 (GSPO) eq. 7-10; verl core_algos.compute_policy_loss_gspo
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.sum(-1).clamp(min=1)
    seq_log_ratio = (log_ratio * response_mask).sum(-1) / lengths
    log_s = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None], max=10.0)
    s = torch.exp(log_s)
    loss1 = -advantages * s
    loss2 = -advantages * torch.clamp(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(loss1, loss2), {
        "pg_clipfrac": _mean(loss2 > loss1, response_mask, log_prob),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _mean(-log_ratio, response_mask),
    }


def cispo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
          clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> tuple[Tensor, Metrics]:
    """−sg[clip(ρ)]·A·log π_θ per token."""
    # MiniMax-M1 2025 (CISPO) eq. 4; verl core_algos.compute_policy_loss_cispo
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return -clipped.detach() * advantages * log_prob, {
        "pg_clipfrac": _mean(ratio != clipped, response_mask, log_prob),
        "pg_clipfrac_lower": 0.0,
        "ppo_kl": _mean(-log_ratio, response_mask),
    }


def gpg(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor
        ) -> tuple[Tensor, Metrics]:
    """−A·log π_θ per token (no importance ratio, no clip)."""
    # Chu et al. 2025 (GPG); verl core_algos.compute_policy_loss_gpg
    return -log_prob * advantages, {}


def _centred_cov(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """(A − mean A)·(log π − mean log π) per token, means over the valid tokens."""
    return ((advantages - masked_mean(advantages, mask))
            * (log_prob - masked_mean(log_prob.detach(), mask)))


def clip_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
             clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
             clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0,
             clip_cov_ub: float = 5.0) -> tuple[Tensor, Metrics]:
    """PPO's clipped loss with a random `clip_cov_ratio` share of the unclipped tokens of
    covariance in (lb, ub) zeroed (at least one token)."""
    # Cui et al. 2025 (The Entropy Mechanism of RL for LLMs), Clip-Cov;
    # verl core_algos.compute_policy_loss_clip_cov
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov: clip_cov_ratio must be > 0; got {clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    valid = response_mask > 0
    cov = _centred_cov(advantages, log_prob, response_mask)
    candidates = (cov < clip_cov_ub) & (cov > clip_cov_lb) & valid & ~((loss2 > loss1) & valid)
    where = torch.nonzero(candidates)
    count = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    if len(where):
        where = where[torch.randperm(len(where))[:count]]
    keep = torch.ones_like(advantages)
    keep[where[:, 0], where[:, 1]] = 0
    return torch.maximum(loss1, loss2) * keep, {
        "pg_clipfrac": _mean(keep == 0, response_mask, log_prob),
        "ppo_kl": _mean(-log_ratio, response_mask),
    }


def kl_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
           kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 1.0) -> tuple[Tensor, Metrics]:
    """−Aρ per token, plus ppo_kl_coef·|log ρ| on the top `kl_cov_ratio` share of the
    valid tokens by covariance (at least one)."""
    # Cui et al. 2025, KL-Cov; verl core_algos.compute_policy_loss_kl_cov
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov: kl_cov_ratio must be > 0; got {kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    valid = (response_mask > 0).reshape(-1)
    index = torch.nonzero(valid, as_tuple=True)[0]
    adv = advantages.detach().reshape(-1)[index].cpu()
    logp = log_prob.detach().reshape(-1)[index].cpu()
    if len(index):
        cov = (adv - adv.mean()) * (logp - logp.mean())
        top = index[torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio))).indices]
        flat = pg_losses.reshape(-1).clone()
        flat[top] = flat[top] + ppo_kl_coef * log_ratio.abs().reshape(-1)[top]
        pg_losses = flat.reshape(pg_losses.shape)
    return pg_losses, {"ppo_kl": _mean(log_ratio.abs(), response_mask)}


def rollout_is_weights(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor,
                       level: str, threshold: float, threshold_lower: float | None
                       ) -> tuple[Tensor, Metrics]:
    """Importance weights π_old / π_rollout (B, T), detached, for a rollout engine whose
    probabilities differ from the trainer's: per token or per sequence (the product),
    truncated at `threshold` (TIS), or with `threshold_lower` set zero outside
    [lower, threshold] (masked IS, IcePop)."""
    # Yao et al. 2025 (TIS), IcePop; verl rollout_corr_helper.compute_rollout_correction_weights
    log_ratio = old_log_prob - rollout_log_prob
    if level == "sequence":
        log_ratio = (log_ratio * response_mask).sum(-1, keepdim=True).expand_as(old_log_prob)
    elif level != "token":
        raise ValueError(f"rollout_correction: level must be token or sequence; got {level!r}")
    raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0)) * response_mask
    if threshold_lower is None:
        weights = raw.clamp(max=threshold)
        cut = raw > threshold
    else:
        cut = (raw < threshold_lower) | (raw > threshold)
        weights = torch.where(cut, torch.zeros_like(raw), raw)
    return weights.detach(), {"rollout_is/mean": _mean(weights, response_mask),
                              "rollout_is/cut_frac": _mean(cut, response_mask, weights)}
