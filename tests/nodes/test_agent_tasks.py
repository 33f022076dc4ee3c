"""The built-in agent tasks (`flowgraph.data.agent_tasks`): multiplications for the
calculator example, guess the number, and their warm-up conversations as the `sft`
kind reads them."""

from __future__ import annotations

import json
import re

import pytest

from flowgraph.data.agent_tasks import (
    GUESS_PROMPT,
    guess_games,
    guess_problems,
    mul_problems,
    mul_transcripts,
)
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data import prompt_source, sft_source
from flowgraph.nodes.models import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
CALL = re.compile(r"^<tool_call>(.*)</tool_call>$")


def _text(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=False)


def test_builtin_mul_has_disjoint_splits_of_products_the_tiny_model_cannot_compute() -> None:
    train, test = mul_problems("train"), mul_problems("test")
    assert (len(train), len(test)) == (1000, 100)
    assert not {q for q, _ in train} & {q for q, _ in test}
    for q, a in train + test:
        x, y = q.removesuffix("=").split("*")
        assert 10 <= int(x) <= 99 and 10 <= int(y) <= 99 and a == str(int(x) * int(y))
        assert len(a) == 4
    splits = prompt_source("builtin:mul", tokenizer=TOK, max_prompt_length=8)
    assert (len(splits.train), len(splits.eval)) == (1000, 100)
    batch = splits.eval.next_batch(4)
    assert batch["ground_truth"] == [a for _, a in test[:4]]


def test_mul_sft_half_call_the_calculator_and_answer_with_its_result() -> None:
    chats = mul_transcripts("train")
    assert len(chats) == 1000
    calls = [c for c in chats if len(c) == 4]
    assert 450 <= len(calls) <= 550 and len(calls) + sum(len(c) == 2 for c in chats) == 1000
    for user, call, tool, answer in calls:
        parsed = json.loads(CALL.match(call["content"]).group(1))  # type: ignore[union-attr]
        assert parsed == {"name": "calculator",
                          "arguments": {"expression": user["content"].removesuffix("=")}}
        assert [call["role"], tool["role"], answer["role"]] == ["assistant", "tool", "assistant"]
        assert tool["content"] == answer["content"] == dict(mul_problems())[user["content"]]


def test_mul_sft_trains_only_the_assistant_turns() -> None:
    """The `sft` kind reads builtin:mul-sft: a calling row's response is the call, the
    tool message with the next generation prompt (a hole in loss_mask) and the answer;
    a direct row's is the answer. P=8, T=88 hold every row."""
    splits = sft_source("builtin:mul-sft", tokenizer=TOK, max_prompt_length=8,
                        max_response_length=88)
    batch = splits.train.next_batch(len(splits.train))
    seen = 0
    for ids, mask, trained in zip(batch["responses"], batch["response_mask"],
                                  batch["loss_mask"], strict=True):
        ids = ids[mask.bool()].tolist()
        kept = trained[: len(ids)].tolist()
        if not _text(ids).startswith("<tool_call>"):
            assert all(kept)
            continue
        seen += 1
        text = _text([t for t, k in zip(ids, kept, strict=True) if not k])
        assert re.fullmatch(r"<\|tool\|>\d+<\|assistant\|>", text), text
        answer = _text([t for t, k in zip(ids, kept, strict=True) if k])
        assert answer.endswith("</tool_call><|eos|>" + text[8:-13] + "<|eos|>"), answer
    assert seen > 400


def test_guess_games_follow_the_answers_and_binary_search_is_shorter() -> None:
    assert len(guess_problems("train")) == 64 and len(guess_problems("test")) == 16
    games = guess_games("train")
    assert len(games) == 128
    lengths: dict[bool, list[int]] = {True: [], False: []}
    for i, game in enumerate(games):
        number = int(guess_problems("train")[i // 2][1])
        assert game[0] == {"role": "user", "content": GUESS_PROMPT}
        lo, hi = 1, 16
        guesses = [int(m["content"]) for m in game if m["role"] == "assistant"]
        for g, reply in zip(guesses, game[2::2], strict=False):
            assert lo <= g <= hi and reply["content"] == ("higher" if number > g else "lower")
            lo, hi = (g + 1, hi) if number > g else (lo, g - 1)
        assert guesses[-1] == number and game[-1]["role"] == "assistant"
        lengths[i % 2 == 0].append(len(guesses))
    assert max(lengths[True]) == 5 and sum(lengths[True]) / 64 < 3.5
    assert sum(lengths[False]) / 64 == 5.0


def test_an_unknown_builtin_names_the_agent_tasks() -> None:
    with pytest.raises(FlowgraphError, match=r"builtin:mul-sft.*builtin:guess-sft"):
        sft_source("builtin:mul-chat", tokenizer=TOK)


@pytest.mark.parametrize("name", ["tiny-lm-calc", "tiny-lm-guess"])
def test_the_agent_warm_up_recipes_compile_and_hold_their_rows(name: str) -> None:
    """Each trained built-in's recipe is an SFT graph over its chat task whose P and T
    hold every row (an over-long row would stop the first run that needs the model)."""
    from flowgraph.builtin_models import TRAINED_BUILTINS
    from flowgraph.frontend import graph_from_yaml
    from flowgraph.passes import compile_graph

    base, recipe = TRAINED_BUILTINS[name]
    graph = graph_from_yaml(recipe, file=f"<recipe of {name}>")
    assert base == "tiny-lm" and compile_graph(graph).plan is not None
    dims = {d.name: d.value for d in graph.dims}
    (source,) = graph.data
    splits = sft_source(source.path, tokenizer=TOK, max_prompt_length=dims["P"],
                        max_response_length=dims["T"])
    assert len(splits.train) in (1000, 128)
