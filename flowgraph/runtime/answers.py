"""The final answer of a response, GSM8K style (as verl's `gsm8k.compute_score`).

The number after `####`, else the last number in the text; thousands commas, spaces,
`$` and a final full stop are dropped before answers are compared. Pure Python: the
`rule_reward` node scores with it and the executors' held-out evaluation measures
exact-match accuracy with it.
"""

from __future__ import annotations

import re

__all__ = ["extract_answer", "has_marked_answer", "normalise_answer"]

_MARKED = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalise_answer(answer: str) -> str:
    """`1,234.` -> `1234`: drop thousands commas, spaces, `$` and a final full stop."""
    return re.sub(r"[\s,$]", "", answer).rstrip(".")


def has_marked_answer(text: str) -> bool:
    """Whether the text holds the `#### <number>` marker."""
    return _MARKED.search(text) is not None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: after `####`, else the last number; None if none."""
    marked = _MARKED.search(text)
    if marked is not None:
        return normalise_answer(marked.group(1))
    numbers = _NUMBER.findall(text)
    return normalise_answer(numbers[-1]) if numbers else None
