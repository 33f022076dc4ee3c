"""The buffer of asynchronous rollouts (`flowgraph.compilers.rollouts.buffer.Rollouts`)
with a scripted producer strategy: admission (`block` takes step j's rollout, `drop`
skips the stale ones and counts them), staleness per rollout and per token, what a
checkpoint holds (`buffered`, `data_cursors`) and where a resumed producer goes on."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flowgraph.compilers.checkpoint.store import Rollout
from flowgraph.compilers.rollouts.buffer import Cursors, Rollouts, need
from flowgraph.errors import FlowgraphError, NonFiniteError
from flowgraph.plan import AsyncPlan


def _plan(steps: int, staleness: int = 1, admission: str = "block",
          partial: bool = False) -> Any:
    """What the buffer reads of a plan: the cut and the number of steps."""
    return SimpleNamespace(
        asynchronous=AsyncPlan(producer=("gen",), staleness=staleness, admission=admission,
                               partial=partial, versions=("gen",) if partial else ()),
        trainer=SimpleNamespace(steps=steps))


def _cursor(index: int) -> Cursors:
    """The data cursor after step `index`'s batch of 4 prompts."""
    return {"train": {"epoch": 0, "position": 4 * (index + 1)}}


class Scripted:
    """A producer strategy that sends rollouts in order, their versions from `versions`
    (index -> version; default: `need` under block), and records what it is asked."""

    def __init__(self, staleness: int = 1, *, ahead: int = 0, overlaps: bool = True,
                 versions: dict[int, int] | None = None, sleep_s: float = 0.0) -> None:
        self.S, self.ahead, self.overlaps = staleness, ahead, overlaps
        self.versions = versions or {}
        self.sleep_s = sleep_s
        self.next_index, self.origin = 0, 0
        self.loaded: Cursors | None = None
        self.sent: Cursors | None = None
        """The cursors after the last rollout sent, or loaded (as `Inbox` keeps them)."""
        self.started: list[tuple[int, int, Cursors]] = []
        self.asked: list[int] = []
        self.advanced: list[tuple[int, int]] = []
        self.closed = False

    def start(self, step: int, first: int, cursors: Cursors) -> None:
        self.origin, self.next_index = step, first
        self.started.append((step, first, cursors))

    def next_rollout(self, step: int, metrics: dict[str, float]) -> Rollout:
        time.sleep(self.sleep_s)
        index = self.next_index
        self.next_index += 1
        self.asked.append(step)
        version = self.versions.get(index, need(index, self.S, self.origin))
        self.sent = _cursor(index)
        return Rollout(index, version, {("gen", "n"): index}, {"gen/tokens": 8.0},
                       _cursor(index))

    def advance(self, step: int, held: int) -> None:
        self.advanced.append((step, held))

    def cursors(self) -> Cursors:
        return self.sent if self.sent is not None else {"train": {"epoch": 0, "position": 0}}

    def load(self, cursors: Cursors | None) -> None:
        self.loaded = self.sent = cursors

    def generating_s(self) -> float:
        return 0.0

    def close(self) -> None:
        self.closed = True


def _run(buffer: Rollouts, steps: range) -> list[dict[str, float]]:
    rows = []
    for step in steps:
        metrics: dict[str, float] = {}
        env = buffer.take(step, metrics)
        metrics["index"] = float(env[("gen", "n")])
        buffer.advance(step)
        rows.append(metrics)
    return rows


def test_block_takes_each_steps_own_rollout_staleness_min_of_step_and_s() -> None:
    producer = Scripted(staleness=2)
    buffer = Rollouts(_plan(steps=5, staleness=2), producer)
    buffer.start(0)
    rows = _run(buffer, range(5))
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    # version max(j - 2, 0) trains at step j: staleness min(j, 2)
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all("async/dropped" not in r for r in rows)  # block never drops
    assert all(r["gen/tokens"] == 8.0 for r in rows)  # the producer's metrics, per rollout
    assert [r["data/train/position"] for r in rows] == [4.0, 8.0, 12.0, 16.0, 20.0]
    assert all(r["perf/rollout_wait_s"] >= 0.0 for r in rows)
    # a producer elsewhere fills the buffer as it sends: one rollout asked a step
    assert producer.asked == [0, 1, 2, 3, 4]
    assert producer.advanced == [(s, 0) for s in range(5)]
    buffer.close()
    assert producer.closed


