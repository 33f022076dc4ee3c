"""The update loop: every update kind's loss trained by one loop, verl's
`dp_actor.update_policy`.

An update kind's implementation returns an `Update` (`flowgraph.runtime.update`): its
batch and its loss. The executor hands it here (`train`), with the node's mini-batch
params and this worker's share of a data-parallel update:

    for epoch in range(ppo_epochs):              # permutation seeded by (seed, step, epoch)
        for each mini-batch of M rows:            # one optimizer step
            for each micro-batch k of m:          # gradient accumulation
                (w_k · L_k).backward()
            ctx.optimizer_step(): the grad norm, clipped; non-finite → NonFiniteError,
                                  model untouched
    scheduler.step()                             # once per call: training steps, as verl

Micro-batch weights. L_k is micro-batch k's own loss, aggregated as the loss says, and
w_k = n_k / Σ_j n_j, with n the aggregation's denominator (`Loss.denominator`): valid
tokens (token-mean), sequences with a valid token (both seq-mean modes), pairs (DPO).
Then Σ_k w_k L_k *is* the mini-batch loss, so the accumulated gradient equals the
one-shot mini-batch gradient for every mode and every m: verl's global normalisation
(`agg_loss` with `batch_num_tokens` / `global_batch_size`). Reported metrics are
weighted the same way within a mini-batch, then averaged over the optimizer steps.

The shuffle uses its own `torch.Generator`, so the global RNG is untouched and a
resumed step reshuffles exactly as the original run did.

Data parallel: every worker gets the whole batch and its `rank` of `size`; each trains
on its contiguous share of every mini-batch, so a run on N workers steps through the
same mini-batches as on one. The weights' denominators are the whole mini-batch's, the
gradients are summed over the workers by `ctx.optimizer_step` and the metrics by
`ctx.workers.sum`.

Held out (`evaluate`): the loss's `held_out` metrics on the whole batch, in one pass;
no backward, no step, no schedule.

Notation: B rows in the batch (sequences; pairs for DPO), M mini_batch_size (global),
m micro_batch_size (per worker), P prompt length, T response length.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch
from torch import Tensor

from flowgraph.errors import NonFiniteError
from flowgraph.nodes.logprob import micro_batches, sequence_lengths
from flowgraph.runtime import NodeContext
from flowgraph.runtime.update import Batch, MiniBatching, Update

__all__ = ["evaluate", "train"]


def train(ctx: NodeContext, update: Update, params: Mapping[str, Any], *, rank: int = 0,
          size: int = 1) -> None:
    """Train `ctx.model` on `update` as the node's mini-batch `params` say, this worker
    being `rank` of the `size` that run it; metric means into `ctx.metrics`."""
    _check(ctx, update)
    if ctx.model is None or ctx.optimizer is None:
        raise ValueError(
            f"update node `{ctx.node}` needs ctx.model and ctx.optimizer; got "
            f"model={type(ctx.model).__name__}, "
            f"optimizer={type(ctx.optimizer).__name__}"
        )
    loop = MiniBatching.of(params)
    if ctx.step < loop.start_step:  # value warm-up: another update trains meanwhile
        return
    B = update.rows
    M, m = _schedule(B, loop, size)
    if update.one_step and (loop.ppo_epochs != 1 or M < B):
        raise ValueError(
            f"{ctx.kind} takes {loop.ppo_epochs * B // M} optimizer steps (ppo_epochs="
            f"{loop.ppo_epochs}, mini_batch_size={loop.mini_batch_size} of {B} rows), but "
            f"{update.one_step}")

    def split(mine: Batch) -> list[Tensor]:
        lengths = sequence_lengths(mine["prompt_mask"], *(mine[r] for r in update.responses))
        return micro_batches(lengths, m, loop.max_token_len, per_row=len(update.responses),
                             workers=ctx.workers, packing=loop.packing)

    plan = (
        mini
        for epoch in range(loop.ppo_epochs)
        for mini in _mini_batches(update, _permutation(ctx, epoch, B), M, rank, size, split)
    )
    with torch.enable_grad():  # an executor may call nodes under no_grad
        steps = [_optimizer_step(ctx, total, micro, update, size) for total, micro in plan]
    if ctx.scheduler is not None:  # once per training step, as verl's lr_scheduler
        ctx.scheduler.step()
    _report(ctx, update, steps)


def evaluate(ctx: NodeContext, update: Update) -> None:
    """The loss's held-out metrics on `update`'s whole batch into `ctx.metrics`: the
    loop's evaluation mode, one pass in order, no backward, no step."""
    _check(ctx, update)
    with torch.no_grad():
        ctx.metrics.update(update.loss.held_out(ctx.model, update.batch))


