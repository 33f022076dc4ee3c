"""What the trainer keeps of a rollout sent by a producer elsewhere (`Inbox`): its data
cursors and its nodes' state, unless the rollout holds a NaN (then nothing of it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.rollouts.inbox import Inbox
from flowgraph.errors import NonFiniteError

OWN = {"train": {"epoch": 0, "position": 0}}
"""The trainer's own datasets' cursors: its producer is elsewhere, they never move."""


def _inbox() -> tuple[Inbox, Any]:
    worker = SimpleNamespace(node_state={"kl": {"coef": 0.1}, "update": {"n": 1}})
    batches = SimpleNamespace(cursors=lambda: OWN)
    return Inbox(batches, worker), worker


def test_a_rollout_received_moves_the_cursors_and_node_state_a_checkpoint_holds() -> None:
    inbox, worker = _inbox()
    assert inbox.data_cursors() == OWN
    sent = {"train": {"epoch": 0, "position": 8}}
    item = Rollout(1, 0, cursors=sent, node_state={"kl": {"coef": 0.2}})
    assert inbox.receive(item) is item
    assert inbox.data_cursors() == sent
    assert worker.node_state == {"kl": {"coef": 0.2}, "update": {"n": 1}}


def test_a_rollout_holding_a_nan_leaves_them_as_they_were() -> None:
    inbox, worker = _inbox()
    inbox.cursors = {"train": {"epoch": 0, "position": 4}}  # loaded from a checkpoint
    inbox.receive(Rollout(1, 0, error=NonFiniteError("reward", 1, "scores")))
    assert inbox.data_cursors() == {"train": {"epoch": 0, "position": 4}}
    assert worker.node_state["kl"] == {"coef": 0.1}
