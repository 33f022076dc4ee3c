"""Advantage estimators for RL post-training of LLMs (pure torch, vectorised).

Every estimator returns ``(advantages, returns)``, both (B, T) in the dtype of
the rewards/scores and exactly zero where ``response_mask`` is 0. None of them
loops in Python over time steps or over groups: recurrences along T are solved
with a chunked discount-matrix formulation (two small matmuls, O(B·T·L) work
for chunk length L) in float64, or float32 for ``gae``, whose λ-return form
needs no more, and per-group statistics use
``unique(return_inverse=True)`` + ``index_add_``. Like verl, they run under
``torch.no_grad()``: advantages are regression/PG targets, not differentiable.

Semantics follow verl's ``verl/trainer/ppo/core_algos.py`` (token-level
estimators) except that outputs are zeroed on masked positions, where verl
leaves carried-over values.

Notation:
    B  number of sequences (responses) in the batch
    T  response length in tokens (padded)
    G  number of distinct prompt groups in ``index``
    m  response_mask (B, T): 1 for response tokens that count, 0 for padding
       or for tokens to skip (e.g. tool observations in the middle)

One module past ~450 lines, on purpose: the estimators share their vectorised helpers
(group statistics, discount matrices), as verl's `core_algos` holds them together.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "remax", "rloo"]

_CHUNK = 32  # chunk length L of the discount-matrix scan (tuned on 2 CPU cores)
_ONE_CHUNK = 128  # up to this length the scan is one (T × T) matmul, without recursion


# --------------------------------------------------------------------------- checks


def _check_bt(fn: str, name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(
            f"{fn}: {name} must be 2-D (B, T); got shape {tuple(x.shape)}. "
            "Pad/stack the responses first."
        )


def _check_float(fn: str, name: str, x: Tensor) -> None:
    if not x.dtype.is_floating_point:
        raise ValueError(
            f"{fn}: {name} must be a floating tensor; got dtype {x.dtype}. "
            "Convert it with .float()."
        )


def _check_like(fn: str, name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(
            f"{fn}: {name} must have the same shape as {ref_name} {tuple(ref.shape)}; "
            f"got {tuple(x.shape)}. Align both to the same (B, T) response tokens."
        )


def _valid_mask(fn: str, response_mask: Tensor) -> Tensor:
    """Check a (B, T) 0/1 mask and return it as bool."""
    _check_bt(fn, "response_mask", response_mask)
    if response_mask.dtype == torch.bool:
        return response_mask
    mask = response_mask
    if mask.dtype.is_floating_point:
        # m·m − m is exactly 0 for 0 and 1 and non-zero or nan for any other value
        # (±inf included); on CPU this is several times cheaper than m.ne(m.bool()).
        binary = not bool(mask.mul(mask).sub_(mask).abs_().sum())
    else:
        binary = not bool(mask.ne(mask.bool()).any())
    if not binary:
        raise ValueError(
            f"{fn}: response_mask must hold only 0/1 (or be bool); got values in "
            f"[{response_mask.min().item()}, {response_mask.max().item()}]. "
            "Binarise it, e.g. mask > 0."
        )
    return mask.bool()


def _check_per_seq(fn: str, name: str, x: Tensor, batch: int) -> None:
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(
            f"{fn}: {name} must be 1-D (B,) with B={batch} (rows of response_mask); "
            f"got shape {tuple(x.shape)}. Pass one value per response "
            "(sum the token rewards if needed)."
        )


def _check_unit(fn: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{fn}: {name} must lie in [0, 1]; got {value}. "
            "Use a discount/decay factor such as 0.99."
        )


def _group_inverse(fn: str, index: Tensor, batch: int) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to 0..G-1 (no loop over groups)."""
    _check_per_seq(fn, "index", index, batch)
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ValueError(
            f"{fn}: index must be an integer tensor of group ids; got dtype {index.dtype}. "
            "Map prompt uids to ints, e.g. torch.unique(..., return_inverse=True)."
        )
    uniq, inverse = torch.unique(index, return_inverse=True)
    return inverse, int(uniq.numel())


# --------------------------------------------------------------------------- kernels


