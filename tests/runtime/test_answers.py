"""The final answer of a response (GSM8K style), as the reward and the evaluation read it."""

from __future__ import annotations

import pytest

from flowgraph.runtime.answers import extract_answer


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("#### 42", "42"),
        ("so 3+4=7\n#### 7", "7"),  # the marker wins over later/earlier numbers
        ("#### 1,234 and then 5", "1234"),  # thousands commas dropped
        ("the answer is 12.", "12"),  # last number; the full stop is not a decimal
        ("3 apples and 2.5 pears", "2.5"),
        ("it is -3", "-3"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer
