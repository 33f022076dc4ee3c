"""The KL reward penalty: fixed β by hand, and the adaptive controller across steps."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor

from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.nodes.kl import kl_penalty
from flowgraph.runtime import NodeContext

SCORES = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
LOG_PROB = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
REF_LOG_PROB = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, -1.0, -1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _ctx(state: dict[str, object], step: int = 0) -> NodeContext:
    return NodeContext("kl", "kl_penalty", step=step, seed=0, state=state)


def _call(ctx: NodeContext, **params: object) -> dict[str, Tensor]:
    return kl_penalty(
        ctx,
        token_level_scores=SCORES,
        log_prob=LOG_PROB,
        ref_log_prob=REF_LOG_PROB,
        response_mask=MASK,
        **params,
    )


def test_signature_is_exactly_the_kind_contract() -> None:
    kind = BUILTIN_KINDS["kl_penalty"]
    sig = inspect.signature(kl_penalty)
    assert list(sig.parameters) == [
        "ctx",
        *(p.name for p in kind.inputs),
        *(p.name for p in kind.params if not p.executor),  # timeout_s: the worker's
    ]
    assert {p.name: p.default for p in kind.params if not p.executor} == {
        p: sig.parameters[p].default for p in ("kl_coef", "penalty", "target_kl", "horizon")
    }
    assert {p.name for p in kind.outputs} == set(_call(_ctx({})))


def test_fixed_coefficient_by_hand() -> None:
    ctx = _ctx({})
    out = _call(ctx, kl_coef=0.1)
    # k1 = logπ − logπ_ref, masked: [[.5, 0, .5], [−.5, 0, (masked) 0]]
    kl = torch.tensor([[0.5, 0.0, 0.5], [-0.5, 0.0, 0.0]])
    torch.testing.assert_close(out["kl"], kl)
    torch.testing.assert_close(
        out["token_level_rewards"], torch.tensor([[-0.05, 0.0, 0.95], [0.05, 2.0, 0.0]])
    )
    # Sequence means 1/3 and −1/4; their batch mean 1/24.
    assert ctx.metrics["actor/reward_kl_penalty"] == pytest.approx(1 / 24)
    assert ctx.metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert ctx.state == {}  # a fixed β keeps no state


def test_abs_penalty_by_hand() -> None:
    out = _call(_ctx({}), kl_coef=1.0, penalty="abs")
    torch.testing.assert_close(out["kl"], torch.tensor([[0.5, 0.0, 0.5], [0.5, 0.0, 0.0]]))
    torch.testing.assert_close(
        out["token_level_rewards"], torch.tensor([[-0.5, 0.0, 0.5], [-0.5, 2.0, 0.0]])
    )


@pytest.mark.parametrize(
    ("target_kl", "factor"),
    [
        # KL̄ = 1/24: e = (1/24)/0.1 − 1 = −0.583 → clipped to −0.2; β·(1 − 0.2·2/10)
        (0.1, 1 - 0.2 * 2 / 10),
        # e = (1/24)/(1/48) − 1 = 1 → clipped to +0.2; β·(1 + 0.2·2/10)
        (1 / 48, 1 + 0.2 * 2 / 10),
        # e = (1/24)/(1/22) − 1 = −1/12, inside the clip; β·(1 − (1/12)·2/10)
        (1 / 22, 1 - (1 / 12) * 2 / 10),
    ],
)
def test_adaptive_coefficient_follows_ziegler_across_steps(target_kl: float, factor: float) -> None:
    state: dict[str, object] = {}  # the executor keeps it; a fresh ctx each step
    beta = 0.2
    for step in range(4):
        ctx = _ctx(state, step)
        out = _call(ctx, kl_coef=0.2, target_kl=target_kl, horizon=10)
        assert ctx.metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(beta)
        torch.testing.assert_close(out["token_level_rewards"], SCORES - beta * out["kl"])
        beta *= factor  # updated with batch size B = 2 after the batch used β
        assert state["kl_coef"] == pytest.approx(beta)


def test_adaptive_coefficient_resumes_from_state_not_from_kl_coef() -> None:
    ctx = _ctx({"kl_coef": 0.05}, step=10)
    _call(ctx, kl_coef=0.2, target_kl=0.1, horizon=10)
    assert ctx.metrics["actor/reward_kl_penalty_coeff"] == 0.05


def test_scores_that_are_not_per_token_are_refused() -> None:
    message = r"token_level_scores \(2,\) and response_mask \(2, 3\).*`token_reward`"
    with pytest.raises(ValueError, match=message):
        kl_penalty(
            _ctx({}),
            token_level_scores=torch.ones(2),
            log_prob=LOG_PROB,
            ref_log_prob=REF_LOG_PROB,
            response_mask=MASK,
        )
