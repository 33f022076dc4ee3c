"""Tests for flowgraph.nodes.advantage: hand-derived values, plain-loop references, hypothesis.

The loop references below are ports of verl's per-time-step loops
(``verl/trainer/ppo/core_algos.py``), so hypothesis can check the vectorised code on
any mask (holes, leading zeros, long responses). That the ports compute what verl
computes is not taken on trust: tests/nodes/test_verl_reference.py holds the
estimators to verl 0.9.1's own outputs (a port here once cut REINFORCE++'s return at
a hole where verl carries it across).

Notation:
    B  number of sequences, T  response length; masks are (B, T), scores (B,)
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from flowgraph.nodes.advantage import (
    gae,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
)

F64 = torch.float64
HYP = settings(max_examples=40, deadline=None)


# ----------------------------------------------------------------------------- references


def ref_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """verl's masked_whiten: masked means over (n + 1e-8), unbiased var, eps 1e-8."""
    n = mask.sum()
    mean = (x * mask).sum() / (n + 1e-8)
    var = (((x - mean) ** 2) * mask).sum() / (n + 1e-8) * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def loop_gae(r: Tensor, v: Tensor, m: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """verl compute_gae_advantage_return loop (un-whitened advantages, returns)."""
    nextvalues: Tensor | float = 0.0
    lastgaelam: Tensor | float = 0.0
    advantages_reversed = []
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + v


def loop_reinforce_pp(r: Tensor, m: Tensor, gamma: float) -> Tensor:
    """verl compute_reinforce_plus_plus_outcome_advantage loop (returns before whitening)."""
    returns = torch.zeros_like(r)
    running_return: Tensor | float = 0.0
    for t in reversed(range(r.shape[1])):
        new_running_return = r[:, t] + gamma * running_return
        returns[:, t] = new_running_return * m[:, t]
        # a masked token passes the running return on unchanged
        running_return = new_running_return * m[:, t] + running_return * (1 - m[:, t])
    return returns


def loop_group_adv(scores: Tensor, index: Tensor, kind: str, eps: float = 1e-6) -> Tensor:
    """Dict-of-lists group baselines, one response at a time (verl style)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[int(index[i])].append(float(scores[i]))
    out = []
    for i in range(scores.shape[0]):
        g = groups[int(index[i])]
        s, n = float(scores[i]), len(g)
        mean = sum(g) / n if n > 1 else 0.0
        std = (sum((x - sum(g) / n) ** 2 for x in g) / (n - 1)) ** 0.5 if n > 1 else 1.0
        if kind == "grpo":
            out.append((s - mean) / (std + eps))
        elif kind == "drgrpo":
            out.append(s - mean)
        elif kind == "rloo":
            out.append(s - (sum(g) - s) / (n - 1) if n > 1 else s)
        else:  # "mean": REINFORCE++ baseline
            out.append(s - mean)
    return torch.tensor(out, dtype=F64)


# ----------------------------------------------------------------------------- strategies


@st.composite
def token_batch(draw: st.DrawFn, max_b: int = 5, max_t: int = 80) -> tuple[Tensor, Tensor, Tensor]:
    """(rewards, values, mask) in float64 with arbitrary 0/1 masks (holes, leading zeros)."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    density = draw(st.sampled_from([0.2, 0.6, 0.9, 1.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = (torch.rand(b, t, generator=gen) < density).to(F64)
    rewards = torch.randn(b, t, generator=gen, dtype=F64)
    values = torch.randn(b, t, generator=gen, dtype=F64)
    return rewards, values, mask


@st.composite
def group_batch(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor]:
    """(scores, mask, index) with arbitrary, unsorted, non-contiguous group ids."""
    b = draw(st.integers(1, 12))
    t = draw(st.integers(1, 6))
    ids = draw(st.lists(st.sampled_from([-7, 0, 3, 42, 1000]), min_size=b, max_size=b))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scores = torch.randint(0, 3, (b,), generator=gen).to(F64) + 0.25 * torch.randn(
        b, generator=gen, dtype=F64
    )
    mask = (torch.rand(b, t, generator=gen) < 0.7).to(F64)
    return scores, mask, torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------- gae


def test_gae_hand_full_mask() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.4]])
    m = torch.ones(1, 3)
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0, whiten=False)
    # δ2 = 1 + 0 − 0.4 = 0.6;   A2 = 0.6
    # δ1 = 0 + 0.4 − 0.2 = 0.2; A1 = 0.2 + 0.6 = 0.8
    # δ0 = 0 + 0.2 − 0.5 = −0.3; A0 = −0.3 + 0.8 = 0.5
    # R = A + V = [1.0, 1.0, 1.0]
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    white, _ = gae(r, v, m, gamma=1.0, lam=1.0, whiten=True)
    # mean = 1.9/3 = 0.633333; deviations −0.133333, 0.166667, −0.033333
    # unbiased var = (0.0177778 + 0.0277778 + 0.0011111)/2 = 0.0233333, std = 0.1527525
    # whitened = [−0.872872, 1.091089, −0.218218]
    torch.testing.assert_close(
        white, torch.tensor([[-0.872872, 1.091089, -0.218218]]), atol=1e-5, rtol=0
    )


