"""Reward shaping kinds: DAPO's overlong punishment equals verl 0.9.1's DAPO reward
manager (fixture written by scripts/verl_dapo_fixtures.py), the length penalty and the
weighted sum by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowgraph.nodes.shaping import length_penalty, overlong_penalty, repeat, weighted_sum
from flowgraph.runtime import NodeContext

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "dapo_overlong.pt"
DAPO = torch.load(FIXTURE, weights_only=False)["cases"]


@pytest.mark.parametrize("case", DAPO, ids=lambda c: "L{max_response_length}-buf"
                         "{overlong_buffer_len}-x{penalty_factor}".format(**c["params"]))
def test_overlong_penalty_equals_verls_dapo_reward_manager(case: dict) -> None:
    out = overlong_penalty(case["scores"], case["response_mask"], **case["params"])
    torch.testing.assert_close(out["scores"], case["shaped"], rtol=0, atol=0)
    torch.testing.assert_close(out["penalty"], case["penalty"], rtol=0, atol=0)


def test_overlong_penalty_ramp_by_hand() -> None:
    # L_max = T = 8, buffer 4: lengths 0..4 free, then -1/4 per token down to -1 at 8.
    mask = (torch.arange(8)[None, :] < torch.tensor([0, 4, 5, 6, 8])[:, None]).long()
    out = overlong_penalty(torch.ones(5), mask, overlong_buffer_len=4)
    assert out["penalty"].tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert out["scores"].tolist() == [1.0, 1.0, 0.75, 0.5, 0.0]


@pytest.mark.parametrize("buffer", [0, 9])
def test_overlong_penalty_rejects_a_buffer_outside_the_budget(buffer: int) -> None:
    with pytest.raises(ValueError, match=r"overlong_buffer_len must be in \(0, L_max = 8\]"):
        overlong_penalty(torch.ones(2), torch.ones(2, 8), overlong_buffer_len=buffer)


def test_length_penalty_by_hand() -> None:
    mask = (torch.arange(6)[None, :] < torch.tensor([2, 4, 6])[:, None]).long()
    scores = torch.tensor([1.0, 0.0, 0.5])
    near = length_penalty(scores, mask, coef=0.5, target_length=4)
    assert near["penalty"].tolist() == [-1.0, 0.0, -1.0]  # |2-4|, |4-4|, |6-4| times 0.5
    assert near["scores"].tolist() == [0.0, 0.0, -0.5]
    short = length_penalty(scores, mask, coef=0.1)
    torch.testing.assert_close(short["penalty"], torch.tensor([-0.2, -0.4, -0.6]))


def test_weighted_sum_weights_each_term_and_reports_its_mean() -> None:
    ctx = NodeContext("total", "weighted_sum", step=0, seed=0)
    out = weighted_sum(ctx, weights={"acc": 1.0, "fmt": 0.5},
                       acc=torch.tensor([1.0, 0.0]), fmt=torch.tensor([1.0, 1.0]),
                       overlong=torch.tensor([0.0, -0.5]))
    assert out["scores"].tolist() == [1.5, 0.0]  # 1 + 0.5 + 0 ; 0 + 0.5 - 0.5
    assert ctx.metrics == {"reward/acc/mean": 0.5, "reward/fmt/mean": 1.0,
                           "reward/overlong/mean": -0.25}


def test_weighted_sum_names_a_weight_without_a_term() -> None:
    ctx = NodeContext("total", "weighted_sum", step=0, seed=0)
    with pytest.raises(ValueError, match="weights name fromat, which no input wires; "
                                         "the inputs are acc"):
        weighted_sum(ctx, weights={"fromat": 1.0}, acc=torch.ones(2))


def test_repeat_gives_each_sample_its_prompts_value_in_generates_order() -> None:
    ctx = NodeContext("baseline", "repeat", step=0, seed=0, dims={"N": 3})
    assert repeat(torch.tensor([1.0, 2.0]), ctx)["x"].tolist() == [1, 1, 1, 2, 2, 2]
    assert repeat(["a", "b"], ctx, n=2)["x"] == ["a", "a", "b", "b"]
    with pytest.raises(ValueError, match="repeat: n must be >= 1"):
        repeat(torch.ones(2), NodeContext("baseline", "repeat", step=0, seed=0))
