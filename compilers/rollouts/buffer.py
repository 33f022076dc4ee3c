"""The buffer between the producer and the consumer of asynchronous rollouts, and what it
asks of the strategy that runs the producer (`Producer`).

The buffer takes a step's rollout (dropping those too stale under `drop`), measures its
staleness, fills up to what a checkpoint holds (`buffered`) and gives the data cursors
after the last rollout it holds; where and when a rollout is made is the strategy's
(`flowgraph.compilers.rollouts` says what the buffer holds and how admission works).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

import torch

from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.metrics import data_positions
from flowgraph.errors import FlowgraphError
from flowgraph.plan import ExecutionPlan

Cursors = dict[str, dict[str, Any]]
"""Each data source's cursor in its training split (`Batches.cursors`)."""


def need(index: int, staleness: int, origin: int) -> int:
    """The version that generates the rollout of step `index` under `block`: `staleness`
    updates behind, never older than the version the run (re)started from (`origin`)."""
    return max(index - staleness, origin)


class Producer(Protocol):
    """Where the producer runs (`InlineProducer`: the loop; `ProcessProducer`: a process
    of its own; `PoolProducer`: the rollout pool): what the buffer asks of it."""

    @property
    def overlaps(self) -> bool:
        """Generation overlaps the consumer's step (a producer elsewhere): the step's cost
        of it is the time it waited for a rollout."""
        ...

    @property
    def ahead(self) -> int:
        """The rollouts past a step's that are in the buffer before the step takes its own
        (the loop: S, so that at step k those up to k + S are generated with the weights
        of step k; a producer elsewhere: 0, it fills the buffer as it sends)."""
        ...

    def start(self, step: int, first: int, cursors: Cursors) -> None:
        """The loop begins (or resumes) at `step`, the weights of version `step`: produce
        the rollouts of step `first` on (the buffer holds those before it), the data at
        `cursors`."""
        ...

    def next_rollout(self, step: int, metrics: dict[str, float]) -> Rollout:
        """The next rollout in order, the buffer at step `step`: generated now (its node
        seconds into `metrics`) or the producer's next one sent, waited for. Asked when
        the buffer holds none, or, under `block`, to fill it (`ahead`, a checkpoint's)."""
        ...

    def advance(self, step: int, held: int) -> None:
        """Step `step`'s update is done: its weights are version step + 1 (`held`: the
        rollouts in the buffer, received and not yet taken)."""
        ...

    def cursors(self) -> Cursors:
        """The data cursors after the last rollout produced or received."""
        ...

    def load(self, cursors: Cursors | None) -> None:
        """A checkpoint's data cursors (None: start over)."""
        ...

    def generating_s(self) -> float:
        """Seconds the producer has spent producing rollouts so far, the one it is
        producing now included: what the trainer's work overlapped is the difference of
        two readings (`async/overlap_frac`)."""
        ...

    def close(self) -> None:
        """The run is over (or failed)."""
        ...


class Rollouts:
    """The buffer between producer and consumer, filled by its `producer`."""

    def __init__(self, plan: ExecutionPlan, producer: Producer) -> None:
        cut = plan.asynchronous
        assert cut is not None
        self.plan, self.producer = plan, producer
        self.S, self.steps = cut.staleness, plan.trainer.steps
        self.block = cut.admission == "block"
        self.pending: deque[Rollout] = deque()
        self.last = -1
        """The index of the last rollout that came into the buffer."""

    @property
    def overlaps(self) -> bool:
        return self.producer.overlaps

    def start(self, step: int) -> None:
        """The loop begins (or resumes) at `step`: the producer goes on after the
        rollouts the buffer holds (`load`)."""
        first = step + len(self.pending)
        self.last = first - 1
        cursors = self.pending[-1].cursors if self.pending else self.producer.cursors()
        self.producer.start(step, first, cursors)

    def take(self, step: int, metrics: dict[str, float]) -> dict[tuple[str, str], Any]:
        """The producer's outputs for `step`: the rollout, its staleness in `metrics`."""
        dropped, waited = 0, 0.0
        while True:
            item, seconds = self._next(step, metrics)
            waited += seconds
            versions = self.trained_versions(item)
            if self.block or step - int(versions.min()) <= self.S:
                break
            dropped += 1
        metrics["perf/rollout_wait_s"] = waited
        if item.error is not None:
            raise item.error
        metrics.update(item.metrics)
        metrics.update(data_positions(item.cursors))
        staleness = step - versions.double()
        metrics["async/staleness"] = float(staleness.mean())
        metrics["async/staleness_max"] = float(staleness.max())
        if not self.block:
            metrics["async/dropped"] = float(dropped)
        return dict(item.env)

    def trained_versions(self, item: Rollout) -> torch.Tensor:
        """The policy versions that sampled the tokens `item` trains on: per token where
        its rollout records them and partial rollouts may mix them (`AsyncPlan.versions`),
        else the one version that generated it."""
        cut = self.plan.asynchronous
        assert cut is not None
        if cut.partial and item.error is None:
            trained = [item.env[(node, "policy_version")][
                item.env[(node, "response_mask")].bool()] for node in cut.versions]
            versions = torch.cat([v.flatten().cpu() for v in trained])
            if versions.numel():
                return versions
        return torch.tensor([item.version])

    def advance(self, step: int) -> None:
        """Step `step`'s update is done: its weights are version step + 1."""
        self.producer.advance(step, len(self.pending))

    def buffered(self, step: int) -> list[Rollout]:
        """The rollouts a checkpoint after `step` holds (block: those of steps step+1 …
        step+S, waited for), in order."""
        if self.block:
            self._fill(step, min(step + self.S, self.steps - 1), {})
        return list(self.pending)

    def data_cursors(self, step: int | None = None) -> Cursors:
        """The data cursors a checkpoint after `step` holds: after the last rollout it
        holds (`buffered`)."""
        if step is not None:
            self.buffered(step)
        return self.producer.cursors()

    def load(self, items: list[Rollout], cursors: Cursors | None) -> None:
        """A checkpoint's buffer and data cursors (empty, None: start over)."""
        self.pending = deque(items)
        self.producer.load(cursors)

    def close(self) -> None:
        """The run is over (or failed)."""
        self.producer.close()

    def generating_s(self) -> float:
        """The producer's seconds producing so far (`Producer.generating_s`)."""
        return self.producer.generating_s()

    def _next(self, step: int, metrics: dict[str, float]) -> tuple[Rollout, float]:
        """The next rollout in the buffer, and the seconds this process waited for it
        (none where it generated it)."""
        t0 = time.perf_counter()
        if not self.pending:
            self._receive(step, metrics)
        self._fill(step, min(step + self.producer.ahead, self.steps - 1), metrics)
        item = self.pending.popleft()
        waited = time.perf_counter() - t0 if self.producer.overlaps else 0.0
        if self.block and item.index != step:
            raise FlowgraphError(f"internal: the rollout buffer holds step {item.index}'s "
                                 f"batch where step {step}'s was due")
        return item, waited

    def _fill(self, step: int, until: int, metrics: dict[str, float]) -> None:
        """Receive rollouts until the buffer holds that of step `until`."""
        while self.last < until:
            self._receive(step, metrics)

    def _receive(self, step: int, metrics: dict[str, float]) -> None:
        item = self.producer.next_rollout(step, metrics)
        self.last = item.index
        self.pending.append(item)