def test_gae_hand_hole_is_skipped() -> None:
    r = torch.tensor([[0.0, 0.5, 0.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 0.2, 0.4]])
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, ret = gae(r, v, m, gamma=0.5, lam=0.5, whiten=False)
    # γ = λ = 0.5, γλ = 0.25; position 1 is masked: its r = 0.5 and V = 9 never count.
    # δ3 = 1 + 0.5·0 − 0.4 = 0.6;                 A3 = 0.6
    # δ2 = 0 + 0.5·0.4 − 0.2 = 0.0;               A2 = 0.0 + 0.25·0.6 = 0.15
    # δ0 = 0 + 0.5·V2(=0.2) − 0.5 = −0.4;         A0 = −0.4 + 0.25·0.15 = −0.3625
    # R = A + V on valid tokens: [0.1375, 0, 0.35, 1.0]
    torch.testing.assert_close(adv, torch.tensor([[-0.3625, 0.0, 0.15, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[0.1375, 0.0, 0.35, 1.0]]))


def test_gae_leading_zeros_and_empty_row() -> None:
    r = torch.tensor([[3.0, 0.0, 1.0], [5.0, 5.0, 5.0]])
    v = torch.tensor([[7.0, 0.5, 0.5], [1.0, 1.0, 1.0]])
    m = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0, whiten=False)
    # row 0: A2 = 1 − 0.5 = 0.5; A1 = (0 + 0.5 − 0.5) + 0.5 = 0.5; position 0 masked → 0
    # row 1: no valid token → all zeros
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


@HYP
@given(
    batch=token_batch(),
    gamma=st.sampled_from([1.0, 0.99, 0.5, 0.0]),
    lam=st.sampled_from([1.0, 0.95, 0.3]),
)
def test_gae_matches_verl_loop(
    batch: tuple[Tensor, Tensor, Tensor], gamma: float, lam: float
) -> None:
    r, v, m = batch
    ref_adv, ref_ret = loop_gae(r, v, m, gamma, lam)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam, whiten=False)
    torch.testing.assert_close(adv, ref_adv * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, ref_ret * m, atol=1e-5, rtol=0)
    if m.sum() < 2:
        # one valid token whitens to 0 (it is its own mean); none is an error
        if m.sum() == 0:
            with pytest.raises(ValueError, match="selects 0"):
                gae(r, v, m, gamma=gamma, lam=lam)
        else:
            assert not gae(r, v, m, gamma=gamma, lam=lam)[0].abs().sum()
        return
    white, _ = gae(r, v, m, gamma=gamma, lam=lam)
    torch.testing.assert_close(white, ref_whiten(ref_adv, m) * m, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.1), (0.05, 0.05)])
