"""Group filter: keep the sample groups a predicate accepts (DAPO's dynamic sampling).

DAPO (Yu et al. 2025, sec. 3.2 "Dynamic Sampling"; verl `recipe/dapo`,
`filter_groups`) drops the groups whose rewards are all equal: their group-relative
advantage is zero, so they add no gradient and only shrink the effective batch. The
run then draws more prompts until the batch is full again; that loop belongs to the
executor (the plan's `resample` record), this node filters one generation batch.

Design: the filter passes through every per-sequence tensor the rest of the step
reads (prompts, responses, their masks, scores, index, and optionally the rollout's
log-probs and ground truth), subset to the kept rows. Declared pass-through ports keep
every downstream contract checkable: the outputs have the filter's own batch dim
(`g*n`, the target number of groups), and the checker refuses a node after the filter
that reads an unfiltered tensor. A keep mask the executor applied to undeclared ports
would leave the checker blind to which tensors were subset.

A user's predicate (`fn`: the Python function itself, `file.py:keep`, `module:keep`)
replaces `metric`: `keep(scores: list[float]) -> bool`, called once per group with that
group's scores in row order (`flowgraph.runtime.reward_call.FILTER_CALL`).

Kept groups are renumbered `offset, offset+1, ...` in order of first appearance, so
groups kept by successive tries of a step stay distinct when the executor joins them.

Notation: b sequences of one generation batch, G groups in it, k kept sequences,
P prompt length, T response length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowgraph.objects import defined_at
from flowgraph.runtime.reward_call import function_name, load_function

__all__ = ["filter_groups", "keep_mask"]


def keep_mask(scores: Tensor, index: Tensor, metric: str = "std_nonzero",
              min_score: float | None = None, max_score: float | None = None,
              fn: str | Callable[..., object] | None = None) -> Tensor:
    """(b,) bool: the rows of the groups the predicate keeps.

    `fn` (set, `metric` is not used): the user's predicate, `fn(scores) -> bool` once per
    group, in order of the groups' ids, with the group's scores as a list of floats in row
    order.

    `std_nonzero` (DAPO): the group's scores have a nonzero standard deviation (are not
    all equal); a group of one sample is kept (verl: `len(values) > 1 and std == 0`
    drops). `mean_in_range`: min_score <= mean <= max_score
    (an open bound is no bound).
    """
    ids, inverse = torch.unique(index, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    if fn is not None:
        return _predicate(load_function(fn, {}, "filter"), scores, ids, inverse)[inverse]
    s = scores.detach().to(torch.float64)
    count = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(s))
    mean = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse, s) / count
    if metric == "std_nonzero":
        # verl's test, np.std(values) == 0 with the population std in float64, taken the
        # way numpy takes it (mean, then squared deviations): a mean of equal values can
        # round off (np.std([0.1] * 3) = 1.4e-17 in float64), and verl keeps such a group.
        dev2 = torch.zeros(groups, dtype=torch.float64).index_add_(
            0, inverse, (s - mean[inverse]) ** 2)
        keep = (dev2 != 0) | (count == 1)
    elif metric == "mean_in_range":
        keep = torch.ones(groups, dtype=torch.bool)
        if min_score is not None:
            keep &= mean >= min_score
        if max_score is not None:
            keep &= mean <= max_score
    else:
        raise ValueError(f"filter: metric must be `std_nonzero` or `mean_in_range`; got "
                         f"{metric!r}")
    return keep[inverse]


def _predicate(fn: Callable[..., object], scores: Tensor, ids: Tensor, inverse: Tensor
               ) -> Tensor:
    """(G,) bool: `fn` on each group's scores. A predicate that raises, or returns
    anything but a bool, is an error naming the group and the function's `def` line (the
    executor adds the node and the step; the predicate's own exception is the cause, its
    frame the line reported)."""
    values = scores.detach().to(torch.float64).cpu().tolist()
    rows: list[list[float]] = [[] for _ in range(ids.numel())]
    for value, g in zip(values, inverse.tolist(), strict=True):
        rows[g].append(value)
    keep = []
    for g, group in enumerate(rows):
        where = (f"filter predicate `{function_name(fn)}` ({defined_at(fn) or 'its def'}) "
                 f"on group {int(ids[g])} (scores {group})")
        try:
            result = fn(group)
        except Exception as exc:
            raise ValueError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, (bool, np.bool_)):
            raise TypeError(f"{where} returned {result!r} ({type(result).__name__}), not a "
                            "bool: return True to keep the group, False to drop it")
        keep.append(bool(result))
    return torch.tensor(keep, dtype=torch.bool)


def _first_seen_rank(index: Tensor) -> Tensor:
    """Each row's group numbered 0, 1, ... in order of the group's first row (unique()
    numbers groups in sorted order instead)."""
    uniq, inverse = torch.unique(index, return_inverse=True)
    positions = torch.arange(index.numel(), device=index.device)
    first = torch.full((uniq.numel(),), index.numel(), device=index.device).scatter_reduce(
        0, inverse, positions, "amin")
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(uniq.numel(), device=index.device)
    return rank[inverse]


def filter_groups(scores: Tensor, index: Tensor, prompts: Tensor, prompt_mask: Tensor,
                  responses: Tensor, response_mask: Tensor,
                  rollout_log_prob: Tensor | None = None, ground_truth: list[Any] | None = None,
                  metric: str = "std_nonzero", min_score: float | None = None,
                  max_score: float | None = None, groups: int | None = None,
                  max_tries: int = 10, offset: int = 0,
                  fn: str | Callable[..., object] | None = None) -> dict[str, Any]:
    """The rows of the kept groups of every given tensor, index renumbered from `offset`.
    `groups` and `max_tries` are the executor's (the refill loop's); `offset` is the
    number of groups earlier tries of the step kept."""
    if scores.shape[0] != index.shape[0]:
        raise ValueError(f"filter: scores has {scores.shape[0]} rows, index "
                         f"{index.shape[0]}; both are one per sequence")
    keep = keep_mask(scores, index, metric, min_score, max_score, fn)
    rows = keep.nonzero().squeeze(1).to(index.device)
    kept_index = index[rows]
    out: dict[str, Any] = {
        "scores": scores[rows], "index": _first_seen_rank(kept_index) + offset,
        "prompts": prompts[rows], "prompt_mask": prompt_mask[rows],
        "responses": responses[rows], "response_mask": response_mask[rows],
    }
    if rollout_log_prob is not None:
        out["rollout_log_prob"] = rollout_log_prob[rows]
    if ground_truth is not None:
        out["ground_truth"] = [ground_truth[i] for i in rows.tolist()]
    return out
