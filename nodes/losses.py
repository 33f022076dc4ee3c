"""Policy, value, KL and preference losses for RL post-training (pure torch).

Token-level losses take (B, T) tensors plus a 0/1 ``response_mask`` and reduce
them with :func:`flowgraph.nodes._agg.agg_loss`, so every loss honours the
same ``loss_agg_mode`` values ("token-mean", "seq-mean-token-sum",
"seq-mean-token-mean"). Returned metrics are detached Python floats, ready to
log. Semantics follow verl (``verl/trainer/ppo/core_algos.py``) and TRL
(``DPOTrainer.dpo_loss``).

Notation:
    B  number of sequences (or preference pairs for DPO) in the batch
    T  response length in tokens (padded)
    V  vocabulary size (last dim of logits)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from flowgraph.choices import DPO_LOSS_TYPES, KL_ALIASES, KL_ESTIMATORS, LOSS_AGG_MODES
from flowgraph.nodes._agg import agg_loss, masked_mean
from flowgraph.nodes.policy_losses import vanilla

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "dpo_loss",
    "entropy_from_logits",
    "kl_penalty",
    "ppo_policy_loss",
    "value_loss",
]



def _check_same_shapes(fn: str, **tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(
            f"{fn}: all inputs must share one shape; got {listed}. "
            "Align them to the same tokens/pairs."
        )


def _check_mode(fn: str, mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"{fn}: unknown loss_agg_mode {mode!r}; valid modes are {', '.join(LOSS_AGG_MODES)}."
        )


def _metric(x: Tensor) -> float:
    return float(x.detach().item())


def _fraction(condition: Tensor, mask: Tensor, like: Tensor) -> float:
    """Masked mean of a boolean condition, in at least float32 precision."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    return _metric(masked_mean(condition.to(dtype), mask))


def ppo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, float]]:
    """Dual-clip PPO policy loss.

    ρ = exp(clamp(logπ − logπ_old, ±20));  L1 = −Aρ;  L2 = −A·clip(ρ, 1−ε_lo, 1+ε_hi)
    L = max(L1, L2) for A ≥ 0;  L = min(max(L1, L2), −A·c) for A < 0.
    metrics: pg_clipfrac = mean_m[L2 > L1], pg_clipfrac_lower =
    mean_m[max(L1, L2) > −A·c ∧ A < 0], ppo_kl = mean_m[logπ_old − logπ].
    """
    # Schulman et al. 2017 (PPO); Ye et al. 2019 (dual-clip);
    # verl core_algos.compute_policy_loss
    fn = "ppo_policy_loss"
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"{fn}: clip_ratio_c (dual-clip bound on the ratio for A < 0) must be > 1; "
            f"got {clip_ratio_c}. Use e.g. 3.0."
        )
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"{fn}: clip ratios must be >= 0; got low={clip_ratio_low}, high={clip_ratio_high}."
        )
    _check_mode(fn, loss_agg_mode)
    _check_same_shapes(
        fn,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
    )
    pg_losses, metrics = vanilla(old_log_prob, log_prob, advantages, response_mask,
                                 clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


def value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, float]:
    """Clipped value loss: ½·agg(max((v̂ − R)², (clip(v̂, V − c, V + c) − R)²)).

    ``values`` are the rollout-time critic values V, ``vpreds`` the current
    predictions v̂. Returns (loss, clipfrac) with clipfrac = mean_m[clipped term larger].
    """
    # Schulman et al. 2017 (PPO value clipping); verl core_algos.compute_value_loss
    fn = "value_loss"
    if cliprange_value < 0:
        raise ValueError(
            f"{fn}: cliprange_value must be >= 0; got {cliprange_value}. Use e.g. 0.5."
        )
    _check_mode(fn, loss_agg_mode)
    _check_same_shapes(
        fn, vpreds=vpreds, values=values, returns=returns, response_mask=response_mask
    )
    vpred_clipped = torch.maximum(
        torch.minimum(vpreds, values + cliprange_value), values - cliprange_value
    )
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode)
    with torch.no_grad():
        clipfrac = _fraction(vf_losses2 > vf_losses1, response_mask, vf_losses1)
    return loss, clipfrac


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy over the last dim, (..., V) → (...): H = logsumexp(z) − Σ softmax(z)·z."""
    # verl utils.torch_functional.entropy_from_logits
    if logits.dim() < 1:
        raise ValueError(
            "entropy_from_logits: logits must have a vocabulary dim (..., V); got a 0-d tensor."
        )
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    kl (k1): logπ − logπ_ref;  abs: |logπ − logπ_ref|;  mse (k2): ½(logπ − logπ_ref)²;
    low_var_kl (k3): e^d − d − 1 with d = clamp(logπ_ref − logπ, ±20), result clamped to [−10, 10].
    """
    # Schulman 2020 "Approximating KL divergence" (k1/k2/k3); verl core_algos.kl_penalty
    fn = "kl_penalty"
    name = KL_ALIASES.get(kind, kind)
    if name not in KL_ESTIMATORS:
        raise ValueError(
            f"{fn}: unknown kind {kind!r}; valid kinds are {', '.join(KL_ESTIMATORS)} "
            f"(aliases {', '.join(KL_ALIASES)})."
        )
    _check_same_shapes(fn, log_prob=log_prob, ref_log_prob=ref_log_prob)
    if name == "kl":
        return log_prob - ref_log_prob
    if name == "abs":
        return (log_prob - ref_log_prob).abs()
    if name == "mse":
        return 0.5 * (log_prob - ref_log_prob).square()
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)