@pytest.mark.parametrize("length", [31, 32, 33, 64, 300, 1100])
def test_gae_float32_long_sequences(gamma: float, lam: float, length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    m = (torch.rand(6, length, generator=gen) < 0.8).float()
    m[0, :5] = 0  # leading zeros
    m[1] = 0
    m[1, length // 2] = 1  # a single valid token in the middle
    m[2, -7:] = 0  # right padding
    r = 0.1 * torch.randn(6, length, generator=gen)
    v = torch.randn(6, length, generator=gen)
    ref_adv, ref_ret = loop_gae(r.double(), v.double(), m.double(), gamma, lam)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam, whiten=False)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref_adv * m.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ret.double(), ref_ret * m.double(), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "gamma, lam",
    [(0.0, 1.0), (1.0, 0.0), (0.0, 0.0), (1.0, 1.0), (0.5, 1.0), (1.0, 1e-3), (1e-20, 1.0)],
)
def test_gae_extreme_discounts(gamma: float, lam: float) -> None:
    # γλ = 0 (A = δ, the scan is the identity), γλ = 1 (plain suffix sums), λ = 1
    # (no value term in the λ-return input) and a tiny γ (its powers underflow).
    gen = torch.Generator().manual_seed(7)
    m = (torch.rand(5, 70, generator=gen) < 0.7).double()
    r = torch.randn(5, 70, generator=gen, dtype=F64)
    v = torch.randn(5, 70, generator=gen, dtype=F64)
    ref_adv, ref_ret = loop_gae(r, v, m, gamma, lam)
    adv, ret = gae(r.float(), v.float(), m.float(), gamma=gamma, lam=lam, whiten=False)
    torch.testing.assert_close(adv.double(), ref_adv * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret.double(), ref_ret * m, atol=1e-5, rtol=0)


def test_gae_gamma_lam_zero_is_one_step_td() -> None:
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    v = torch.tensor([[0.5, 9.0, 0.25, 1.0]])
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, ret = gae(r, v, m, gamma=0.5, lam=0.0, whiten=False)
    # γλ = 0: A_t = δ_t = r_t + 0.5·V_{n(t)} − V_t, the hole at t=1 skipped:
    # A0 = 1 + 0.5·0.25 − 0.5 = 0.625; A2 = 3 + 0.5·1 − 0.25 = 3.25; A3 = 4 + 0 − 1 = 3
    torch.testing.assert_close(adv, torch.tensor([[0.625, 0.0, 3.25, 3.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.125, 0.0, 3.5, 4.0]]))


@pytest.mark.parametrize("length", [1, 2, 31, 32, 33, 63, 65, 127, 128, 1000])
def test_gae_masks_with_holes_and_empty_rows(length: int) -> None:
    # Rows: all masked, all valid, holes across chunk boundaries (chunks of 32),
    # a single valid token at the end, alternating tokens, leading/trailing padding.
    gen = torch.Generator().manual_seed(length)
    pos = torch.arange(length)
    m = torch.stack(
        [
            torch.zeros(length),
            torch.ones(length),
            ((pos < 30) | (pos >= 35)).float(),
            (pos == length - 1).float(),
            (pos % 2).float(),
            ((pos >= 3) & (pos < length - 5)).float(),
        ]
    ).double()
    # rewards 0.1·N(0, 1) keep the suffix sums O(1): float32 holds them to ~1e-7
    r = 0.1 * torch.randn(6, length, generator=gen, dtype=F64)
    v = torch.randn(6, length, generator=gen, dtype=F64)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95)]:
        ref_adv, ref_ret = loop_gae(r, v, m, gamma, lam)
        adv, ret = gae(r.float(), v.float(), m.float(), gamma=gamma, lam=lam, whiten=False)
        torch.testing.assert_close(adv.double(), ref_adv * m, atol=1e-5, rtol=0)
        torch.testing.assert_close(ret.double(), ref_ret * m, atol=1e-5, rtol=0)
        assert not adv[0].any() and not ret[0].any()  # the all-masked row


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.999, 0.99)])
def test_gae_float32_long_responses_match_float64_loop(gamma: float, lam: float) -> None:
    # T = 4096 (the benchmark's long case): float32 blocks of 32 with log-depth carries.
    gen = torch.Generator().manual_seed(4096)
    length = 4096
    pos = torch.arange(length)
    ends = torch.tensor([[4096], [3000], [1500], [4000]])
    m = ((pos >= 2) & (pos < ends)).float()
    m[:, 1000:1090] = 0  # a tool observation in the middle
    r = -0.01 * torch.rand(4, length, generator=gen) * m
    r[torch.arange(4), ends[:, 0] - 1] += torch.tensor([1.0, -1.0, 1.0, -1.0])
    v = torch.rand(4, length, generator=gen) * 2 - 1
    ref_adv, ref_ret = loop_gae(r.double(), v.double(), m.double(), gamma, lam)
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam, whiten=False)
    torch.testing.assert_close(adv.double(), ref_adv * m.double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ret.double(), ref_ret * m.double(), atol=1e-5, rtol=0)
    white, _ = gae(r, v, m, gamma=gamma, lam=lam)
    expected = ref_whiten(ref_adv, m.double()) * m.double()
    torch.testing.assert_close(white.double(), expected, atol=1e-5, rtol=0)


