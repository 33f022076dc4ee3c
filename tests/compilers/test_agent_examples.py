"""The agent examples learn on CPU, as the main job does: graphs/agent_calculator.yaml
(GRPO with a calculator tool) raises held-out accuracy by 30 points and the tool-call
rate; graphs/agent_guess.yaml (per-turn rewards, GAE with a critic) takes fewer turns.
Their warm-ups (the trained built-ins tiny-lm-calc, tiny-lm-guess) are probed first:
what RL starts from is what the README says."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flowgraph.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(graph: str, run_dir: Path) -> tuple[list[dict[str, Any]], float]:
    t0 = time.perf_counter()
    assert main(["run", str(ROOT / "graphs" / graph), f"trainer.run_dir={run_dir}"]) == 0
    wall = time.perf_counter() - t0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()], wall


def _probe(*args: Any) -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("agent_sft_probe",
                                                  ROOT / "scripts" / "agent_sft_probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("agent_sft_probe", module)
    spec.loader.exec_module(module)
    out: dict[str, float] = module.probe(*args)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_the_calculator_warm_up_calls_half_the_time_and_copies_the_result() -> None:
    """builtin:tiny-lm-calc at temperature 1 on the 100 held-out problems, 4 samples
    each (measured: 50% call the tool, 99.5% of calls well formed, 99% with the
    question's numbers, 99% of answers copy the result, direct answers 0.5% right)."""
    got = _probe("builtin:tiny-lm-calc", "mul", 4, 1.0)
    assert 0.35 <= got["tool_rate"] <= 0.65, got
    assert got["well_formed"] >= 0.95 and got["right_arguments"] >= 0.9, got
    assert got["copied"] >= 0.9 and got["direct_right"] <= 0.05, got


@pytest.mark.slow
def test_the_calculator_graph_learns_to_use_the_tool(tmp_path: Path) -> None:
    """Measured on 2 cores: val/accuracy 0.43 -> 0.96 -> 0.99 -> 0.97 (every 10 steps),
    agent/tool_calls 0.45 -> 1.0 per episode, ~100 s with the warm-up trained first."""
    rows, wall = _run("agent_calculator.yaml", tmp_path / "run")
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert len(val) == 4 and val[-1] >= val[0] + 0.30, val
    calls = [r["agent/tool_calls"] for r in rows]
    assert _mean(calls[-5:]) >= calls[0] + 0.3, calls
    for r in rows:
        assert abs(sum(v for k, v in r.items() if k.startswith("agent/status/")) - 1) < 1e-6
        assert r["agent/turns"] >= 1 and r["agent/tool_time_s"] >= 0
    assert wall < 600, wall


@pytest.mark.slow
def test_the_guess_graph_learns_to_take_fewer_turns(tmp_path: Path) -> None:
    """Measured: the warm-up plays in 4.5 turns (probe, temperature 1); under RL
    agent/turns falls from 4.0 (first five steps) to 3.4 (last ten; binary search
    takes 3.375), every held-out game still won; ~25 s."""
    warm = _probe("builtin:tiny-lm-guess", "guess", 8, 1.0, 8)
    assert warm["won"] >= 0.9 and warm["turns"] >= 4.0, warm
    rows, wall = _run("agent_guess.yaml", tmp_path / "run")
    turns = [r["agent/turns"] for r in rows]
    assert _mean(turns[-10:]) <= _mean(turns[:5]) - 0.4, turns
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert min(val) >= 0.9, val
    assert wall < 600, wall


@pytest.mark.slow
def test_the_mixed_graph_learns_the_calculator_routing_both_envs(tmp_path: Path) -> None:
    """graphs/agent_mixed.yaml: one rollout routes each row of builtin:calc-guess to the
    calculator or to guess the number by its env_class, both envs every step.

    Measured (2 shared cores, 11.5 min; README "Examples that learn"): the calculator
    learns as its own graph does (rewards/calc/mean 0.69 over the first five steps, 0.90
    over the last five; tool calls 0.44 -> 0.98; val/agent/calc/accuracy 0.42 -> 0.92 ->
    0.97 -> 0.89); guess the number does not yet (rewards/guess/mean 0.51, then 0.31:
    more games run out of turns): not asserted here, an open item of issue 41, point 1
    (both envs are played every step and held out: their metrics are asserted)."""
    rows, wall = _run("agent_mixed.yaml", tmp_path / "run")
    reward = {env: [r[f"rewards/{env}/mean"] for r in rows] for env in ("calc", "guess")}
    assert _mean(reward["calc"][-5:]) >= _mean(reward["calc"][:5]) + 0.2, reward["calc"]
    calls = [r["agent/calc/tool_calls"] for r in rows]
    assert _mean(calls[-5:]) >= _mean(calls[:5]) + 0.3, calls
    val = [r for r in rows if "val/agent/calc/accuracy" in r]
    assert len(val) == 4 and val[-1]["val/agent/calc/accuracy"] >= \
        val[0]["val/agent/calc/accuracy"] + 0.3, val
    assert all("val/agent/guess/accuracy" in r for r in val), val
    assert all(len(v) == len(rows) for v in reward.values()), reward
    assert wall < 1200, wall
