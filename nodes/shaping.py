"""Reward shaping — terms added to an outcome score — and per-prompt values repeated
for the prompt's samples, as small kinds usable from YAML.

* `overlong_penalty` — DAPO's soft overlong punishment (Yu et al. 2025, §3.4, verl's
  `DAPORewardManager`): with L_max the response budget and L_cache the buffer before it,
  a response of |y| valid tokens gets

      R_len(y) = min(−(|y| − (L_max − L_cache)) / L_cache · factor, 0)

  nothing up to L_max − L_cache, then falling linearly to −factor at L_max.
* `length_penalty` — −coef · | |y| − target | (no target: −coef · |y|), in tokens.
* `weighted_sum` — Σ_k w_k · term_k over terms the graph names as inputs; each term's
  mean is reported as `reward/<term>/mean`.

Each returns the shaped `scores` and the term it added, so a graph can log or reuse it.

* `repeat` — a per-prompt value n times in a row, the order `generate` gives a prompt's
  n samples in (ReMax's greedy baseline with N > 1: verl repeats the batch with
  `interleave=True` after scoring the greedy responses).

Notation: b sequences of the node, T response length.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowgraph.runtime import NodeContext

__all__ = ["length_penalty", "overlong_penalty", "repeat", "repeat_rows", "weighted_sum"]


def overlong_penalty(
    scores: Tensor,
    response_mask: Tensor,
    overlong_buffer_len: int,
    max_response_length: int | None = None,
    penalty_factor: float = 1.0,
) -> dict[str, Tensor]:
    """scores (b,) + R_len (b,), and `penalty` = R_len (b,), in the scores' dtype.

    L_max defaults to T, the length every response was cut at. Like verl, the penalty
    is computed in float32 from the count of valid response tokens."""
    # Yu et al. 2025 (DAPO), eq. 13; verl workers/reward_manager/dapo.py
    L_max = max_response_length or response_mask.shape[-1]
    if not 0 < overlong_buffer_len <= L_max:
        raise ValueError(
            f"overlong_penalty: overlong_buffer_len must be in (0, L_max = {L_max}] "
            f"(max_response_length, else T); got {overlong_buffer_len}")
    length = response_mask.sum(-1)
    exceed = length - (L_max - overlong_buffer_len)
    penalty = torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)
    penalty = penalty.to(torch.float32).to(scores.dtype)
    return {"scores": scores + penalty, "penalty": penalty}


def length_penalty(
    scores: Tensor,
    response_mask: Tensor,
    coef: float = 0.01,
    target_length: int | None = None,
) -> dict[str, Tensor]:
    """scores (b,) − coef·| |y| − target | (b,), and that `penalty` (≤ 0)."""
    length = response_mask.sum(-1).to(scores.dtype)
    distance = length if target_length is None else (length - target_length).abs()
    penalty = -coef * distance
    return {"scores": scores + penalty, "penalty": penalty}


def weighted_sum(
    ctx: NodeContext, weights: Mapping[str, float] | None = None, **terms: Tensor
) -> dict[str, Tensor]:
    """scores (b,) = Σ_k w_k · term_k; a term without a weight counts once."""
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(terms))
    if unknown:
        raise ValueError(
            f"weighted_sum: weights name {', '.join(unknown)}, which no input wires; the "
            f"inputs are {', '.join(sorted(terms))}")
    first = next(iter(terms.values()))
    total = torch.zeros_like(first)
    for name, term in terms.items():
        if term.shape != first.shape:
            raise ValueError(
                f"weighted_sum: term `{name}` has shape {tuple(term.shape)}, the first term "
                f"{tuple(first.shape)}; every term is one number per sequence")
        total = total + weights.get(name, 1.0) * term
        ctx.metrics[f"reward/{name}/mean"] = float(term.float().mean())
    return {"scores": total}


def repeat(
    x: Tensor | Sequence[Any], ctx: NodeContext, n: int | None = None
) -> dict[str, Tensor | list[Any]]:
    """x (b, …) -> (b*n, …): row i becomes rows i*n … i*n + n − 1; a list (strings,
    objects) likewise. n defaults to the graph's N."""
    n = n or ctx.dims.get("N")
    if n is None or n < 1:
        raise ValueError(f"repeat: n must be >= 1 (the param, else the graph's N); got {n}")
    if isinstance(x, Tensor):
        return {"x": x.repeat_interleave(n, dim=0)}
    return {"x": repeat_rows(x, n)}


def repeat_rows(values: Sequence[Any], n: int) -> list[Any]:
    """Each value n times in a row, each copy its own (`copy.deepcopy`): a reward that
    writes into one sample's `extra_info` dict must not change its siblings'."""
    return [copy.deepcopy(v) for v in values for _ in range(n)]