def test_gae_keeps_low_precision_dtype() -> None:
    r, v = torch.randn(3, 40).bfloat16(), torch.randn(3, 40).bfloat16()
    m = torch.ones(3, 40, dtype=torch.long)
    adv, ret = gae(r, v, m, gamma=0.99, lam=0.95)
    assert adv.dtype == torch.bfloat16 and ret.dtype == torch.bfloat16
    _, ref_ret = loop_gae(r.double(), v.double(), m.double(), 0.99, 0.95)
    torch.testing.assert_close(ret.double(), ref_ret, atol=0.1, rtol=0.02)


def test_gae_accepts_bool_mask_and_carries_no_grad() -> None:
    r = torch.randn(3, 5)
    v = torch.randn(3, 5, requires_grad=True)
    m = torch.tensor([[1, 1, 0, 1, 0]] * 3, dtype=torch.bool)
    adv, ret = gae(r, v, m)
    adv_f, ret_f = gae(r, v, m.float())
    torch.testing.assert_close(adv, adv_f)
    torch.testing.assert_close(ret, ret_f)
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_rejects_bad_inputs() -> None:
    r, m = torch.zeros(2, 4), torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"values must have the same shape.*\(2, 3\)"):
        gae(r, torch.zeros(2, 3), m)
    for bad in (0.5, 2.0, -1.0, float("nan"), float("inf"), 1e-30):
        with pytest.raises(ValueError, match="only 0/1"):
            gae(r, r, torch.tensor([[1.0, 0.0, bad, 1.0], [1.0, 1.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="only 0/1"):
        gae(r, r, torch.tensor([[1, 0, 2, 1], [1, 1, 1, 0]]))
    with pytest.raises(ValueError, match=r"gamma must lie in \[0, 1\]"):
        gae(r, r, m, gamma=1.5)
    with pytest.raises(ValueError, match="2-D"):
        gae(torch.zeros(4), torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="floating"):
        gae(torch.zeros(2, 4, dtype=torch.int64), r, m)


# ----------------------------------------------------------------------------- grpo / rloo


def test_grpo_hand() -> None:
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.3])
    index = torch.tensor([7, 7, 3, 3, 42])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    adv, ret = grpo(scores, mask, index)
    # group 7: [1, 0] mean 0.5, unbiased std = sqrt((0.25 + 0.25)/1) = 0.7071068
    #          → ±0.5/(0.7071068 + 1e-6) = ±0.7071058
    # group 3: [1, 1] mean 1, std 0 → 0
    # group 42 (singleton): mean 0, std 1 → 0.3/(1 + 1e-6) = 0.2999997
    per_seq = torch.tensor([0.7071058, -0.7071058, 0.0, 0.0, 0.2999997])
    torch.testing.assert_close(adv, per_seq[:, None] * mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, adv)
    dr, _ = grpo(scores, mask, index, norm_by_std=False)
    # Dr.GRPO: s − mean: [0.5, −0.5, 0, 0, 0.3]
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.3])[:, None] * mask)


def test_rloo_hand() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    index = torch.tensor([5, 5, 5, -1])
    mask = torch.ones(4, 3)
    adv, _ = rloo(scores, mask, index)
    # A0 = 1 − (0 + 0.5)/2 = 0.75; A1 = 0 − (1 + 0.5)/2 = −0.75; A2 = 0.5 − (1 + 0)/2 = 0
    # singleton group −1: no baseline → A3 = 2.0
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.75, 0.0, 2.0])[:, None].expand(4, 3))


@HYP
@given(batch=group_batch(), norm_by_std=st.booleans())
def test_grpo_matches_loop(batch: tuple[Tensor, Tensor, Tensor], norm_by_std: bool) -> None:
    scores, mask, index = batch
    expected = loop_group_adv(scores, index, "grpo" if norm_by_std else "drgrpo")
    adv, ret = grpo(scores, mask, index, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv, expected[:, None] * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, adv)


