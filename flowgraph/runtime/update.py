"""What an update kind is: a loss, and the rows it trains on.

An update kind's implementation (`KindSpec.impl`, a kind with `trains`) is called like
any other, with its inputs and the params it uses as keyword arguments, and returns an
`Update`: its batch and its `Loss`. It trains nothing itself. The executor hands the
record to the worker layer's update loop (`flowgraph.compilers.update_loop`), which
owns everything else — epochs, the seeded shuffle, mini-batches, this worker's share of
each, micro-batches and token budgets, the micro-batch weights, the optimizer and
scheduler steps, the metric means — with the params of `MiniBatching`, which every
update kind declares (`flowgraph.kinds.MINI_BATCH`) and its implementation takes only
where its loss uses one (`packing`). On held-out data the same loop runs the loss's
`held_out` metrics: no backward, no step.

Plain Python: torch is named for the type checker only.

Notation: B rows in the batch (sequences; pairs for DPO), T response length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from flowgraph.objects import defined_at

if TYPE_CHECKING:
    from torch import Tensor

Batch = Mapping[str, "Tensor"]
"""Tensors by name, one row per sequence (pair): the whole batch, or a micro-batch of it."""


class Loss(Protocol):
    """An update kind's loss: a frozen record of its params, the maths in `__call__`
    (torchtune's `PPOLoss` style). The loop calls it on micro-batches."""

    def __call__(self, model: Any, mb: Batch, /) -> tuple[Tensor, dict[str, float]]:
        """Micro-batch `mb`'s loss (a scalar, aggregated over its rows as the loss says)
        and its metrics, by full name (`actor/pg_loss`)."""
        ...

    def denominator(self, mb: Batch, /) -> float:
        """What the loss's aggregation divides by on `mb`: valid tokens (token-mean),
        sequences with a valid token (seq-mean), pairs (DPO). Micro-batch k weighs
        n_k / Σ_j n_j, so the weighted sum of the micro-batch losses is the mini-batch's."""
        ...

    def held_out(self, model: Any, batch: Batch, /) -> dict[str, float]:
        """The metrics it reports on held-out rows (evaluation: no backward, no step)."""
        ...


@dataclass(frozen=True, slots=True)
class Update:
    """What an update kind's implementation returns; the update loop trains on it."""

    batch: Batch
    """Every tensor the loss reads, each (B, ...): the loop cuts them all the same way."""
    loss: Loss
    scope: str = "actor"
    """The prefix of the loop's own metrics: `<scope>/grad_norm`, `<scope>/lr`."""
    responses: tuple[str, ...] = ("response_mask",)
    """The masks of the responses one row runs through the model beside its prompt
    (`prompt_mask`), both (B, T): a token budget counts them (DPO: `chosen_mask` and
    `rejected_mask`, a pair in one forward)."""
    one_step: str = ""
    """Set when the loss holds for one optimizer step per call only (PPO without
    `old_log_prob`): why, and the fix, which end the loop's message when it refuses a
    schedule of more steps."""

    def __post_init__(self) -> None:
        if not self.batch:
            raise ValueError("an Update needs a batch: the tensors its loss reads")
        rows = {name: len(value) for name, value in self.batch.items()}
        if len(set(rows.values())) > 1:
            raise ValueError(f"an Update's tensors must have one row per sequence each; got "
                             f"rows {rows}")
        missing = [m for m in self.responses if m not in self.batch]
        if missing:
            raise ValueError(f"Update.responses names {missing}, which the batch lacks "
                             f"(it holds {sorted(self.batch)})")

    @property
    def rows(self) -> int:
        return len(next(iter(self.batch.values())))


@dataclass(frozen=True, slots=True)
class MiniBatching:
    """The update loop's params. Every update kind declares them (`flowgraph.kinds.
    MINI_BATCH`, where their docs and defaults are; `flowgraph kinds <kind>` lists them),
    and its implementation need not take them."""

    ppo_epochs: int
    mini_batch_size: int | None
    micro_batch_size: int | None
    max_token_len: int | None
    packing: bool
    start_step: int = 0
    """Steps before it skip the update (value warm-up); a plan written before there was
    one has none: 0."""

    @staticmethod
    def of(params: Mapping[str, Any]) -> MiniBatching:
        """The loop's params among a node's (defaults filled)."""
        return MiniBatching(**{name: params[name] for name in LOOP_PARAMS if name in params})


LOOP_PARAMS = tuple(f.name for f in fields(MiniBatching))
"""The params the update loop reads."""


def one_optimizer_step(params: Mapping[str, object], batch: int | None) -> bool:
    """An update with these params takes exactly one optimizer step on a batch of `batch`
    rows, as the loop counts them: one epoch, and one mini-batch (`mini_batch_size` null,
    or at least the batch; with the batch unknown, only null is sure)."""
    epochs, mini = params.get("ppo_epochs"), params.get("mini_batch_size")
    if epochs != 1:
        return False
    if mini is None:
        return True
    return batch is not None and isinstance(mini, int) and mini >= batch


def policy_loss_problem(fn: Any, result: Any, response_mask: Tensor) -> str | None:
    """Why what policy loss `fn` returned is not `(per-token losses (B, T), metrics)`,
    naming the loss and where it is defined; None when it is. `ppo_actor_update` raises
    it at run time, `flowgraph.testing.assert_policy_loss_honours_contract` before: a (B,)
    loss would otherwise fail inside the aggregation, naming no loss — or, where B = T,
    broadcast and train on the wrong numbers."""
    where = defined_at(fn)
    name = f"policy loss `{getattr(fn, '__qualname__', fn)}`" + (f" ({where})" if where else "")
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
        return (f"{name} returned {type(result).__name__}; a policy loss returns "
                "(per-token losses, {metric name: float})")
    shape = tuple(getattr(result[0], "shape", ()))
    want = tuple(response_mask.shape)
    if shape != want:
        return (f"{name} returned losses of shape {shape}; a policy loss returns one loss "
                f"per response token, (B, T) = {want}, which the update aggregates by "
                "loss_agg_mode")
    return None
