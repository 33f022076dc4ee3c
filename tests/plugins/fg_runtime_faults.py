"""Plugin kinds that misbehave on purpose, for the executor's fault tests."""

import os

import torch
from jaxtyping import Float, Int
from torch import Tensor

from flowgraph.registry import node_kind

# The scores read ctx.step (faults at a given step): category `custom`, which pass
# `hoist` never moves to the prologue, where a `reward` reading only data would go.


@node_kind("prompt_score", outputs=["scores"], category="custom")
def prompt_score(ctx, input_ids: Int[Tensor, "b P"], nan_at: int = -1,
                 say: str = "") -> Float[Tensor, " b"]:
    """Mean token id per prompt; NaN for the whole batch at step `nan_at`. `say`: each
    step, a line on stdout (a print) and one on stderr at the file descriptor (as C code
    writes), naming the process's rank (`RANK`)."""
    if say:
        rank = os.environ.get("RANK", "-")
        print(f"{say} on stdout, rank {rank}, step {ctx.step}", flush=True)
        os.write(2, f"{say} on fd 2, rank {rank}, step {ctx.step}\n".encode())
    scores = input_ids.float().mean(-1)
    return scores * float("nan") if ctx.step == nan_at else scores


@node_kind("wide_score", outputs=["scores"], category="custom")
def wide_score(input_ids: Int[Tensor, "b P"]) -> Float[Tensor, " b"]:
    """Declares (b,) but returns (b, 2): a reward head with two labels."""
    return torch.zeros(input_ids.shape[0], 2)


@node_kind("fragile_logprob", outputs=["log_prob"], category="model", model="required")
def fragile_logprob(ctx, model, prompts: Int[Tensor, "b P"], prompt_mask: Int[Tensor, "b P"],
                    responses: Int[Tensor, "b T"], response_mask: Int[Tensor, "b T"],
                    fail_at: int = -1) -> Float[Tensor, "b T"]:
    """Zero log-probs; raises at step `fail_at` (runs where its model lives: a worker)."""
    if ctx.step == fail_at:
        raise RuntimeError("fragile_logprob failed on purpose")
    return torch.zeros(responses.shape, dtype=torch.float32)


@node_kind("brittle_score", outputs=["scores"], category="custom")
def brittle_score(ctx, input_ids: Int[Tensor, "b P"], fail_at: int = -1) -> Float[Tensor, " b"]:
    """Mean token id per prompt; raises at step `fail_at`, as a user's buggy reward does."""
    weights = {} if ctx.step == fail_at else {0: 1.0}
    return input_ids.float().mean(-1) * weights[0]  # the user's bug: KeyError at fail_at
