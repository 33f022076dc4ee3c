"""The built-in agent tasks: multiplications for a calculator, and guess the number.

* `builtin:mul[:test]`: `37*86=` -> `3182`, two two-digit numbers whose product has
  four digits: 1,000 training and 100 held-out problems, disjoint. The 2-layer
  `tiny-lm` cannot multiply; with the calculator it only has to copy (four digits
  always: with products of three digits mixed in, the warm-up copied 72% of the
  results, 80% of the four-digit and 20% of the shorter ones, after 800 steps).
* `builtin:mul-sft[:test]`: warm-up transcripts over the same problems (a `messages`
  column, the `sft` kind's chat layout): half call the calculator with a Hermes tool
  call (`<tool_call>{"name": "calculator", "arguments": {"expression": "37*86"}}
  </tool_call>`), read its `tool` message and answer with its result; half answer at
  once (the right product, which the model cannot learn to compute).
* `builtin:guess[:test]`: guess a number from 1 to 16 (the ground truth); the env
  (graphs/agent_guess.py) answers `higher` or `lower`. 64 training rows (each number
  four times) and the 16 numbers held out (the same numbers: the skill is the search).
* `builtin:guess-sft[:test]`: warm-up games from 8, half by binary search (3.4 guesses
  on average, at most 5), half one up or down at a time (5 on average, up to 9):
  plausible, and slow enough that RL has turns to save.
* `builtin:calc-guess[:test]`: both tasks in one table, each row's env named by its
  `env_class` column (`calc`, `guess`; graphs/agent_mixed.yaml routes by it): 256
  multiplications and the 64 games four times (train), the first 32 held-out
  multiplications and the 16 held-out games (test).
* `builtin:calc-guess-sft[:test]`: both warm-ups in one table: every transcript of
  `mul-sft` and the games of `guess-sft` four times (train).

Plain Python: `flowgraph.data.tasks` names them, `flowgraph.data.readers` builds the tables.
"""

from __future__ import annotations

import json
import random
from typing import Any

__all__ = [
    "CALC_GUESS_ENVS",
    "GUESS_HIGH",
    "GUESS_PROMPT",
    "guess_games",
    "guess_problems",
    "mixed_games",
    "mixed_problems",
    "mul_problems",
    "mul_transcripts",
    "tool_call_text",
]

GUESS_PROMPT = "guess 1-16"
"""The first user message of a guessing game (the tiny tokenizer spells it in 6 tokens)."""
GUESS_HIGH = 16
"""Numbers run from 1 to GUESS_HIGH."""


def mul_problems(split: str = "train") -> list[tuple[str, str]]:
    """(question, answer) pairs of `builtin:mul`: `37*86=` -> `3182`.

    1,100 distinct problems a*b, a and b in 10-99, a*b >= 1000 (seeded); the first
    100 are `test`, the next 1,000 `train`.
    """
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a * b >= 1000]
    random.Random(0).shuffle(pairs)
    chosen = pairs[:100] if split == "test" else pairs[100:1100]
    return [(f"{a}*{b}=", str(a * b)) for a, b in chosen]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A Hermes tool call as the policy writes it (Qwen's format, without its newlines,
    which cost two tokens of the tiny tokenizer)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def mul_transcripts(split: str = "train") -> list[list[dict[str, str]]]:
    """`builtin:mul-sft`: one conversation per problem of `mul_problems(split)`; a seeded
    half call the calculator (call, tool result, answer), the other half answer
    directly."""
    rng = random.Random(1)
    out = []
    for question, answer in mul_problems(split):
        user = {"role": "user", "content": question}
        if rng.random() < 0.5:
            call = tool_call_text("calculator", {"expression": question.rstrip("=")})
            out.append([user, {"role": "assistant", "content": call},
                        {"role": "tool", "content": answer},
                        {"role": "assistant", "content": answer}])
        else:
            out.append([user, {"role": "assistant", "content": answer}])
    return out


def guess_problems(split: str = "train") -> list[tuple[str, str]]:
    """(prompt, number) pairs of `builtin:guess`: every number of 1-16, four times
    (train, seeded order) or once (test, in order)."""
    numbers = list(range(1, GUESS_HIGH + 1))
    if split != "test":
        numbers = numbers * 4
        random.Random(0).shuffle(numbers)
    return [(GUESS_PROMPT, str(n)) for n in numbers]


def _game(target: int, binary: bool) -> list[int]:
    """The guesses of one game from 8: binary search (the middle of what is left) or
    one up or down at a time."""
    lo, hi, guesses = 1, GUESS_HIGH, [GUESS_HIGH // 2]
    while guesses[-1] != target:
        g = guesses[-1]
        lo, hi = (g + 1, hi) if target > g else (lo, g - 1)
        if binary:
            guesses.append((lo + hi) // 2)
        else:
            guesses.append(g + 1 if target > g else g - 1)
    return guesses


def guess_games(split: str = "train") -> list[list[dict[str, str]]]:
    """`builtin:guess-sft`: one game per row of `guess_problems(split)` and strategy
    (binary search, one at a time), as a conversation: the prompt, then each guess and
    the env's `higher` / `lower`; the last guess is right."""
    out = []
    for _, number in guess_problems(split):
        for binary in (True, False):
            guesses = _game(int(number), binary)
            messages = [{"role": "user", "content": GUESS_PROMPT}]
            for g in guesses:
                messages.append({"role": "assistant", "content": str(g)})
                if g != int(number):
                    messages.append({"role": "user",
                                     "content": "higher" if int(number) > g else "lower"})
            out.append(messages)
    return out


CALC_GUESS_ENVS = ("calc", "guess")
"""The `env_class` values of `builtin:calc-guess`: the calculator's rows, then the games'."""


def mixed_problems(split: str = "train") -> list[tuple[str, str, str, str]]:
    """(question, answer, data source, env) rows of `builtin:calc-guess`, calculator
    rows first (the data source shuffles them when it loads)."""
    calc, guess = CALC_GUESS_ENVS
    muls = mul_problems(split)[:32 if split == "test" else 256]
    games = guess_problems(split) * (1 if split == "test" else 4)
    return [(q, a, "mul", calc) for q, a in muls] + [(q, a, "guess", guess) for q, a in games]


def mixed_games(split: str = "train") -> list[list[dict[str, str]]]:
    """`builtin:calc-guess-sft`: the calculator's transcripts and the games (four times
    when training: 512 games beside 1,000 transcripts), so one model learns both."""
    return mul_transcripts(split) + guess_games(split) * (1 if split == "test" else 4)