def _load_floats(cls: str, state: Mapping[str, float], keys: tuple[str, ...]) -> dict[str, float]:
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(
            f"{cls}.load_state_dict: missing keys {missing}; expected {list(keys)}, "
            f"got {sorted(state)}. "
            f"Pass the dict returned by {cls}.state_dict()."
        )
    return {k: float(state[k]) for k in keys}


class FixedKLController:
    """Constant KL coefficient β; ``update`` is a no-op."""

    # Ziegler et al. 2019 (fixed β baseline); verl core_algos.FixedKLController

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"FixedKLController: kl_coef must be >= 0; got {kl_coef}.")
        self.value: float = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep β unchanged (signature shared with AdaptiveKLController)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = _load_floats("FixedKLController", state, ("value",))["value"]


class AdaptiveKLController:
    """Adaptive KL coefficient: e = clip(KL/KL_target − 1, ±0.2); β ← β·(1 + e·n_steps/horizon)."""

    # Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2;
    # verl core_algos.AdaptiveKLController

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(
                f"AdaptiveKLController: init_kl_coef must be >= 0; got {init_kl_coef}."
            )
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                "AdaptiveKLController: target_kl and horizon must be > 0; "
                f"got target_kl={target_kl}, "
                f"horizon={horizon}. Typical values: target_kl=0.1, horizon=10000."
            )
        self.value: float = float(init_kl_coef)
        self.target_kl: float = float(target_kl)
        self.horizon: float = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """β ← β·(1 + clip(current_kl/target_kl − 1, −0.2, 0.2)·n_steps/horizon)."""
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0; got {n_steps}.")
        proportional_error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        loaded = _load_floats("AdaptiveKLController", state, ("value", "target_kl", "horizon"))
        if loaded["target_kl"] <= 0 or loaded["horizon"] <= 0:
            raise ValueError(
                "AdaptiveKLController.load_state_dict: target_kl and horizon must be > 0; "
                f"got {loaded}."
            )
        self.value, self.target_kl, self.horizon = (
            loaded["value"],
            loaded["target_kl"],
            loaded["horizon"],
        )


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair preference loss and implicit rewards, all (B,).

    h = (logπ_c − logπ_r) − (logπ_ref,c − logπ_ref,r)
    sigmoid: −(1−ls)·logσ(βh) − ls·logσ(−βh);  ipo: (h − 1/(2β))²;  hinge: relu(1 − βh)
    chosen_rewards = β(logπ_c − logπ_ref,c) (detached); rejected likewise.
    """
    # Rafailov et al. 2023 (DPO); Azar et al. 2023 (IPO); cDPO label smoothing;
    # TRL DPOTrainer.dpo_loss
    fn = "dpo_loss"
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"{fn}: unknown loss_type {loss_type!r}; "
            f"valid loss types are {', '.join(DPO_LOSS_TYPES)}."
        )
    if beta <= 0:
        raise ValueError(f"{fn}: beta must be > 0; got {beta}. Typical values are 0.1-0.5.")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"{fn}: label_smoothing must lie in [0, 0.5]; got {label_smoothing}.")
    if label_smoothing > 0 and loss_type != "sigmoid":
        raise ValueError(
            f"{fn}: label_smoothing only applies to loss_type='sigmoid'; "
            f"got {label_smoothing} with "
            f"loss_type={loss_type!r}. Set label_smoothing=0."
        )
    _check_same_shapes(
        fn,
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * logits)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards
