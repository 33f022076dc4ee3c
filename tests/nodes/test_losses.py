"""Tests for flowgraph.nodes.losses and ._agg: hand values, loop references, hypothesis.

Notation:
    B  number of sequences (or DPO pairs), T  response length; token tensors are (B, T)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from flowgraph.nodes._agg import agg_loss, masked_mean, masked_var, masked_whiten
from flowgraph.nodes.losses import (
    AdaptiveKLController,
    FixedKLController,
    dpo_loss,
    entropy_from_logits,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)

F64 = torch.float64
HYP = settings(max_examples=40, deadline=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


@st.composite
def token_mats(draw: st.DrawFn, n: int) -> tuple[list[Tensor], Tensor]:
    """n random (B, T) float64 tensors and a 0/1 mask with holes (and maybe empty rows)."""
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 10))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mats = [torch.randn(b, t, generator=gen, dtype=F64) for _ in range(n)]
    mask = (torch.rand(b, t, generator=gen) < draw(st.sampled_from([0.3, 0.7, 1.0]))).to(F64)
    return mats, mask


def loop_agg(mat: Tensor, mask: Tensor, mode: str) -> float:
    """Plain-Python aggregation: the seq-mean modes skip rows without a valid token."""
    rows = [
        [float(mat[b, t]) for t in range(mat.shape[1]) if mask[b, t] == 1]
        for b in range(mat.shape[0])
    ]
    if mode == "token-mean":
        flat = [x for row in rows for x in row]
        return sum(flat) / len(flat) if flat else 0.0
    if mode == "seq-mean-token-sum":
        sums = [sum(row) for row in rows if row]
        return sum(sums) / len(sums) if sums else 0.0
    means = [sum(row) / (len(row) + 1e-8) for row in rows if row]  # verl's 1e-8
    return sum(means) / len(means) if means else 0.0


# ----------------------------------------------------------------------------- _agg


def test_agg_loss_hand() -> None:
    mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # token-mean: (1 + 2 + 4)/3 = 2.333333
    assert agg_loss(mat, mask, "token-mean").item() == pytest.approx(7 / 3)
    # seq-mean-token-sum: ((1 + 2) + 4)/2 non-empty rows = 3.5 (verl 0.9.1 leaves out a
    # row without a valid token, test_verl_reference.py::test_agg_loss)
    assert agg_loss(mat, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    # seq-mean-token-mean: ((1 + 2)/2 + 4/1)/2 non-empty rows = 2.75
    assert agg_loss(mat, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    # the same without the empty row
    assert agg_loss(mat[:2], mask[:2], "seq-mean-token-sum").item() == pytest.approx(3.5)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_all_masked_is_zero_with_grad(mode: str) -> None:
    mat = torch.randn(2, 3, requires_grad=True)
    loss = agg_loss(mat, torch.zeros(2, 3), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert mat.grad is not None and torch.equal(mat.grad, torch.zeros(2, 3))


@HYP
@given(batch=token_mats(1), mode=st.sampled_from(MODES))
def test_agg_loss_matches_loop(batch: tuple[list[Tensor], Tensor], mode: str) -> None:
    (mat,), mask = batch
    assert agg_loss(mat, mask, mode).item() == pytest.approx(loop_agg(mat, mask, mode), abs=1e-9)
    assert agg_loss(mat, mask.bool(), mode).item() == pytest.approx(
        loop_agg(mat, mask, mode), abs=1e-9
    )


def test_agg_loss_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="valid modes are token-mean, seq-mean-token-sum"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "seq-sum")
    with pytest.raises(ValueError, match=r"values \(2, 2\) and mask \(2, 3\)"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 3), "token-mean")


def test_masked_stats_hand() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean over valid = (1 + 2 + 3)/3 = 2; unbiased var = (1 + 0 + 1)/(3 − 1) = 1; biased = 2/3
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_var(x, m).item() == pytest.approx(1.0)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3)
    # whiten: (x − 2)/sqrt(1 + 1e-8) → [−1, 0, 1, 98] (masked entry transformed, not zeroed)
    torch.testing.assert_close(masked_whiten(x, m), torch.tensor([-1.0, 0.0, 1.0, 98.0]))
    torch.testing.assert_close(
        masked_whiten(x, m, shift_mean=False), torch.tensor([1.0, 2.0, 3.0, 100.0])
    )
    # per-row mean: row 0 (1 + 2)/2 = 1.5, row 1 empty → 0
    rows = masked_mean(
        torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]), dim=-1
    )
    torch.testing.assert_close(rows, torch.tensor([1.5, 0.0]))
    with pytest.raises(ValueError, match="at least 2 token"):
        masked_var(x, torch.tensor([0.0, 1.0, 0.0, 0.0]))


# ----------------------------------------------------------------------------- PPO policy loss


def loop_ppo_token(old: float, new: float, adv: float, low: float, high: float, c: float) -> float:
    log_ratio = min(max(new - old, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped)
    return min(loss, -adv * c) if adv < 0 else loss


def test_ppo_policy_loss_hand() -> None:
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 4.0, 1.1]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = ppo_policy_loss(old, new, adv, torch.ones(1, 4))
    # t0: ρ=1.5, A=1:  L1=−1.5, L2=−1.2, max → −1.2 (clipped: L2 > L1)
    # t1: ρ=0.5, A=1:  L1=−0.5, L2=−0.8, max → −0.5
    # t2: ρ=4.0, A=−1: L1=4.0, L2=1.2, max 4.0; dual clip −A·c = 3.0 < 4.0 → 3.0 (lower clip)
    # t3: ρ=1.1, A=−1: L1=L2=1.1, min(1.1, 3.0) → 1.1
    # token-mean = (−1.2 − 0.5 + 3.0 + 1.1)/4 = 0.6
    assert loss.item() == pytest.approx(0.6, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)
    # ppo_kl = mean(old − new) = −log(1.5·0.5·4·1.1)/4 = −log(3.3)/4 = −0.298481
    assert metrics["ppo_kl"] == pytest.approx(-0.298481, abs=1e-6)
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    # d/dlogπ of −Aρ/4 on unclipped tokens: t1 → −0.5/4 = −0.125, t3 → 1.1/4 = 0.275; clipped → 0
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.125, 0.0, 0.275]]))


@HYP
@given(
    batch=token_mats(3),
    mode=st.sampled_from(MODES),
    clips=st.sampled_from([(0.2, 0.2, 3.0), (0.2, 0.28, 10.0), (0.1, 0.3, 1.5)]),
)
def test_ppo_policy_loss_matches_loop(
    batch: tuple[list[Tensor], Tensor], mode: str, clips: tuple[float, float, float]
) -> None:
    (old, new, adv), mask = batch
    low, high, c = clips
    new = old + 0.5 * new  # ratios spread around 1 so every branch is hit
    loss, metrics = ppo_policy_loss(old, new, adv, mask, low, high, c, loss_agg_mode=mode)
    b, t = old.shape
    per_token = torch.tensor(
        [
            [
                loop_ppo_token(float(old[i, j]), float(new[i, j]), float(adv[i, j]), low, high, c)
                for j in range(t)
            ]
            for i in range(b)
        ],
        dtype=F64,
    )
    assert loss.item() == pytest.approx(loop_agg(per_token, mask, mode), abs=1e-9)
    assert metrics["ppo_kl"] == pytest.approx(loop_agg(old - new, mask, "token-mean"), abs=1e-9)


def test_ppo_policy_loss_rejects_bad_inputs() -> None:
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"clip_ratio_c .* must be > 1; got 1\.0"):
        ppo_policy_loss(x, x, x, m, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"advantages=\(2, 2\)"):
        ppo_policy_loss(x, x, torch.zeros(2, 2), m)
    with pytest.raises(ValueError, match="valid modes are"):
        ppo_policy_loss(x, x, x, m, loss_agg_mode="sum")


def test_ppo_policy_loss_clamps_log_ratio() -> None:
    old, new = torch.zeros(1, 1), torch.full((1, 1), 30.0)
    loss, metrics = ppo_policy_loss(old, new, torch.full((1, 1), -1.0), torch.ones(1, 1))
    # log-ratio clamped to 20: ρ = e^20, A = −1 → max(e^20, 1.2) = e^20; dual clip min(e^20, 3) = 3
    assert loss.item() == pytest.approx(3.0)
    assert metrics["ppo_kl"] == pytest.approx(-20.0)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------- value loss


def test_value_loss_hand() -> None:
    vpreds = torch.tensor([[1.0, 2.0]])
    values = torch.tensor([[0.0, 1.8]])
    returns = torch.tensor([[1.5, 1.0]])
    loss, clipfrac = value_loss(vpreds, values, returns, torch.ones(1, 2), cliprange_value=0.5)
    # t0: clip(1.0, −0.5, 0.5) = 0.5; (1.0 − 1.5)² = 0.25, (0.5 − 1.5)² = 1.0 → 1.0 (clipped)
    # t1: clip(2.0, 1.3, 2.3) = 2.0; both (2 − 1)² = 1.0 → 1.0
    # loss = 0.5·(1.0 + 1.0)/2 = 0.5; clipfrac = 1/2
    assert loss.item() == pytest.approx(0.5)
    assert clipfrac == pytest.approx(0.5)


@HYP
@given(batch=token_mats(3), mode=st.sampled_from(MODES), clip=st.sampled_from([0.0, 0.2, 0.5]))
def test_value_loss_matches_loop(
    batch: tuple[list[Tensor], Tensor], mode: str, clip: float
) -> None:
    (vpreds, values, returns), mask = batch
    loss, clipfrac = value_loss(
        vpreds, values, returns, mask, cliprange_value=clip, loss_agg_mode=mode
    )
    b, t = vpreds.shape
    per_token = torch.zeros(b, t, dtype=F64)
    clipped = torch.zeros(b, t, dtype=F64)
    for i in range(b):
        for j in range(t):
            vp, v, r = float(vpreds[i, j]), float(values[i, j]), float(returns[i, j])
            vc = min(max(vp, v - clip), v + clip)
            per_token[i, j] = max((vp - r) ** 2, (vc - r) ** 2)
            clipped[i, j] = float((vc - r) ** 2 > (vp - r) ** 2)
    assert loss.item() == pytest.approx(0.5 * loop_agg(per_token, mask, mode), abs=1e-9)
    assert clipfrac == pytest.approx(loop_agg(clipped, mask, "token-mean"), abs=1e-9)


# ----------------------------------------------------------------------------- entropy / KL


def test_entropy_from_logits_hand_and_reference() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    # uniform over 2 → log 2 = 0.693147
    # probs [0.25, 0.75] → −(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([0.693147, 0.562335]))
    big = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    expected = torch.distributions.Categorical(logits=big).entropy()
    torch.testing.assert_close(entropy_from_logits(big), expected)


def test_kl_penalty_hand() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    # d = logπ − logπ_ref = 0.5
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), torch.tensor([0.5]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([0.5]))
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), torch.tensor([0.125]))  # ½·0.5²
    # k3 with x = ref − logp = −0.5: e^−0.5 + 0.5 − 1 = 0.606531 − 0.5 = 0.106531
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([0.106531]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.106531]))
    # clamps: x = −30 → −20: e^−20 + 20 − 1 ≈ 19 → 10;  x = 30 → 20: e^20 − 21 → 10
    extreme = kl_penalty(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]), "low_var_kl")
    torch.testing.assert_close(extreme, torch.tensor([10.0, 10.0]))
    with pytest.raises(ValueError, match="valid kinds are kl, abs, mse, low_var_kl"):
        kl_penalty(logp, ref, "full")


@HYP
@given(batch=token_mats(2))
def test_kl_penalty_matches_loop(batch: tuple[list[Tensor], Tensor]) -> None:
    (logp, ref), _ = batch
    k3 = kl_penalty(logp, ref, "low_var_kl")
    k2 = kl_penalty(logp, ref, "mse")
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            x = float(ref[i, j] - logp[i, j])
            assert float(k3[i, j]) == pytest.approx(
                min(max(math.exp(x) - x - 1, -10), 10), abs=1e-12
            )
            assert float(k2[i, j]) == pytest.approx(0.5 * x * x, abs=1e-12)


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_hand_and_checkpoint() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)
    # e = clip(9/6 − 1 = 0.5, ±0.2) = 0.2; mult = 1 + 0.2·256/10000 = 1.00512 → 0.201024
    assert ctl.value == pytest.approx(0.201024)
    ctl.update(current_kl=5.4, n_steps=100)
    # e = 5.4/6 − 1 = −0.1; mult = 1 − 0.1·100/10000 = 0.999 → 0.201024·0.999 = 0.200822976
    assert ctl.value == pytest.approx(0.200822976)
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    assert all(type(v) is float for v in ctl.state_dict().values())
    with pytest.raises(ValueError, match="missing keys"):
        restored.load_state_dict({"value": 0.1})


def test_fixed_kl_controller() -> None:
    ctl = FixedKLController(kl_coef=0.05)
    ctl.update(current_kl=100.0, n_steps=10)
    assert ctl.value == 0.05
    other = FixedKLController(kl_coef=0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match="target_kl and horizon must be > 0"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=100)


@HYP
@given(steps=st.lists(st.tuples(st.floats(0.0, 20.0), st.integers(0, 512)), max_size=20))
def test_adaptive_kl_controller_matches_loop(steps: list[tuple[float, int]]) -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=3.0, horizon=1000)
    expected = 0.1
    for kl, n in steps:
        ctl.update(kl, n)
        expected *= 1 + min(max(kl / 3.0 - 1, -0.2), 0.2) * n / 1000
    assert ctl.value == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- DPO


def _dpo_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    pc = torch.tensor([-1.0, -3.0], requires_grad=True)
    pr = torch.tensor([-2.0, -1.0], requires_grad=True)
    return pc, pr, torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])


def test_dpo_loss_hand_all_types() -> None:
    pc, pr, rc, rr = _dpo_inputs()
    # h = (πc − πr) − (ref_c − ref_r): pair 0: (−1 + 2) − 0 = 1; pair 1: (−3 + 1) − 0 = −2; β = 0.1
    sig, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid")
    # −logσ(0.1) = log(1 + e^−0.1) = 0.644397; −logσ(−0.2) = log(1 + e^0.2) = 0.798139
    torch.testing.assert_close(sig, torch.tensor([0.644397, 0.798139]))
    # chosen: β(πc − ref_c) = 0.1·[0.5, −1] = [0.05, −0.1]
    # rejected: β(πr − ref_r) = 0.1·[−0.5, 1] = [−0.05, 0.1]
    torch.testing.assert_close(chosen, torch.tensor([0.05, -0.1]))
    torch.testing.assert_close(rejected, torch.tensor([-0.05, 0.1]))
    assert sig.requires_grad and not chosen.requires_grad and not rejected.requires_grad
    smooth, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid", label_smoothing=0.1)
    # pair 0: 0.9·0.644397 + 0.1·log(1 + e^0.1) = 0.579957 + 0.1·0.744397 = 0.654397
    assert smooth[0].item() == pytest.approx(0.654397, abs=1e-6)
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo")
    # (h − 1/(2β))² = (1 − 5)² = 16; (−2 − 5)² = 49
    torch.testing.assert_close(ipo, torch.tensor([16.0, 49.0]))
    hinge, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="hinge")
    # relu(1 − βh) = relu(0.9) = 0.9; relu(1.2) = 1.2
    torch.testing.assert_close(hinge, torch.tensor([0.9, 1.2]))


@HYP
@given(
    beta=st.sampled_from([0.05, 0.1, 0.5]),
    loss_type=st.sampled_from(["sigmoid", "ipo", "hinge"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dpo_loss_matches_loop(beta: float, loss_type: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-5 * torch.rand(4, generator=gen, dtype=F64) for _ in range(4))
    ls = 0.2 if loss_type == "sigmoid" else 0.0
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=ls)
    for i in range(4):
        h = float((pc[i] - pr[i]) - (rc[i] - rr[i]))
        if loss_type == "sigmoid":
            want = (1 - ls) * math.log1p(math.exp(-beta * h)) + ls * math.log1p(math.exp(beta * h))
        elif loss_type == "ipo":
            want = (h - 1 / (2 * beta)) ** 2
        else:
            want = max(0.0, 1 - beta * h)
        assert float(losses[i]) == pytest.approx(want, abs=1e-9)


def test_dpo_loss_rejects_bad_inputs() -> None:
    pc, pr, rc, rr = _dpo_inputs()
    with pytest.raises(ValueError, match="valid loss types are sigmoid, ipo, hinge"):
        dpo_loss(pc, pr, rc, rr, loss_type="kto")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing only applies"):
        dpo_loss(pc, pr, rc, rr, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"ref_rejected_logps=\(3,\)"):
        dpo_loss(pc, pr, rc, torch.zeros(3))
