"""The producer in the training loop (fsdp): no overlap, the schedule of a producer
process (`flowgraph.compilers.rollouts`)."""

from __future__ import annotations

import time

from flowgraph.compilers.batches import Batches
from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.rollouts.buffer import Cursors
from flowgraph.compilers.rollouts.producer import ProducerNodes
from flowgraph.compilers.worker import ExecOptions, Worker
from flowgraph.plan import ExecutionPlan


class InlineProducer:
    """The producer runs in the executor's loop: at step k, the rollouts of steps up to
    k + S that are missing, with the weights of step k."""

    overlaps = False

    def __init__(self, plan: ExecutionPlan, batches: Batches, worker: Worker,
                 names: list[str], opts: ExecOptions) -> None:
        cut = plan.asynchronous
        assert cut is not None
        self.ahead = cut.staleness
        self.nodes = ProducerNodes(plan, batches, worker, names, opts)
        self.next_index = 0
        """The step whose rollout is produced next."""
        self.generated = 0.0
        """Seconds spent producing rollouts."""

    def start(self, step: int, first: int, cursors: Cursors) -> None:
        self.nodes.origin, self.next_index = step, first

    def next_rollout(self, step: int, metrics: dict[str, float]) -> Rollout:
        """The next rollout, generated with the weights of `step`."""
        produced: dict[str, float] = {}
        t0 = time.perf_counter()
        item = self.nodes.produce(self.next_index, step, produced)
        self.generated += time.perf_counter() - t0
        # Node seconds count in the step that spent them; the rest goes with the rollout.
        for k, v in produced.items():
            if k.startswith("timing_s/"):
                metrics[k] = metrics.get(k, 0.0) + v
            else:
                item.metrics[k] = v
        self.next_index += 1
        return item

    def advance(self, step: int, received: int) -> None:
        """Nothing to send: the next rollouts are generated with this loop's weights."""

    def cursors(self) -> Cursors:
        return self.nodes.batches.cursors()

    def load(self, cursors: Cursors | None) -> None:
        """Nothing to keep: the datasets themselves are the producer's, restored as they
        are."""

    def generating_s(self) -> float:
        return self.generated

    def close(self) -> None:
        """Nothing runs beside the loop."""