@functools.lru_cache(maxsize=64)
def _discount_matrix(c: float, size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Dᵀ for D[i, j] = c^{j−i} if j ≥ i else 0, (size, size) in ``dtype``; treat as read-only.

    The powers are taken in float64 and rounded once to ``dtype``.
    """
    k = torch.arange(size, dtype=torch.float64, device=device)
    lag = k[None, :] - k[:, None]  # lag[i, j] = j − i
    powers = torch.tensor(c, dtype=torch.float64, device=device) ** lag.clamp_min(0)
    matrix = torch.where(lag >= 0, powers, torch.zeros_like(powers)).T
    return matrix.to(dtype).contiguous()


def _discounted_reverse_cumsum(x: Tensor, c: float) -> Tensor:
    """y_t = Σ_{s≥t} c^{s−t} x_s along the last dim of a (B, T) floating tensor.

    Chunked discount-matrix scan: within a chunk of length L, y = x·Dᵀ with
    D[i, j] = c^{j−i} (j ≥ i) (one (B·T/L, L) × (L, L) matmul). The chunk heads
    h_n = y at the first position of chunk n then obey the same recurrence with
    factor c^L over T/L steps, solved by recursion (depth log_L T; a length up to
    ``_ONE_CHUNK`` is a single chunk), and the head of chunk n+1 is carried into
    chunk n as c^{L−i}·y_{head(n+1)}. Only
    non-negative powers of c appear, so nothing overflows for c ≤ 1 and
    underflow merely drops negligible terms.
    """
    batch, length = x.shape
    if length == 0:
        return x.clone()
    chunk = length if length <= _ONE_CHUNK else _CHUNK
    n_chunks = -(-length // chunk)
    padded = x if n_chunks * chunk == length else F.pad(x, (0, n_chunks * chunk - length))
    xs = padded.reshape(batch * n_chunks, chunk)
    out = (xs @ _discount_matrix(c, chunk, x.device, x.dtype)).view(batch, n_chunks, chunk)
    if n_chunks > 1:
        heads = _discounted_reverse_cumsum(out[:, :, 0], c**chunk)
        carry = _discount_matrix(c, chunk + 1, x.device, x.dtype)[-1, :-1]  # c^{L−i}
        out.addcmul_(F.pad(heads[:, 1:], (0, 1)).unsqueeze(-1), carry)
    return out.view(batch, n_chunks * chunk)[:, :length]


def _lambda_returns(
    rewards: Tensor, values: Tensor, weight: Tensor, gamma: float, lam: float
) -> Tensor:
    """(B, T) λ-returns over the valid tokens (weight 1), 0 on masked ones (skipped).

    R_t = r_t + γ·((1 − λ)·V_{n(t)} + λ·R_{n(t)}) with n(t) the next valid token
    (V = R = 0 past the last); R − V is GAE's advantage, whose δ's telescope into
    this form (Sutton & Barto 2018, §12.1). Summing r and (1 − λ)·V avoids the
    cancellation of Σ(γ·V_{t+1} − V_t), so float32 suffices.

    Each row's valid tokens are compacted to the front first: the k-th valid token
    goes to slot k − 1, so n(t) is the next slot and the recurrence has the constant
    factor γλ of ``_discounted_reverse_cumsum``; slots past a row's last valid
    token stay 0. Masked tokens go to slot T, which no valid token reaches: it is
    zeroed after the scatter, so the scan gives 0 there and the way back reads 0.
    """
    length = rewards.shape[1]
    # slot = k − 1 for the k-th valid token, T for masked ones (the count is exact in float)
    slot = weight.cumsum(dim=-1).sub_(length + 1).mul_(weight).add_(length).long()
    width = -(-(length + 1) // _CHUNK) * _CHUNK  # room for slot T, no padding in the scan
    scan_in = _compact(rewards, slot, width)
    if lam != 1:  # r_k + γ(1 − λ)·V_{k+1}; with λ = 1 the values drop out
        scan_in.add_(_compact(values, slot, width + 1)[:, 1:], alpha=gamma * (1 - lam))
    returns_c = _discounted_reverse_cumsum(scan_in, gamma * lam)
    del scan_in  # before the gather allocates: a lower peak touches fewer fresh pages
    return returns_c.gather(1, slot)


def _compact(x: Tensor, slot: Tensor, width: int) -> Tensor:
    """Scatter x (B, T) by slot into zeros (B, width); column T, the masked tokens', stays 0."""
    out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device).scatter_(1, slot, x)
    out[:, x.shape[1]] = 0
    return out


