"""The filter node (DAPO's dynamic sampling): which groups it keeps, what it passes on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgraph.nodes.filter import filter_groups, keep_mask

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "dapo_filter.json"


def test_std_nonzero_drops_the_groups_verl_drops() -> None:
    """50 groups (all-equal ones, singletons, three 0.1s, random ones) through verl
    0.9.1's own DAPO filter (scripts/verl_dapo_fixtures.py)."""
    data = json.loads(FIXTURE.read_text())
    scores = torch.tensor([s for g in data["groups"] for s in g], dtype=torch.float32)
    index = torch.tensor([i for i, g in enumerate(data["groups"]) for _ in g])
    keep = keep_mask(scores, index)
    dropped = sorted({int(i) for i in index[~keep]})
    assert dropped == data["dropped"]
    assert data["dropped"], "the fixture drops some groups"


def test_passes_through_the_kept_rows_renumbered_from_the_offset() -> None:
    # groups (by index): 5 -> (1, 1) dropped; 3 -> (0, 1) kept; 7 -> (0, 0) dropped;
    # 9 -> (1) singleton kept; 2 -> (2) singleton kept. Kept rows: 2, 3, 6, 7.
    scores = torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 2])
    index = torch.tensor([5, 5, 3, 3, 7, 7, 9, 2])
    rows = torch.arange(8)
    out = filter_groups(scores, index, rows[:, None].expand(8, 2), torch.ones(8, 2),
                        rows[:, None].expand(8, 3), torch.ones(8, 3),
                        rollout_log_prob=-rows[:, None].float().expand(8, 3),
                        ground_truth=[str(r) for r in range(8)], offset=4)
    assert out["prompts"][:, 0].tolist() == [2, 3, 6, 7]
    assert out["responses"][:, 0].tolist() == [2, 3, 6, 7]
    assert out["rollout_log_prob"][:, 0].tolist() == [-2, -3, -6, -7]
    assert out["ground_truth"] == ["2", "3", "6", "7"]
    assert out["scores"].tolist() == [0, 1, 1, 2]
    assert out["index"].tolist() == [4, 4, 5, 6]  # first-seen order, from the offset


@pytest.mark.parametrize(("low", "high", "kept"), [
    (None, None, [0, 1, 2]), (0.2, None, [1, 2]), (None, 0.9, [0, 1]), (0.2, 0.9, [1])])
def test_mean_in_range_keeps_the_groups_with_a_mean_within_bounds(
        low: float | None, high: float | None, kept: list[int]) -> None:
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # group means 0, 0.5, 1
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    keep = keep_mask(scores, index, "mean_in_range", low, high)
    assert sorted({int(i) for i in index[keep]}) == kept


def test_an_unknown_metric_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="metric must be `std_nonzero` or `mean_in_range`"):
        keep_mask(torch.zeros(2), torch.zeros(2, dtype=torch.long), "std")


def test_a_predicate_sees_each_groups_scores_and_picks_the_groups() -> None:
    """`fn` replaces `metric`: called once per group, in order of the ids, with that
    group's scores (floats, row order); a numpy bool is a bool."""
    seen: list[list[float]] = []

    def best_over_half(scores: list[float]) -> bool:
        seen.append(scores)
        return max(scores) > 0.5 if len(scores) > 1 else bool(np.True_)

    scores = torch.tensor([1.0, 1, 0, 0.25, 0, 0, 1])
    index = torch.tensor([5, 5, 3, 3, 7, 7, 9])
    keep = keep_mask(scores, index, metric="mean_in_range", max_score=-1.0,
                     fn=best_over_half)
    assert seen == [[0.0, 0.25], [1.0, 1.0], [0.0, 0.0], [1.0]]
    assert keep.tolist() == [True, True, False, False, False, False, True]


def test_a_predicate_that_raises_or_returns_no_bool_names_the_group_and_its_def() -> None:
    def picky(scores: list[float]) -> bool:
        raise ZeroDivisionError("bad group")

    def counts(scores: list[float]) -> int:
        return len(scores)

    scores, index = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([4, 4, 8])
    with pytest.raises(ValueError, match=r"filter predicate `picky` \(.*test_filter.py:\d+\) "
                       r"on group 4 \(scores \[1.0, 0.0\]\) raised ZeroDivisionError: bad "
                       r"group") as caught:
        keep_mask(scores, index, fn=picky)
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    with pytest.raises(TypeError, match=r"`counts` .* on group 4 .* returned 2 \(int\), not a "
                       r"bool"):
        keep_mask(scores, index, fn=counts)
