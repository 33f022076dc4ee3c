"""A black-box agent trained through the endpoint, as a graph: graphs/agent_calculator_openai.yaml
(an `openai.AsyncOpenAI` calculator loop) gives every number graphs/agent_calculator.yaml
(the same game as a native `Env`) gives on the same rows, on every target, and learns as
it does. (Rows equal native ones with tool calls in them: tests/agent/test_endpoint.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowgraph.cli import main
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["models.actor.path=builtin:tiny-lm", "dims.Bp=4", "dims.N=2", "trainer.steps=2",
         "trainer.eval_every=0", "trainer.val_before_train=false",
         "nodes.update.params.mini_batch_size=8"]
"""Two steps of 8 episodes on the untrained tiny model (no warm-up to train)."""


def _run(graph: str, run_dir: Path, *overrides: str) -> list[dict[str, Any]]:
    assert main(["run", str(ROOT / "graphs" / graph), f"trainer.run_dir={run_dir}",
                 *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def test_the_black_box_calculator_gives_the_native_graphs_numbers(tmp_path: Path) -> None:
    native = _run("agent_calculator.yaml", tmp_path / "native", *SMALL)
    black = _run("agent_calculator_openai.yaml", tmp_path / "black", *SMALL)
    assert_same_numbers(black, native, rel=0.0, abs_floor=0.0)
    assert [r["agent/forks"] for r in black] == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["fsdp", "ray"])
def test_black_box_episodes_on_two_workers_give_the_local_numbers(tmp_path: Path,
                                                                  target: str) -> None:
    """Each worker serves its own endpoint for its episodes; the numbers are the local
    native run's (measured: equal within assert_same_numbers' 1e-4, fsdp(2) and ray(2))."""
    native = _run("agent_calculator.yaml", tmp_path / "native", *SMALL)
    black = _run("agent_calculator_openai.yaml", tmp_path / target, *SMALL,
                 "--target", target, "--nproc", "2")
    assert_same_numbers(black, native)


@pytest.mark.slow
def test_the_black_box_calculator_learns_as_the_native_one(tmp_path: Path) -> None:
    """The whole example (30 steps, evaluation every 10; 83 s). Measured before the
    program answered bad arguments itself: val/accuracy 0.46 -> 0.98 -> 0.95 -> 0.97
    (the native graph: 0.46 -> 0.92 -> 0.98 -> 0.96). The runs part at the first call
    the parser cannot read (1 episode in 128 at step 0): the native rollout answers it
    with the parser's error, the program gets it as text."""
    black = _run("agent_calculator_openai.yaml", tmp_path / "black")
    val = [r["val/accuracy"] for r in black if "val/accuracy" in r]
    assert len(val) == 4 and val[-1] >= val[0] + 0.30, val
    calls = [r["agent/tool_calls"] for r in black]
    assert sum(calls[-5:]) / 5 >= calls[0] + 0.3, calls
    assert all(r["agent/forks"] == 0.0 for r in black)
