"""The agent examples' plugin files: graphs/agent_calculator.py (the calculator tool and
its env's reward) and graphs/agent_guess.py (higher / lower with per-turn rewards)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from flowgraph.agent import Episode
from flowgraph.agent.tools import tools_of

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def _plugin(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", GRAPHS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CALC = _plugin("agent_calculator")
GUESS = _plugin("agent_guess")
ROW = {"prompt": [{"role": "user", "content": "37*86="}],
       "reward_model": {"ground_truth": "3182"}}


def test_the_calculator_evaluates_whole_number_arithmetic_and_refuses_the_rest() -> None:
    assert CALC.calculator("37*86") == "3182"
    assert CALC.calculator(" (7+3) * 12 - 5 // 2 ") == "118"
    for bad in ("__import__('os')", "2**99999", "1/2", "9" * 20 + "*2", "37*", "1//0"):
        assert CALC.calculator(bad).startswith("error: "), bad


def test_the_calculator_is_a_tool_with_a_schema_from_its_docstring() -> None:
    (tool,) = tools_of(CALC.CalculatorEnv())
    function = tool.schema()["function"]
    assert function["name"] == "calculator"
    assert function["parameters"] == {
        "type": "object", "required": ["expression"],
        "properties": {"expression": {"type": "string", "description":
                                      'The expression, e.g. "37*86"; + - * // % and '
                                      "parentheses."}}}


@pytest.mark.parametrize(("last", "right"), [("3182", 1.0), (" 3182 ", 1.0), ("3181", 0.0),
                                              ('<tool_call>{"name": "calculator"}', 0.0)])
def test_the_calculator_env_scores_the_last_answer_against_the_product(last: str,
                                                                      right: float) -> None:
    episode = Episode(task=ROW, messages=[*ROW["prompt"],
                                          {"role": "assistant", "content": last}])
    assert CALC.CalculatorEnv().reward(episode) == {"score": right, "acc": right}
    flat = Episode(task={"ground_truth": "3182"}, messages=episode.messages)
    assert CALC.CalculatorEnv().reward(flat)["acc"] == right
    assert CALC.CalculatorEnv().reward(Episode(task=ROW))["acc"] == 0.0


def test_guess_answers_higher_or_lower_with_a_reward_per_turn() -> None:
    env = GUESS.GuessEnv()
    assert env.reset({"prompt": "guess 1-16", "reward_model": {"ground_truth": "11"}}) \
        == "guess 1-16"
    steps = [env.step({"role": "assistant", "content": c}) for c in ("8", "12", "x", "11")]
    assert [(list(s.messages), s.reward, s.done) for s in steps] == [
        (["higher"], GUESS.WRONG, False), (["lower"], GUESS.WRONG, False),
        (["a number of 1-16, please"], GUESS.WRONG, False), ([], GUESS.RIGHT, True)]
    won = Episode(task={}, turn_rewards=[s.reward for s in steps])
    assert env.reward(won) == {"score": 0.0, "acc": 1.0}
    assert env.reward(Episode(task={}, turn_rewards=[GUESS.WRONG] * 8))["acc"] == 0.0
