"""The reward of benchmarks/bench_vs_trl.py as a flowgraph kind: the share of a
response's valid tokens equal to `target` (TRL gets the same function of its
completion ids).

Notation: b sequences, T response length.
"""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor

from flowgraph import node_kind


@node_kind("target_token_reward", outputs=["scores"], category="reward")
def target_token_reward(responses: Int[Tensor, "b T"], response_mask: Int[Tensor, "b T"],
                        target: int = 0) -> Float[Tensor, " b"]:
    mask = response_mask.float()
    return ((responses == target).float() * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
