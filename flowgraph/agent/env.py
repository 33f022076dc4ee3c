"""The user's side of a multi-turn rollout: an environment, its tools, its rewards.

An `Env` is made once per episode (`env_cls(**env_params)`) on the worker that runs the
episode. The `agent_rollout` kind (`flowgraph.nodes.agent`) drives it:

    messages = env.reset(task)              # the first prompt (a string: one user message)
    loop, at most max_turns times:
        the policy samples an assistant turn
        it calls tools  -> each call runs (`Tool`), its result is a `tool` message
        it calls none   -> step = env.step(message): new messages, a turn reward, done?
    reward = env.reward(episode)           # the episode's reward, after the last turn

`task` is the dataset row (every column: `prompt`, `ground_truth`, ...). Any of
`reset`, `step`, `reward` and `close` may be `async def`; the sync ones run in a thread
pool, so a slow one never blocks the other episodes. Tools are the class's `tools`
(functions or `Tool`s) and its methods decorated with `@flowgraph.tool`, which see the
episode's own `self` (per-episode state: a sandbox, a counter).

No torch here: the checker imports environments to find their tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["STATUSES", "Env", "Episode", "Message", "Step", "ToolResult", "as_messages",
           "completion"]

Message = dict[str, Any]
"""A chat message as chat templates take it: `{"role": ..., "content": ...}` (an
assistant message may carry `tool_calls`, a tool message `name`)."""

STATUSES = ("completed", "max_turns", "context_exhausted", "timeout", "error")
"""How an episode ended: the env said done (or the policy answered without a tool call
and the env has no `step` of its own); it used every turn; the next turn would not fit
in the response budget T; a tool, a turn or the episode ran past its timeout; a tool or
the env raised."""


@dataclass(frozen=True, slots=True)
class Step:
    """What `Env.step` returns for an assistant turn that called no tool."""

    messages: Sequence[Message | str] = ()
    """Messages for the policy's next turn (a string is a user message); none: the
    episode ends (status `completed`), as with `done`."""
    reward: float = 0.0
    """This turn's reward (the `turn_rewards` port)."""
    done: bool = False
    """The episode ends here (status `completed`)."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool may return instead of its text: the text and a reward for the turn
    (a verl tool's `execute` reward)."""

    content: str
    reward: float = 0.0


@dataclass
class Episode:
    """One episode as `Env.reward` and reward functions see it."""

    task: Mapping[str, Any]
    """The dataset row the episode started from."""
    messages: list[Message] = field(default_factory=list)
    """The whole conversation: the first prompt's messages, then every turn."""
    turn_rewards: list[float] = field(default_factory=list)
    """One reward per assistant turn (`Step.reward`; tools' rewards, verl's)."""
    tool_calls: int = 0
    turns: int = 0
    status: str = "completed"
    error: str = ""
    """What went wrong, for status `timeout` or `error`."""
    tool_time_s: float = 0.0
    """Seconds spent in tool calls."""

    @property
    def completion(self) -> list[Message]:
        """The messages after the first prompt (TRL's conversational `completions`)."""
        return completion(self.messages)


def completion(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """An episode's messages from its first assistant turn on (TRL's `completions` of a
    tool-using episode: the turns, the tools' messages between them)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                 len(messages))
    return [dict(m) for m in messages[first:]]


class Env:
    """Subclass it: override `reset`, `step` and `reward` as the task needs, and list tools.

    The defaults make a single-answer task: the first prompt is the row's `prompt`, an
    answer without a tool call ends the episode, and the reward is 0 (score it with a
    `compute_score` node on the `messages` port instead).
    """

    tools: ClassVar[Sequence[Any]] = ()
    """Functions (typed, with a Google-style docstring) or `Tool`s every episode may call;
    methods decorated with `@flowgraph.tool` are added."""
    row: int = 0
    """Set before `reset`: the row of the episode's prompt in the step's batch."""
    seed: int = 0
    """Set before `reset`: the episode's own seed (from the run's seed, the step, its row
    and its sample). Draw the env's randomness from it (`random.Random(self.seed)`): an
    episode then does not depend on how episodes are split across workers."""

    def reset(self, task: Mapping[str, Any]) -> Sequence[Message | str] | str:
        """The first prompt's messages for `task` (a dataset row)."""
        prompt = task.get("prompt")
        if prompt is None:
            raise ValueError(f"{type(self).__name__}.reset: the row has no `prompt` column "
                             f"(its columns: {', '.join(task)}); override reset(task) to "
                             "build the first messages")
        return prompt  # type: ignore[no-any-return]

    def step(self, message: Message) -> Step:
        """The env's answer to an assistant turn that called no tool: ends the episode."""
        return Step(done=True)

    def reward(self, episode: Episode) -> float:
        """The episode's reward, added at its last sampled token."""
        return 0.0

    def close(self) -> None:
        """Release what the episode held (called once, however it ended)."""


def as_messages(value: Sequence[Message | str] | Message | str | None, who: str
                ) -> list[Message]:
    """Messages from what a user's env returned: a string is one user message, a mapping
    one message, a list holds messages or strings. ValueError naming `who` for anything else."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    listed: Sequence[Any] = [value] if isinstance(value, Mapping) else value  # one message
    out: list[Message] = []
    for i, m in enumerate(listed):
        if isinstance(m, str):
            out.append({"role": "user", "content": m})
        elif isinstance(m, Mapping) and isinstance(m.get("role"), str):
            out.append(dict(m))
        else:
            raise ValueError(f"{who}: message {i} is {m!r}; a message is a string or a "
                             "mapping with a `role` and a `content`")
    return out