@HYP
@given(batch=group_batch())
def test_rloo_matches_loop(batch: tuple[Tensor, Tensor, Tensor]) -> None:
    scores, mask, index = batch
    adv, ret = rloo(scores, mask, index)
    torch.testing.assert_close(
        adv, loop_group_adv(scores, index, "rloo")[:, None] * mask, atol=1e-5, rtol=0
    )
    torch.testing.assert_close(ret, adv)


@HYP
@given(batch=group_batch(), norm_by_std=st.booleans(), seed=st.integers(0, 2**16))
def test_episode_rows_count_once(batch: tuple[Tensor, Tensor, Tensor], norm_by_std: bool,
                                 seed: int) -> None:
    """An agent_rollout's episodes of several rows (`episode`): grpo and rloo give each
    row its episode's advantage, as if each episode were one row; unused rows get 0."""
    scores, mask, index = batch
    g = torch.Generator().manual_seed(seed)
    rows_each = torch.randint(1, 4, (scores.shape[0],), generator=g)  # rows it took, of 3
    slots = torch.arange(3).repeat(scores.shape[0])
    episode = torch.arange(scores.shape[0]).repeat_interleave(3)
    used = slots < rows_each.repeat_interleave(3)
    wide = mask.repeat_interleave(3, dim=0) * used[:, None]
    ep = torch.where(used, episode, -1)
    for fn, kw in ((grpo, {"norm_by_std": norm_by_std}), (rloo, {})):
        one, _ = fn(scores, mask, index, **kw)
        many, _ = fn(scores.repeat_interleave(3), wide, index.repeat_interleave(3),
                     episode=ep, **kw)
        expected = one.repeat_interleave(3, dim=0) * used[:, None]
        torch.testing.assert_close(many, expected, atol=1e-6, rtol=0)


def test_episode_rows_with_other_scores_are_refused() -> None:
    scores, mask = torch.tensor([1.0, 0.5, 0.0, 0.0]), torch.ones(4, 2)
    index, episode = torch.tensor([0, 0, 0, 0]), torch.tensor([3, 3, 4, -1])
    for fn in (grpo, rloo):
        with pytest.raises(ValueError, match=r"rows 0 and 1 are one episode \(3\) with "
                                             r"scores 1.0 and 0.5"):
            fn(scores, mask, index, episode=episode)
    adv, _ = grpo(torch.tensor([1.0, 1.0, 0.0, 7.0]), mask, index, episode=episode)
    # two episodes in the group: 1 and 0, the unused row's 7 counts nowhere
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.7071058, 0.7071058, -0.7071058,
                                                        0.0]), atol=1e-6, rtol=0)


def test_group_estimators_reject_bad_index() -> None:
    scores, mask = torch.zeros(3), torch.ones(3, 2)
    with pytest.raises(ValueError, match="integer tensor of group ids"):
        grpo(scores, mask, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"index must be 1-D \(B,\) with B=3"):
        rloo(scores, mask, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"scores must be 1-D \(B,\) with B=3"):
        reinforce_pp_baseline(torch.zeros(3, 2), mask, torch.tensor([0, 1, 2]))