def _episodes(fn: str, episode: Tensor | None, scores: Tensor) -> Tensor:
    """(B,) bool: the rows that stand for their episode in a group's statistics, the
    first row of each (an agent_rollout's `episode`, -1 on unused rows); every row
    where `episode` is None. ValueError where an episode's rows carry different scores."""
    batch = scores.shape[0]
    if episode is None:
        return torch.ones(batch, dtype=torch.bool, device=scores.device)
    _check_per_seq(fn, "episode", episode, batch)
    ids, inverse = torch.unique(episode.long(), return_inverse=True)
    rows = torch.arange(batch, device=scores.device)
    first = torch.full((ids.numel(),), batch, dtype=torch.long, device=scores.device)
    first = first.scatter_reduce_(0, inverse, rows, "amin")[inverse]
    used = episode >= 0
    differ = used & (scores != scores[first])
    if bool(differ.any()):
        k = int(differ.nonzero()[0])
        raise ValueError(
            f"{fn}: rows {int(first[k])} and {k} are one episode ({int(episode[k])}) with "
            f"scores {float(scores[first[k]])} and {float(scores[k])}: an episode's rows "
            "share its score (agent_rollout's `scores`); score episodes, not rows")
    return used & (first == rows)


def _group_stats(x: Tensor, inverse: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, mean, unbiased std); a singleton group gets mean 0, std 1 (verl)."""
    count = torch.zeros(groups, dtype=x.dtype, device=x.device).index_add_(
        0, inverse, torch.ones_like(x)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, x)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    single = count < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count, mean, std


def _whiten_valid(fn: str, x: Tensor, weight: Tensor) -> Tensor:
    """``masked_whiten(x, weight) · weight`` (_agg), in place, for an x that is 0 off the mask:
    the whitening of every estimator here.

    verl's numbers: its masked means divide by (count + 1e-8), the variance is unbiased
    (× count/(count − 1)), the scale is 1/√(var + 1e-8); one valid token whitens to 0
    (verl raises), none is a ValueError. As x is 0 off the mask, nothing needs
    multiplying by it.
    """
    count = float(weight.sum())
    if count == 0:
        raise ValueError(
            f"{fn}: whitening needs at least 1 valid token; response_mask selects 0. "
            "Pass whiten=False or a batch with response tokens."
        )
    if count == 1:  # its own mean; verl's 1e-8's would leave x·1e-4
        return x.zero_()
    centred = x.sub_(weight, alpha=float(x.sum()) / (count + 1e-8)).flatten()  # where valid
    var = float(torch.dot(centred, centred)) / (count + 1e-8) * count / max(count - 1.0, 1.0)
    return x.mul_(1.0 / math.sqrt(var + 1e-8))


def _broadcast(per_seq: Tensor, valid: Tensor) -> Tensor:
    """(B,) → (B, T): copy the sequence value to its valid tokens, 0 elsewhere."""
    return per_seq[:, None] * valid.to(per_seq.dtype)


# --------------------------------------------------------------------------- estimators


def gae(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation with masked positions skipped.

    δ_t = r_t + γ·V_{n(t)} − V_t,   A_t = δ_t + γλ·A_{n(t)},   R_t = A_t + V_t,
    where n(t) is the next *valid* position after t (V = A = 0 past the last):
    masked positions neither receive nor pass on value. ``advantages`` are
    whitened over valid tokens (unbiased var, eps 1e-8) when ``whiten``;
    a batch with no valid token is a ValueError then (a single one whitens to 0).
    Computed as λ-returns R (``_lambda_returns``), A = R − V, in float32 (float64
    for float64 inputs).
    """
    # Schulman et al. 2016 (GAE); verl core_algos.compute_gae_advantage_return
    fn = "gae"
    _check_bt(fn, "token_level_rewards", token_level_rewards)
    _check_float(fn, "token_level_rewards", token_level_rewards)
    _check_like(fn, "values", values, "token_level_rewards", token_level_rewards)
    _check_like(fn, "response_mask", response_mask, "token_level_rewards", token_level_rewards)
    valid = _valid_mask(fn, response_mask)
    _check_unit(fn, "gamma", gamma)
    _check_unit(fn, "lam", lam)
    with torch.no_grad():
        dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
        values = values.to(dtype)
        weight = response_mask if response_mask.dtype == dtype else valid.to(dtype)
        returns = _lambda_returns(token_level_rewards.to(dtype), values, weight, gamma, lam)
        advantages = torch.addcmul(returns, values, weight, value=-1)  # A = R − V
        if whiten:
            advantages = _whiten_valid(fn, advantages, weight)
        out_dtype = token_level_rewards.dtype
    return advantages.to(out_dtype), returns.to(out_dtype)


