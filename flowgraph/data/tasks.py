"""The built-in datasets: `builtin:<task>` tables generated here, so a fresh machine needs
no download.

`builtin:arith` (and `builtin:arith:test`, its held-out fifth) is a generated toy task:
single-digit sums and differences such as `3+4=`, whose answers are one or two tokens,
so even a random tiny model samples a correct answer now and then and RL has a signal
to climb. `builtin:arith-pairs[:test]` pairs each problem's answer with a wrong one.
`builtin:reverse[:test]` (the main job's task) asks for a string of 3-4 digits
backwards (`reverse 381` -> `183`): 1,000 training and 100 held-out strings, disjoint.
Unlike single-digit sums, which a tiny model can only memorise, reversal is one skill
shared by every prompt, so what training teaches on one prompt carries to held-out
ones. Built-in tables also carry a `response` column (the answer), so `sft` reads them.
The agent tasks (`flowgraph.data.agent_tasks`): `builtin:mul` (`37*86=`, for a
calculator tool), `builtin:guess` (a number of 1-16) and their warm-up conversations
`builtin:mul-sft` and `builtin:guess-sft` (a `messages` column), and both in one table
each: `builtin:calc-guess` (an `env_class` column) and `builtin:calc-guess-sft`.

Plain Python: `flowgraph.data.readers` makes the columns a table.
"""

from __future__ import annotations

import random
from typing import Any

from flowgraph.builtin_models import BUILTIN_PREFIX
from flowgraph.data.agent_tasks import (
    guess_games,
    guess_problems,
    mixed_games,
    mixed_problems,
    mul_problems,
    mul_transcripts,
)
from flowgraph.errors import FlowgraphError

__all__ = ["arith_problems", "builtin_columns", "reverse_problems"]


def arith_problems(split: str = "train") -> list[tuple[str, str]]:
    """(question, answer) pairs of `builtin:arith`: a+b and a−b (a ≥ b) over digits 0-9.

    155 problems; a fixed fifth (31) is held out as `test`.
    """
    problems = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    problems += [(f"{a}-{b}=", str(a - b)) for a in range(10) for b in range(a + 1)]
    random.Random(0).shuffle(problems)
    n_test = len(problems) // 5
    return problems[:n_test] if split == "test" else problems[n_test:]


def reverse_problems(split: str = "train") -> list[tuple[str, str]]:
    """(question, answer) pairs of `builtin:reverse`: `reverse 381` -> `183`.

    1,100 distinct random strings of 3 or 4 digits (seeded); the last 100 are `test`.
    """
    rng, seen, digits = random.Random(0), set(), list[str]()
    while len(digits) < 1100:
        s = "".join(rng.choice("0123456789") for _ in range(rng.choice((3, 4))))
        if s not in seen:
            seen.add(s)
            digits.append(s)
    chosen = digits[1000:] if split == "test" else digits[:1000]
    return [(f"reverse {s}", s[::-1]) for s in chosen]


_TASKS = {"arith": arith_problems, "reverse": reverse_problems, "mul": mul_problems,
          "guess": guess_problems}
_CHATS = {"mul-sft": mul_transcripts, "guess-sft": guess_games, "calc-guess-sft": mixed_games}
"""Built-in chat tables (a `messages` column: the `sft` kind's multi-turn layout)."""


def _wrong_answer(question: str, answer: str) -> str:
    candidates = [str(x) for x in range(19) if str(x) != answer]
    return random.Random(question).choice(candidates)


def builtin_columns(name: str) -> dict[str, list[Any]]:
    """The columns of `builtin:<name>` (`arith`, `arith:test`, ...)."""
    task, _, split = name.partition(":")
    pairs = task == "arith-pairs"
    known = (*_TASKS, "arith-pairs", "calc-guess", *_CHATS)
    if task not in known or split not in ("", "train", "test"):
        raise FlowgraphError(
            f"unknown built-in dataset `{BUILTIN_PREFIX}{name}`; known: "
            f"{', '.join(BUILTIN_PREFIX + k for k in known)} (suffix `:test` for held-out)"
        )
    if task in _CHATS:
        return {"messages": _CHATS[task](split or "train")}
    if task == "calc-guess":  # two envs in one table: `env_class` names each row's
        rows = mixed_problems(split or "train")
        return {"prompt": [[{"role": "user", "content": q}] for q, _, _, _ in rows],
                "response": [a for _, a, _, _ in rows],
                "data_source": [source for _, _, source, _ in rows],
                "reward_model": [{"ground_truth": a} for _, a, _, _ in rows],
                "env_class": [env for _, _, _, env in rows]}
    problems = _TASKS["arith" if pairs else task](split or "train")
    prompts = [[{"role": "user", "content": q}] for q, _ in problems]
    if pairs:
        return {
            "prompt": prompts,
            "chosen": [a for _, a in problems],
            "rejected": [_wrong_answer(q, a) for q, a in problems],
        }
    return {
        "prompt": prompts,
        "response": [a for _, a in problems],
        "data_source": [task] * len(problems),
        "reward_model": [{"ground_truth": a} for _, a in problems],
    }
