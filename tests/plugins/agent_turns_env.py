"""The agent graph every target runs (`agent_turns.yaml`): multi-turn episodes that call
a tool whatever the tiny model writes.

The tiny built-in models never write a Hermes `<tool_call>` on their own, so the graph's
parser `every_other` reads a turn of odd length (in characters) as one call of the env's
tool `count` with the turn's text, and any other turn as the Hermes parser does (usually
no call): the env's `step` then replies. Which turns call the tool depends on the
sampled tokens, so episodes take different paths and end at different turns.

With `one_turn_from: r` (env_params) the episodes of batch rows r and later take one
turn: the env's first reply ends them, and so does their first tool call, which raises
(status `error`; the rollout's `on_error` masks the episode). On 2 workers that is the
second worker's rows: it runs out of episodes after the first turn while the first
worker's go on, so it samples placeholder rows to keep a sharded model's forwards in
step."""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Any

from flowgraph.agent import Env, Step
from flowgraph.agent.parsers import PARSERS, ToolCall, get_parser
from flowgraph.agent.tools import tool


class EveryOther:
    """A turn of odd length is a call of `count`; another is read by `hermes`."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if len(text) % 2:
            return "", [ToolCall("count", {"text": text}, "call_0")]
        return get_parser("hermes").parse(text)


PARSERS["every_other"] = EveryOther()


class Turns(Env):
    """Replies `again` to a turn that calls no tool, twice; the second reply ends the
    episode (or `max_turns` does). Each reply is worth 0.1; the episode's reward is the
    share of digits in what the policy wrote."""

    resets = itertools.count(1)
    """Episodes this process started (envs reset in threads: a count is atomic): with
    FG_TEST_KILL_AT_RESET=k set, the k-th start kills the process (SIGKILL, in the middle
    of a rollout: the resume test)."""

    middles = itertools.count(1)
    """Tool calls and env replies this process ran (between two turns of an episode):
    with FG_TEST_SIGNAL_PARENT_AT=k:SIGNAME set, the k-th sends the signal to the process
    that started this one (the trainer, when episodes run in a producer process: the
    partial-rollout tests' kill and stop in the middle of an episode)."""

    def __init__(self, one_turn_from: int | None = None, slow_s: float = 0.0) -> None:
        """`slow_s`: the seconds each tool call and env reply takes (episodes that
        outlast an update)."""
        self.one_turn_from, self.slow_s = one_turn_from, slow_s

    def _between_turns(self) -> None:
        at, _, name = os.environ.get("FG_TEST_SIGNAL_PARENT_AT", "").partition(":")
        if str(next(Turns.middles)) == at:
            os.kill(os.getppid(), getattr(signal, name))
        time.sleep(self.slow_s)

    def reset(self, task: Any) -> Any:
        if str(next(Turns.resets)) == os.environ.get("FG_TEST_KILL_AT_RESET"):
            os.kill(os.getpid(), signal.SIGKILL)
        self.replies = 0
        self.one_turn = self.one_turn_from is not None and self.row >= self.one_turn_from
        return task["prompt"]

    @tool(timeout_s=5.0)
    def count(self, text: str) -> str:
        """Count the letters and the digits of a text.

        Args:
            text: the text to count in
        """
        self._between_turns()
        if self.one_turn:
            raise RuntimeError("this episode has one turn")
        letters, digits = sum(c.isalpha() for c in text), sum(c.isdigit() for c in text)
        return f"{letters} letters, {digits} digits"

    def step(self, message: Any) -> Step:
        self._between_turns()
        self.replies += 1
        return Step(messages=[f"again {self.replies}"], reward=0.1,
                    done=self.one_turn or self.replies >= 2)

    def reward(self, episode: Any) -> float:
        text = "".join(m.get("content") or "" for m in episode.messages
                       if m["role"] == "assistant")
        return sum(c.isdigit() for c in text) / max(len(text), 1)
