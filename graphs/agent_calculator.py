"""The calculator example's tool and environment (graphs/agent_calculator.yaml).

`calculator` is a typed function with a Google-style docstring: the rollout turns it
into a tool (its JSON schema from the hints). `Multiplication` scores an episode: 1 when
the last assistant message is the product (the row's ground truth), else 0; its dict's
`acc` is the validation table's `correct`, so `val/accuracy` is the held-out accuracy.
`CalculatorEnv` is it with `calculator` at hand; `calc_mcp.py` serves the same function
from an MCP server (graphs/agent_mcp.yaml).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping
from typing import Any

from flowgraph.agent import Env, Episode

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if max(abs(left), abs(right)) > 10**12:
            raise ValueError("numbers up to 10**12 only")
        return int(_OPS[type(node.op)](left, right))
    raise ValueError("only whole numbers and + - * // % are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression over whole numbers.

    Args:
        expression: The expression, e.g. "37*86"; + - * // % and parentheses.

    Returns:
        The value, as digits.
    """
    try:
        return str(_evaluate(ast.parse(expression.strip(), mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"


def ground_truth(task: Mapping[str, Any]) -> str:
    truth = task.get("ground_truth")
    if truth is None and isinstance(task.get("reward_model"), Mapping):
        truth = task["reward_model"].get("ground_truth")
    return str(truth).strip()


def final_answer(episode: Episode) -> str:
    """The content of the episode's last assistant message (stripped; '' if none)."""
    answers = [m for m in episode.messages if m.get("role") == "assistant"]
    return str(answers[-1].get("content") or "").strip() if answers else ""


class Multiplication(Env):
    """A multiplication (`builtin:mul`: `37*86=`) to answer: 1 for the product. Its tools
    come from elsewhere: graphs/agent_mcp.yaml serves `calculator` from an MCP server."""

    def reward(self, episode: Episode) -> dict[str, float]:  # type: ignore[override]
        right = float(final_answer(episode) == ground_truth(episode.task))
        return {"score": right, "acc": right}


class CalculatorEnv(Multiplication):
    """A multiplication to answer, with a calculator at hand."""

    tools = (calculator,)