def grpo(
    scores: Tensor,
    response_mask: Tensor,
    index: Tensor,
    score_mask: Tensor | None = None,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
    episode: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Group-relative outcome advantage, broadcast to valid tokens.

    A_i = (s_i − mean_g) / (std_g + ε)  (GRPO, ``norm_by_std=True``)
    A_i =  s_i − mean_g                 (Dr.GRPO, ``norm_by_std=False``)
    g = index[i]; std is unbiased (torch.std); a singleton group uses mean 0,
    std 1 as verl does. ``returns`` equals ``advantages`` (verl).

    ``score_mask`` (B,) 0/1, from a reward whose functions all returned None for a row
    (TRL 1.16 `_generate_and_score_completions`): the statistics are over the scored
    rows of each group (TRL's nanmean / nanstd), an unscored row's advantage is 0, and
    so is every row of a group with fewer than 2 scored rows (TRL's nanstd of one value
    is NaN, its advantage then `nan_to_num`'s 0).

    ``episode`` (B,), an agent_rollout's with rows_per_episode > 1: a group's samples
    are its episodes, one row standing for each (`_episodes`); each row of an episode
    gets its advantage, a row of episode -1 (unused) 0.
    """
    # Shao et al. 2024 (GRPO); Liu et al. 2025 (Dr.GRPO);
    # verl core_algos.compute_grpo_outcome_advantage
    fn = "grpo"
    valid = _valid_mask(fn, response_mask)
    _check_per_seq(fn, "scores", scores, valid.shape[0])
    _check_float(fn, "scores", scores)
    inverse, groups = _group_inverse(fn, index, valid.shape[0])
    if epsilon < 0:
        raise ValueError(
            f"{fn}: epsilon must be >= 0; got {epsilon}. Use a small positive value such as 1e-6."
        )
    if score_mask is not None:
        _check_per_seq(fn, "score_mask", score_mask, valid.shape[0])
    with torch.no_grad():
        s = scores.to(torch.float64)
        stand = _episodes(fn, episode, s)
        scored = torch.ones_like(stand) if score_mask is None else score_mask.bool()
        counted = stand & scored
        count, mean, std = _group_stats(s[counted], inverse[counted], groups)
        centred = s - mean[inverse]
        per_seq = centred / (std[inverse] + epsilon) if norm_by_std else centred
        if score_mask is not None:
            per_seq = torch.where(scored & (count[inverse] >= 2), per_seq, 0.0)
        if episode is not None:
            per_seq = torch.where(episode >= 0, per_seq, 0.0)
        advantages = _broadcast(per_seq, valid).to(scores.dtype)
    return advantages, advantages.clone()


def rloo(scores: Tensor, response_mask: Tensor, index: Tensor, episode: Tensor | None = None
         ) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: A_i = s_i − (Σ_{j∈g} s_j − s_i)/(n_g − 1), broadcast to tokens.

    A singleton group has no baseline: A_i = s_i (verl). ``returns`` equals ``advantages``.
    ``episode``: as grpo's (the sums and counts are over episodes).
    """
    # Ahmadian et al. 2024 (RLOO); verl core_algos.compute_rloo_outcome_advantage
    fn = "rloo"
    valid = _valid_mask(fn, response_mask)
    _check_per_seq(fn, "scores", scores, valid.shape[0])
    _check_float(fn, "scores", scores)
    inverse, groups = _group_inverse(fn, index, valid.shape[0])
    with torch.no_grad():
        s = scores.to(torch.float64)
        stand = _episodes(fn, episode, s).to(s.dtype)
        count = torch.zeros(groups, dtype=s.dtype, device=s.device).index_add_(
            0, inverse, stand
        )
        total = torch.zeros_like(count).index_add_(0, inverse, s * stand)
        n, others = count[inverse], total[inverse] - s
        per_seq = torch.where(n > 1, s - others / (n - 1).clamp_min(1), s)
        if episode is not None:
            per_seq = torch.where(episode >= 0, per_seq, 0.0)
        advantages = _broadcast(per_seq, valid).to(scores.dtype)
    return advantages, advantages.clone()


def reinforce_pp(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go over the valid tokens, whitened.

    G_t = r_t + γ·G_{n(t)} with n(t) the next *valid* position (G = 0 past the last):
    as verl's loop, a masked token (a tool observation in the middle of a response)
    neither adds its reward nor decays the running return, which is carried across
    it unchanged. advantages = masked_whiten(G) (≥ 1 valid token needed), returns = G;
    both zero where m = 0. This is ``gae``'s λ-return with V = 0 and λ = 1.
    """
    # Hu 2025 (REINFORCE++); verl core_algos.compute_reinforce_plus_plus_outcome_advantage
    fn = "reinforce_pp"
    _check_bt(fn, "token_level_rewards", token_level_rewards)
    _check_float(fn, "token_level_rewards", token_level_rewards)
    _check_like(fn, "response_mask", response_mask, "token_level_rewards", token_level_rewards)
    valid = _valid_mask(fn, response_mask)
    _check_unit(fn, "gamma", gamma)
    with torch.no_grad():
        weight = valid.to(torch.float64)
        rewards = token_level_rewards.to(torch.float64)
        returns = _lambda_returns(rewards, torch.zeros_like(rewards), weight, gamma, 1.0)
        advantages = _whiten_valid(fn, returns.clone(), weight)  # returns is 0 off the mask
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


def reinforce_pp_baseline(
    scores: Tensor,
    response_mask: Tensor,
    index: Tensor,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with group-mean baseline: whiten_valid((s_i − mean_g)·m).

    Singleton groups use mean 0 (verl). Whitening is over all valid tokens of
    the batch (≥ 1 needed). ``epsilon`` is accepted for parity with verl's
    signature, which does not use it either. ``returns`` equals ``advantages``.
    """
    # Hu 2025 (REINFORCE++); verl core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage
    fn = "reinforce_pp_baseline"
    valid = _valid_mask(fn, response_mask)
    _check_per_seq(fn, "scores", scores, valid.shape[0])
    _check_float(fn, "scores", scores)
    inverse, groups = _group_inverse(fn, index, valid.shape[0])
    if epsilon < 0:
        raise ValueError(f"{fn}: epsilon must be >= 0; got {epsilon}.")
    with torch.no_grad():
        s = scores.to(torch.float64)
        _, mean, _ = _group_stats(s, inverse, groups)
        weight = valid.to(torch.float64)
        tokens = (s - mean[inverse])[:, None] * weight
        advantages = _whiten_valid(fn, tokens, weight).to(scores.dtype)
    return advantages, advantages.clone()


def remax(
    token_level_rewards: Tensor, reward_baselines: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax: R_t = Σ_{s≥t} m_s·r_s (undiscounted, holes skipped), A_t = (R_t − b)·m_t.

    ``reward_baselines`` (B,) is the reward of the greedy response.
    """
    # Li et al. 2023 (ReMax); verl core_algos.compute_remax_outcome_advantage
    fn = "remax"
    _check_bt(fn, "token_level_rewards", token_level_rewards)
    _check_float(fn, "token_level_rewards", token_level_rewards)
    _check_like(fn, "response_mask", response_mask, "token_level_rewards", token_level_rewards)
    valid = _valid_mask(fn, response_mask)
    _check_per_seq(fn, "reward_baselines", reward_baselines, valid.shape[0])
    _check_float(fn, "reward_baselines", reward_baselines)
    with torch.no_grad():
        weight = valid.to(torch.float64)
        rewards = token_level_rewards.to(torch.float64) * weight
        returns = rewards.flip(-1).cumsum(dim=-1).flip(-1) * weight
        advantages = (returns - reward_baselines.to(torch.float64)[:, None]) * weight
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)