def test_drop_skips_rollouts_staler_than_s_and_counts_them() -> None:
    """S = 1, a producer that generated rollouts 0-3 with version 0: step 1 takes
    rollout 1 (1 version old); at step 2 rollouts 2 and 3 are 2 versions old, dropped,
    and rollout 4 (version 2) taken; step 3 takes rollout 5."""
    producer = Scripted(versions={0: 0, 1: 0, 2: 0, 3: 0, 4: 2, 5: 3})
    buffer = Rollouts(_plan(steps=4, admission="drop"), producer)
    buffer.start(0)
    rows = _run(buffer, range(4))
    assert [r["index"] for r in rows] == [0, 1, 4, 5]
    assert [r["async/dropped"] for r in rows] == [0.0, 0.0, 2.0, 0.0]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert producer.asked == [0, 1, 2, 2, 2, 3]


def test_block_refuses_a_rollout_of_another_step() -> None:
    producer = Scripted()
    buffer = Rollouts(_plan(steps=3), producer)
    buffer.start(0)
    producer.next_index = 1  # the producer skipped step 0's batch
    with pytest.raises(FlowgraphError, match="internal: the rollout buffer holds step 1's "
                                             "batch where step 0's was due"):
        buffer.take(0, {})


def test_a_rollouts_error_is_raised_at_its_step_after_the_wait_is_counted() -> None:
    class Failing(Scripted):
        def next_rollout(self, step: int, metrics: dict[str, float]) -> Rollout:
            item = super().next_rollout(step, metrics)
            if item.index == 1:
                return Rollout(1, item.version, error=NonFiniteError("reward", 1, "scores"))
            return item

    buffer = Rollouts(_plan(steps=3), Failing())
    buffer.start(0)
    _run(buffer, range(1))
    metrics: dict[str, float] = {}
    with pytest.raises(NonFiniteError, match="non-finite scores in node `reward`"):
        buffer.take(1, metrics)
    assert list(metrics) == ["perf/rollout_wait_s"]
    buffer.advance(1)  # the step is skipped (on_nonfinite: skip): the next one goes on
    assert _run(buffer, range(2, 3))[0]["index"] == 2


def test_partial_rollouts_count_staleness_per_trained_token() -> None:
    """Step 2 trains on 4 tokens (of 5: one masked) sampled by versions 1, 1, 2, 2: their
    staleness 1, 1, 0, 0 (mean 0.5, max 1); the masked token's version 0 is not counted,
    and under drop it would not make the rollout stale."""
    env = {("gen", "policy_version"): torch.tensor([[1, 1, 2, 2, 0]]),
           ("gen", "response_mask"): torch.tensor([[1, 1, 1, 1, 0]])}

    class Partial(Scripted):
        def next_rollout(self, step: int, metrics: dict[str, float]) -> Rollout:
            item = super().next_rollout(step, metrics)
            return Rollout(item.index, 1, dict(env), {}, item.cursors)

    for admission in ("block", "drop"):
        buffer = Rollouts(_plan(steps=3, admission=admission, partial=True), Partial())
        buffer.start(2)
        metrics: dict[str, float] = {}
        buffer.take(2, metrics)
        assert (metrics["async/staleness"], metrics["async/staleness_max"]) == (0.5, 1.0)
        assert metrics.get("async/dropped", 0.0) == 0.0


