"""The producer in the training loop (`InlineProducer`) with the buffer, over scripted
batches: at step k the rollouts up to k + S are generated with the weights of step k,
their node seconds counted in step k, the rest of their metrics with the rollout; a NaN
is kept in its rollout (`ProducerNodes.produce`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from flowgraph.compilers.rollouts.buffer import Rollouts
from flowgraph.compilers.rollouts.inline import InlineProducer
from flowgraph.errors import NonFiniteError
from flowgraph.plan import AsyncPlan


class Batches:
    """Draws 4 prompts a batch; its one node reports 0.5 s and 8 tokens."""

    def __init__(self, worker: Any, nan_at: int | None = None) -> None:
        self.worker, self.nan_at = worker, nan_at
        self.position = 0
        self.drawn: list[tuple[int, bool, int | None]] = []
        """(index, strict, the weights' version) of each batch drawn."""

    def produce(self, env: dict[tuple[str, str], Any], index: int, strict: bool,
                metrics: dict[str, float], names: list[str]) -> None:
        assert names == ["gen"]
        self.drawn.append((index, strict, self.worker.version))
        self.position += 4
        self.worker.node_state["gen"]["drawn"] = index
        if index == self.nan_at:
            raise NonFiniteError("gen", index, "scores")
        env[("gen", "n")] = index
        metrics.update({"timing_s/gen": 0.5, "gen/tokens": 8.0})

    def cursors(self) -> dict[str, dict[str, Any]]:
        return {"train": {"epoch": 0, "position": self.position}}


def _inline(steps: int = 4, staleness: int = 2, nan_at: int | None = None
            ) -> tuple[Rollouts, Batches, Any]:
    plan: Any = SimpleNamespace(
        asynchronous=AsyncPlan(producer=("gen",), staleness=staleness),
        trainer=SimpleNamespace(steps=steps, strict=False))
    worker = SimpleNamespace(version=None, node_state={"gen": {}})
    batches = Batches(worker, nan_at)
    producer = InlineProducer(plan, batches, worker,
                              ["gen"], SimpleNamespace(strict=False))
    return Rollouts(plan, producer), batches, worker


def test_step_k_generates_up_to_k_plus_s_with_its_weights() -> None:
    buffer, batches, worker = _inline()
    buffer.start(0)
    first: dict[str, float] = {}
    assert buffer.take(0, first) == {("gen", "n"): 0}
    buffer.advance(0)
    # the batch the run starts at is run strictly; version 0's weights, then none held
    assert batches.drawn == [(0, True, 0), (1, False, 0), (2, False, 0)]
    assert worker.version is None
    assert first["timing_s/gen"] == 1.5  # three rollouts' node seconds, spent in step 0
    assert first["gen/tokens"] == 8.0  # step 0's rollout's own
    assert first["perf/rollout_wait_s"] == 0.0 and first["async/staleness"] == 0.0
    # a checkpoint after step 0 holds steps 1 and 2, the cursor after step 2's batch
    assert [r.index for r in buffer.buffered(0)] == [1, 2]
    assert buffer.data_cursors(0) == {"train": {"epoch": 0, "position": 12}}
    assert buffer.buffered(0)[-1].node_state == {"gen": {"drawn": 2}}
    second: dict[str, float] = {}
    buffer.take(1, second)
    assert batches.drawn[3:] == [(3, False, 1)]
    assert second["timing_s/gen"] == 0.5
    assert second["async/staleness"] == 1.0  # step 1's rollout came from version 0
    assert buffer.generating_s() >= 0.0


def test_a_resumed_loop_generates_after_the_buffer_it_loaded() -> None:
    buffer, batches, _ = _inline()
    buffer.start(0)
    buffer.take(0, {})
    held = buffer.buffered(0)
    resumed, batches, _ = _inline()
    batches.position = 12  # the loop restored the datasets at the checkpoint's cursors
    resumed.load(held, {"train": {"epoch": 0, "position": 12}})
    resumed.start(1)
    assert resumed.take(1, {}) == {("gen", "n"): 1}
    assert batches.drawn == [(3, False, 1)]  # step 3's batch, the weights of step 1


def test_a_nan_is_kept_in_its_rollout_and_raised_at_its_step() -> None:
    buffer, _, worker = _inline(nan_at=1)
    buffer.start(0)
    buffer.take(0, {})  # generates step 1's rollout: its NaN waits for step 1
    assert worker.version is None
    buffer.advance(0)
    with pytest.raises(NonFiniteError, match="non-finite scores in node `gen` at step 1"):
        buffer.take(1, {})
