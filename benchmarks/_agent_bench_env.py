"""The env, tools and parser `bench_agent.py` runs (a plugin file of its graph).

The tiny built-in model writes no tool calls of its own, so the parser `every_turn`
reads every sampled turn as one call of `lookup` (its text the query): with
`max_turns: 3` each episode calls the tool 3 times, on the rollout's real path (the
parsed calls run through `Episodes._tool`: the thread pool for a sync tool, the event
loop for an async one, all episodes' calls of a turn together). Two `lookup`s, the
same tool but its time: `slow_lookup` sleeps 200 ms (`time.sleep`: a blocking tool,
in the thread pool), `instant_lookup` returns at once; `async_lookup` awaits 200 ms:
the envs `Instant`, `Sync` and `Async` hold one each.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from flowgraph.agent import Env
from flowgraph.agent.parsers import PARSERS, ToolCall
from flowgraph.agent.tools import tool

DELAY_S = 0.2


def _answer(query: str) -> str:
    return f"{len(query)}"


def _slow(query: str) -> str:
    """Look a query up (takes 200 ms).

    Args:
        query: what to look up
    """
    time.sleep(DELAY_S)
    return _answer(query)


def _instant(query: str) -> str:
    """Look a query up.

    Args:
        query: what to look up
    """
    return _answer(query)


async def _async(query: str) -> str:
    """Look a query up (awaits 200 ms).

    Args:
        query: what to look up
    """
    await asyncio.sleep(DELAY_S)
    return _answer(query)


slow_lookup = tool(_slow, name="lookup", timeout_s=10.0)
instant_lookup = tool(_instant, name="lookup", timeout_s=10.0)
async_lookup = tool(_async, name="lookup", timeout_s=10.0)


class EveryTurn:
    """Every turn is one call of `lookup` with the turn's text."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return text, [ToolCall("lookup", {"query": text}, "call_0")]


PARSERS["every_turn"] = EveryTurn()


class Instant(Env):
    """The dataset row's prompt and the tool `lookup` (instant); the reward is the share
    of digits the policy wrote (so that the update has advantages to learn from)."""

    tools = (instant_lookup,)

    def reward(self, episode: Any) -> float:
        text = "".join(m.get("content") or "" for m in episode.messages
                       if m["role"] == "assistant")
        return sum(c.isdigit() for c in text) / max(len(text), 1)


class Sync(Instant):
    """`lookup` blocks for 200 ms."""

    tools = (slow_lookup,)


class Async(Instant):
    """`lookup` awaits for 200 ms."""

    tools = (async_lookup,)
