"""The KL reward penalty: token rewards = token scores − β·KL(π_old ‖ π_ref) per token.

As verl's `ray_trainer.apply_kl_penalty` (Ziegler et al. 2019, eq. 2; Stiennon et al.
2020), with the KL estimated per token by `losses.kl_penalty` (k1 `kl`, `abs`, k2
`mse`, k3 `low_var_kl`):

    KL_t = m_t · k(log π_old(y_t), log π_ref(y_t)),    r_t = s_t − β·KL_t

β is fixed (`FixedKLController`), or adaptive when `target_kl` is set
(`AdaptiveKLController`, Ziegler et al. 2019 §2.2): after this batch uses β,

    e = clip(KL̄ / target_kl − 1, −0.2, 0.2),    β ← β·(1 + e·B / horizon)

with KL̄ the batch mean of the per-sequence masked-mean KL. The adaptive β lives in
`ctx.state["kl_coef"]` (a float, checkpointed with the run); `kl_coef` is only its
starting value.

Notation: B sequences, T response length, m response mask (B, T), β KL coefficient.
"""

from __future__ import annotations

from torch import Tensor

from flowgraph.nodes._agg import masked_mean
from flowgraph.nodes.losses import AdaptiveKLController, FixedKLController
from flowgraph.nodes.losses import kl_penalty as kl_estimate
from flowgraph.runtime import NodeContext

__all__ = ["kl_penalty"]

STATE_KEY = "kl_coef"
"""The key of the adaptive coefficient in `NodeContext.state`."""


def _controller(
    ctx: NodeContext, kl_coef: float, target_kl: float | None, horizon: int
) -> FixedKLController | AdaptiveKLController:
    if target_kl is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(ctx.state.get(STATE_KEY, kl_coef), target_kl, horizon)


def kl_penalty(
    ctx: NodeContext,
    *,
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_coef: float = 0.001,
    penalty: str = "kl",
    target_kl: float | None = None,
    horizon: int = 10000,
) -> dict[str, Tensor]:
    """token_level_rewards (B, T) = scores − β·KL, and the masked per-token KL (B, T).

    `log_prob` is the rollout policy's (old) log-prob, `ref_log_prob` the reference's.
    Metrics: `actor/reward_kl_penalty` (KL̄) and `actor/reward_kl_penalty_coeff` (β used).
    """
    if token_level_scores.shape != response_mask.shape:
        raise ValueError(
            f"kl_penalty: token_level_scores {tuple(token_level_scores.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must both be (B, T); place an "
            f"outcome score on the tokens with a `token_reward` node first."
        )
    kl = kl_estimate(log_prob, ref_log_prob, penalty) * response_mask
    controller = _controller(ctx, kl_coef, target_kl, horizon)
    beta = controller.value
    # verl: the mean over sequences of each sequence's masked-mean KL.
    current_kl = float(masked_mean(kl, response_mask, dim=-1).mean())
    controller.update(current_kl, n_steps=len(response_mask))
    if target_kl is not None:
        ctx.state[STATE_KEY] = controller.value
    ctx.metrics["actor/reward_kl_penalty"] = current_kl
    ctx.metrics["actor/reward_kl_penalty_coeff"] = beta
    return {"token_level_rewards": token_level_scores - beta * kl, "kl": kl}