# ----------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand() -> None:
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, ret = reinforce_pp(r, m, gamma=0.5)
    # t=3: G = 4; t=2: G = 3 + 0.5·4 = 5; t=1 masked: its reward is skipped and the
    # running return 5 carried across it; t=0: G = 1 + 0.5·5 = 3.5 → returns [3.5, 0, 5, 4]
    torch.testing.assert_close(ret, torch.tensor([[3.5, 0.0, 5.0, 4.0]]))
    # whiten {3.5, 5, 4}: mean 12.5/3, deviations −0.666667, 0.833333, −0.166667
    # unbiased var = (0.444444 + 0.694444 + 0.027778)/2 = 0.583333, std 0.763763
    # → [−0.872872, 0, 1.091089, −0.218218]
    expected = torch.tensor([[-0.872872, 0.0, 1.091089, -0.218218]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


@HYP
@given(batch=token_batch(), gamma=st.sampled_from([1.0, 0.9, 0.3, 0.0]))
def test_reinforce_pp_matches_verl_loop(batch: tuple[Tensor, Tensor, Tensor], gamma: float) -> None:
    r, _, m = batch
    ref_ret = loop_reinforce_pp(r, m, gamma)
    if m.sum() < 2:
        # one valid token whitens to 0 (it is its own mean); none is an error
        if m.sum() == 0:
            with pytest.raises(ValueError, match="selects 0"):
                reinforce_pp(r, m, gamma=gamma)
        else:
            assert not reinforce_pp(r, m, gamma=gamma)[0].abs().sum()
        return
    adv, ret = reinforce_pp(r, m, gamma=gamma)
    torch.testing.assert_close(ret, ref_ret * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(adv, ref_whiten(ref_ret, m) * m, atol=1e-5, rtol=0)


@pytest.mark.parametrize("length", [127, 128, 129, 700])
def test_reinforce_pp_long_sequences(length: int) -> None:
    # Past 128 tokens the discount-matrix scan works in chunks of 32 with carries.
    gen = torch.Generator().manual_seed(length)
    m = (torch.rand(3, length, generator=gen) < 0.9).double()
    r = torch.randn(3, length, generator=gen, dtype=F64)
    _, ret = reinforce_pp(r, m, gamma=0.99)
    torch.testing.assert_close(ret, loop_reinforce_pp(r, m, 0.99) * m, atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_hand() -> None:
    scores = torch.tensor([1.0, 0.0, 3.0])
    index = torch.tensor([0, 0, 1])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, ret = reinforce_pp_baseline(scores, mask, index)
    # group 0 mean 0.5 → [0.5, −0.5]; group 1 singleton (mean 0) → 3
    # valid tokens: 0.5, 0.5, −0.5, 3, 3: mean 1.3, deviations −0.8, −0.8, −1.8, 1.7, 1.7
    # unbiased var = (0.64 + 0.64 + 3.24 + 2.89 + 2.89)/4 = 2.575, std 1.6046806
    # → −0.498541, −1.121718, 1.059400
    expected = torch.tensor([[-0.498541, -0.498541], [-1.121718, 0.0], [1.059400, 1.059400]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, adv)


@HYP
@given(batch=group_batch())
def test_reinforce_pp_baseline_matches_loop(batch: tuple[Tensor, Tensor, Tensor]) -> None:
    scores, mask, index = batch
    if mask.sum() < 2:
        # one valid token whitens to 0 (it is its own mean); none is an error
        if mask.sum() == 0:
            with pytest.raises(ValueError, match="selects 0"):
                reinforce_pp_baseline(scores, mask, index)
        else:
            assert not reinforce_pp_baseline(scores, mask, index)[0].abs().sum()
        return
    tokens = loop_group_adv(scores, index, "mean")[:, None] * mask
    adv, ret = reinforce_pp_baseline(scores, mask, index)
    torch.testing.assert_close(adv, ref_whiten(tokens, mask) * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, adv)


# ----------------------------------------------------------------------------- ReMax


def test_remax_hand() -> None:
    r = torch.tensor([[0.0, 1.0, 2.0], [5.0, 1.0, 2.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    baselines = torch.tensor([0.5, 1.0])
    adv, ret = remax(r, baselines, m)
    # row 0: masked rewards [0, 1, 0] → suffix sums [1, 1, 0]; A = R − 0.5 on valid → [0.5, 0.5, 0]
    # row 1: masked rewards [0, 1, 2] → suffix sums [3, 3, 2] × m = [0, 3, 2]; A = [0, 2, 1]
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [0.0, 3.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [0.0, 2.0, 1.0]]))


@HYP
@given(batch=token_batch(max_t=20))
def test_remax_matches_loop(batch: tuple[Tensor, Tensor, Tensor]) -> None:
    r, v, m = batch
    baselines = v[:, 0]
    expected_ret = torch.zeros_like(r)
    for b in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            running += float(r[b, t] * m[b, t])
            expected_ret[b, t] = running * float(m[b, t])
    adv, ret = remax(r, baselines, m)
    torch.testing.assert_close(ret, expected_ret, atol=1e-6, rtol=0)
    torch.testing.assert_close(adv, (expected_ret - baselines[:, None]) * m, atol=1e-6, rtol=0)
