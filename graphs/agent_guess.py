"""Guess the number (graphs/agent_guess.yaml): an environment with per-turn rewards.

The policy guesses a number of 1-16 (the row's ground truth, `builtin:guess`); each
wrong guess costs 0.1 and the env answers `higher` or `lower` as a user message; the
right one earns 1 and ends the game. Fewer turns, more reward: the per-turn rewards go
to the `token_level_rewards` port, each at its turn's last token, so an advantage that
credits turns (reinforce_pp, gae) sees which guesses paid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowgraph.agent import Env, Episode, Message, Step

WRONG = -0.1
"""The reward of a wrong (or unreadable) guess."""
RIGHT = 1.0
"""The reward of the right guess."""


def _number(task: Mapping[str, Any]) -> int:
    truth = task.get("ground_truth")
    if truth is None and isinstance(task.get("reward_model"), Mapping):
        truth = task["reward_model"].get("ground_truth")
    return int(str(truth))


class GuessEnv(Env):
    """One game: the number is the row's ground truth; the prompt is the row's."""

    def reset(self, task: Mapping[str, Any]) -> Any:
        self.number = _number(task)
        return super().reset(task)

    def step(self, message: Message) -> Step:
        try:
            guess = int(str(message.get("content") or "").strip())
        except ValueError:
            return Step(["a number of 1-16, please"], reward=WRONG)
        if guess == self.number:
            return Step(reward=RIGHT, done=True)
        return Step(["higher" if self.number > guess else "lower"], reward=WRONG)

    def reward(self, episode: Episode) -> dict[str, float]:  # type: ignore[override]
        """Nothing beyond the turns' rewards; `acc`: the game was won."""
        won = bool(episode.turn_rewards) and episode.turn_rewards[-1] == RIGHT
        return {"score": 0.0, "acc": float(won)}
