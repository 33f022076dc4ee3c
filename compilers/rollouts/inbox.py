"""What the trainer keeps of each rollout a producer elsewhere sends (a process of its
own, the rollout pool's worker): `ProcessProducer` and `PoolProducer` hold an `Inbox`."""

from __future__ import annotations

from flowgraph.compilers.batches import Batches
from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.rollouts.buffer import Cursors
from flowgraph.compilers.worker import Worker


class Inbox:
    """The rollouts received, in order: their data cursors and node state are what a
    checkpoint of the trainer holds, though its own datasets and nodes never ran them."""

    def __init__(self, batches: Batches, worker: Worker) -> None:
        self.batches, self.worker = batches, worker
        self.cursors: Cursors | None = None
        """The data cursors after the last rollout received (None: the datasets')."""

    def receive(self, item: Rollout) -> Rollout:
        """`item`, sent: its cursors and node state are now what a checkpoint holds."""
        if item.error is None:
            self.cursors = item.cursors
            for name, state in item.node_state.items():  # what a checkpoint saves of them
                self.worker.node_state[name] = state
        return item

    def data_cursors(self) -> Cursors:
        """The data cursors after the last rollout received (or loaded)."""
        if self.cursors is not None:
            return self.cursors
        return self.batches.cursors()
