"""Envs and tools for the agent graphs under graphs/broken/ (listed as a plugin file).

`Guess` is a guess-the-number env with a tool; `lookup` a tool every episode may call;
`lookup_raw` the same function without type hints or a docstring, whose JSON schema
cannot be built.
"""

from flowgraph.agent import Env, Step
from flowgraph.agent.tools import tool


def lookup(word: str) -> str:
    """Look a word up in the glossary.

    Args:
        word: the word to look up
    """
    return {"gspo": "group sequence policy optimisation"}.get(word.lower(), "not found")


def lookup_raw(word):
    return lookup(word)


class Guess(Env):
    """Guess a number from 1 to 9; the env says higher or lower."""

    def reset(self, task):
        self.secret, self.turns = len(str(task["prompt"])) % 9 + 1, 0
        return f"Guess my number (1-9). {task['prompt']}"

    @tool(timeout_s=5)
    def hint(self, parity: str) -> str:
        """Say whether the number is even or odd.

        Args:
            parity: `even` or `odd`, the guess
        """
        return "yes" if (self.secret % 2 == 0) == (parity == "even") else "no"

    def step(self, message):
        self.turns += 1
        said = str(message.get("content", "")).strip()
        if said == str(self.secret):
            return Step(reward=1.0, done=True)
        higher = said.isdigit() and int(said) < self.secret
        return Step(messages=["higher" if higher else "lower"], reward=-0.1)


def run_agent(task, client):
    """A black-box agent written as a plain function: the rollout awaits it (FG607)."""
    return 0.0


async def sub_agent(task, client):
    """A black-box agent that hands its task to a sub-agent with a history of its own:
    each request after the first forks (`rows_per_episode`)."""
    messages = [{"role": "user", "content": task["prompt"]}]
    await client.chat.completions.create(model="policy", messages=messages)
    messages = [{"role": "user", "content": "solve: " + task["prompt"]}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0