def _check(ctx: NodeContext, update: object) -> None:
    if not isinstance(update, Update):
        raise TypeError(
            f"update kind `{ctx.kind}` returned {type(update).__name__}; an update kind's "
            "implementation returns flowgraph.runtime.update.Update(batch=..., loss=...), "
            "which the update loop trains on")


def _schedule(B: int, loop: MiniBatching, dp_size: int) -> tuple[int, int]:
    """(M, m): M | B global rows per mini-batch, m | M/dp_size rows per micro-batch on
    each worker (with `max_token_len` the budget cuts the micro-batches instead); the
    message names the numbers that do not fit."""
    M, micro = loop.mini_batch_size or B, loop.micro_batch_size
    if B < 1 or loop.ppo_epochs < 1:
        raise ValueError(f"an update needs B >= 1 and ppo_epochs >= 1; got B={B}, "
                         f"ppo_epochs={loop.ppo_epochs}")
    if B % M:
        raise ValueError(
            f"mini_batch_size={M} does not divide the batch of {B} sequences; "
            f"use a divisor of {B}, or null for the whole batch"
        )
    if M % dp_size:
        raise ValueError(
            f"mini_batch_size={M} does not split evenly over {dp_size} data-parallel "
            f"workers; use a multiple of {dp_size}"
        )
    if loop.max_token_len is not None and micro is not None:
        raise ValueError(f"micro_batch_size={micro} and max_token_len={loop.max_token_len}: "
                         "set one (rows per micro-batch, or a token budget)")
    m = micro or M // dp_size
    if (M // dp_size) % m:
        raise ValueError(
            f"micro_batch_size={m} does not divide the {M // dp_size} rows of a mini-batch "
            f"on each of {dp_size} worker(s); use a divisor of {M // dp_size}, or null"
        )
    return M, m


def _permutation(ctx: NodeContext, epoch: int, B: int) -> Tensor:
    """A permutation of range(B) that depends on (seed, step, epoch) only."""
    key = hashlib.blake2b(f"{ctx.seed}/{ctx.step}/{epoch}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    return torch.randperm(B, generator=generator)


def _rows(batch: Batch, rows: Tensor) -> Batch:
    return {k: v[rows.to(v.device)] for k, v in batch.items()}


def _mini_batches(
    update: Update, order: Tensor, M: int, rank: int, size: int,
    split: Callable[[Batch], list[Tensor]],
) -> list[tuple[float, list[Batch]]]:
    """The rows of the batch in `order` as B/M mini-batches, each as (its whole loss
    denominator, this worker's M/size rows of it in the micro-batches `split` cuts)."""
    out = []
    batch, denominator = update.batch, update.loss.denominator
    for mini in order.split(M):
        mine = _rows(batch, mini.tensor_split(size)[rank])
        total = denominator(_rows(batch, mini)) if size > 1 else None
        micro = [_rows(mine, rows) for rows in split(mine)]
        out.append((total if total is not None else sum(map(denominator, micro)), micro))
    return out


def _abort(ctx: NodeContext, what: str) -> NoReturn:
    ctx.model.zero_grad(set_to_none=True)  # nothing of the bad step survives
    raise NonFiniteError(ctx.node, ctx.step, what)


def _optimizer_step(ctx: NodeContext, total: float, micro_batches: list[Batch],
                    update: Update, size: int) -> dict[str, float]:
    """Accumulate w_k·L_k over the micro-batches, then one optimizer step.

    `total` is the mini-batch's loss denominator over all workers and w_k = n_k/total,
    so the gradients summed over the workers (`ctx.optimizer_step`) are the whole
    mini-batch's gradient, and so are the metrics' weighted sums.
    """
    sizes = [update.loss.denominator(mb) for mb in micro_batches]
    sums: dict[str, float] = defaultdict(float)
    ctx.model.zero_grad(set_to_none=True)
    for mb, n in zip(micro_batches, sizes, strict=True):
        # No valid token anywhere: every L_k is 0, any weights do.
        w = n / total if total else 1 / (len(sizes) * size)
        loss, stats = update.loss(ctx.model, mb)
        if not ctx.workers.all(math.isfinite(loss.item())):  # all stop, or none waits
            _abort(ctx, "loss")
        if loss.requires_grad:  # else no valid token reached the model: a zero gradient
            (w * loss).backward()
        for name, value in stats.items():
            sums[name] += w * value
    metrics = ctx.workers.sum(sums)
    metrics["grad_norm"] = ctx.optimizer_step()
    metrics["lr"] = ctx.optimizer.param_groups[0]["lr"]  # the scheduler moves it later
    return metrics


def _report(ctx: NodeContext, update: Update, steps: list[dict[str, float]]) -> None:
    """Each metric's mean over the optimizer steps; the loop's own under `update.scope`."""
    for name in steps[0]:
        full = f"{update.scope}/{name}" if name in ("grad_norm", "lr") else name
        ctx.metrics[full] = sum(s[name] for s in steps) / len(steps)
