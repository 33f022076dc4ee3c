"""Every advantage estimator, the PPO policy and value losses and the KL penalties equal
verl 0.9.1's own functions (verl.trainer.ppo.core_algos) on the same inputs.

The numbers are verl's, written by scripts/verl_fixtures.py (run it to regenerate;
verl is not needed here): 8 responses × 12 tokens in groups 0 0 0 0 1 1 1 2, on a
contiguous mask and on a mask with holes, in float32 and float64.

On masked positions verl leaves what its loop carried (GAE's advantages and returns,
ReMax's returns); ours are exactly 0 there, the one documented difference
(nodes/advantage.py). Those estimators are compared on the valid tokens; everything
else on every position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from flowgraph.nodes import advantage
from flowgraph.nodes._agg import agg_loss
from flowgraph.nodes.losses import kl_penalty, ppo_policy_loss, value_loss

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "core_algos.pt"
DATA = torch.load(FIXTURES, weights_only=False)
CASES = sorted(DATA["cases"])


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # float64: both sides round the same few operations, ~1e-15 apart; float32: verl
    # accumulates in float32 where some of ours run in float64, and whitening divides
    # by a std of order 1, so differences stay within a few float32 ulps of O(1) values.
    return {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5,
                                                                          "atol": 1e-5}


def _close(ours: Tensor, theirs: Tensor, where: Tensor | None = None) -> None:
    assert ours.dtype == theirs.dtype
    if where is not None:
        ours, theirs = ours[where.bool()], theirs[where.bool()]
    torch.testing.assert_close(ours, theirs, **_tolerance(theirs.dtype))


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(DATA["cases"][request.param])


def test_fixtures_come_from_verl_0_9_1() -> None:
    assert DATA["verl"] == "0.9.1"
    assert CASES == ["contiguous/float32", "contiguous/float64", "holes/float32",
                     "holes/float64"]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95)])
def test_gae(case: dict[str, Any], gamma: float, lam: float) -> None:
    x, (adv, ret) = case["inputs"], case["outputs"][f"gae/{gamma}/{lam}"]
    ours = advantage.gae(x["dense"], x["values"], x["mask"], gamma=gamma, lam=lam)
    _close(ours[0], adv, x["mask"])
    _close(ours[1], ret, x["mask"])


@pytest.mark.parametrize("gamma", [1.0, 0.99])
def test_reinforce_pp(case: dict[str, Any], gamma: float) -> None:
    """With holes, verl carries the running return across masked tokens."""
    x, (adv, ret) = case["inputs"], case["outputs"][f"reinforce_pp/{gamma}"]
    ours = advantage.reinforce_pp(x["dense"], x["mask"], gamma=gamma)
    _close(ours[0], adv)
    _close(ours[1], ret)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo(case: dict[str, Any], norm_by_std: bool) -> None:
    x, (adv, ret) = case["inputs"], case["outputs"][f"grpo/{norm_by_std}"]
    ours = advantage.grpo(x["scores"], x["mask"], x["index"], epsilon=1e-6,
                          norm_by_std=norm_by_std)
    # Row 7 is a group of one: mean 0, std 1. verl adds ε to a float32 `torch.tensor(1.0)`,
    # so in float64 its 1 + 1e-6 is float32's (1.4e-8 relative off); ours is float64's.
    group = x["index"] != 2  # rows 0-6; row 7 is group 2
    for ours_, theirs in zip(ours, (adv, ret), strict=True):
        _close(ours_[group], theirs[group])
        torch.testing.assert_close(ours_[~group], theirs[~group], rtol=1e-7, atol=1e-7)


def test_rloo(case: dict[str, Any]) -> None:
    x, (adv, ret) = case["inputs"], case["outputs"]["rloo"]
    ours = advantage.rloo(x["scores"], x["mask"], x["index"])
    _close(ours[0], adv)
    _close(ours[1], ret)


def test_reinforce_pp_baseline(case: dict[str, Any]) -> None:
    x, (adv, ret) = case["inputs"], case["outputs"]["reinforce_pp_baseline"]
    ours = advantage.reinforce_pp_baseline(x["scores"], x["mask"], x["index"], epsilon=1e-6)
    _close(ours[0], adv)
    _close(ours[1], ret)


def test_remax(case: dict[str, Any]) -> None:
    x, (adv, ret) = case["inputs"], case["outputs"]["remax"]
    ours = advantage.remax(x["dense"], x["baselines"], x["mask"])
    _close(ours[0], adv, x["mask"])
    _close(ours[1], ret, x["mask"])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_policy_loss(case: dict[str, Any], mode: str, low: float, high: float) -> None:
    x = case["inputs"]
    loss, metrics = case["outputs"][f"policy/{mode}/{low}/{high}"]
    ours, our_metrics = ppo_policy_loss(x["old_log_prob"], x["log_prob"], x["advantages"],
                                        x["mask"], clip_ratio_low=low, clip_ratio_high=high,
                                        clip_ratio_c=3.0, loss_agg_mode=mode)
    _close(ours, loss)
    for name in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert our_metrics[name] == pytest.approx(metrics[f"actor/{name}"], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_value_loss(case: dict[str, Any], mode: str) -> None:
    x, (loss, clipfrac) = case["inputs"], case["outputs"][f"value/{mode}"]
    ours, our_clipfrac = value_loss(x["vpreds"], x["values"], x["returns"], x["mask"],
                                    cliprange_value=0.5, loss_agg_mode=mode)
    _close(ours, loss)
    assert our_clipfrac == pytest.approx(float(clipfrac), rel=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_leaves_out_a_row_without_tokens(case: dict[str, Any], mode: str) -> None:
    x = case["inputs"]
    one_empty = x["mask"].clone()
    one_empty[3] = 0
    _close(agg_loss(x["advantages"], one_empty, mode), case["outputs"][f"agg/{mode}"])


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_penalty(case: dict[str, Any], kind: str) -> None:
    x = case["inputs"]
    _close(kl_penalty(x["log_prob"], x["ref_log_prob"], kind), case["outputs"][f"kl/{kind}"])