def test_a_rollout_with_no_trained_token_counts_its_version() -> None:
    buffer = Rollouts(_plan(steps=3, partial=True), Scripted())
    item = Rollout(2, 1, {("gen", "policy_version"): torch.tensor([[0, 0]]),
                          ("gen", "response_mask"): torch.tensor([[0, 0]])})
    assert buffer.trained_versions(item).tolist() == [1]


def test_in_the_loop_the_buffer_runs_s_ahead_and_never_waits() -> None:
    """A producer in the loop (`ahead` S = 2): at step 0 the rollouts of steps 0, 1, 2
    are made (with the weights of step 0), then one a step; its time is not a wait."""
    producer = Scripted(staleness=2, ahead=2, overlaps=False, sleep_s=0.01)
    buffer = Rollouts(_plan(steps=4, staleness=2), producer)
    buffer.start(0)
    rows = _run(buffer, range(4))
    assert producer.asked == [0, 0, 0, 1]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert all(r["perf/rollout_wait_s"] == 0.0 for r in rows)
    assert producer.advanced == [(0, 2), (1, 2), (2, 1), (3, 0)]
    assert not buffer.overlaps


def test_a_producer_elsewhere_is_waited_for() -> None:
    buffer = Rollouts(_plan(steps=1), Scripted(sleep_s=0.01))
    buffer.start(0)
    assert _run(buffer, range(1))[0]["perf/rollout_wait_s"] > 0.0
    assert buffer.overlaps


@pytest.mark.parametrize(("step", "indices"), [(0, [1, 2]), (1, [2, 3]), (2, [3])])
def test_a_checkpoint_under_block_holds_the_next_s_rollouts_and_the_cursor_after_them(
        step: int, indices: list[int]) -> None:
    """S = 2 over 4 steps: after step k the buffer holds steps k+1 … min(k+2, 3), waited
    for, and the data cursor stands after the last of them."""
    buffer = Rollouts(_plan(steps=4, staleness=2), Scripted(staleness=2))
    buffer.start(0)
    _run(buffer, range(step + 1))
    assert [r.index for r in buffer.buffered(step)] == indices
    assert buffer.data_cursors(step) == _cursor(indices[-1])
    assert [r.index for r in buffer.buffered(step)] == indices  # asked once


def test_a_checkpoint_under_drop_holds_what_was_received_and_waits_for_nothing() -> None:
    producer = Scripted()
    buffer = Rollouts(_plan(steps=4, admission="drop"), producer)
    buffer.start(0)
    _run(buffer, range(2))
    assert buffer.buffered(1) == []
    assert producer.asked == [0, 1]
    assert buffer.data_cursors(1) == _cursor(1)  # after the last rollout received


def test_a_resumed_buffer_trains_its_rollouts_first_and_the_producer_goes_on_after() -> None:
    """A checkpoint after step 2 (S = 2) holds the rollouts of steps 3 and 4: loaded,
    the producer restarts at step 5 from the cursor after step 4's batch, and steps 3
    and 4 train the loaded rollouts without asking it."""
    producer = Scripted(staleness=2)
    buffer = Rollouts(_plan(steps=6, staleness=2), producer)
    held = [Rollout(i, i - 2, {("gen", "n"): i}, {}, _cursor(i)) for i in (3, 4)]
    buffer.load(held, _cursor(4))
    assert producer.loaded == _cursor(4)
    buffer.start(3)
    assert producer.started == [(3, 5, _cursor(4))]
    rows = _run(buffer, range(3, 6))
    assert [r["index"] for r in rows] == [3, 4, 5]
    assert [r["async/staleness"] for r in rows] == [2.0, 2.0, 2.0]
    assert producer.asked == [5]
    assert producer.advanced == [(3, 1), (4, 0), (5, 0)]


def test_an_empty_buffer_starts_the_producer_at_the_datasets_cursors() -> None:
    producer = Scripted()
    buffer = Rollouts(_plan(steps=4), producer)
    buffer.load([], None)  # a recovery with nothing saved: start over
    buffer.start(0)
    assert producer.started == [(0, 0, {"train": {"epoch": 0, "position": 0}})]
