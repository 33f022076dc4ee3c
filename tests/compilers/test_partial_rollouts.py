"""Partial rollouts (`trainer.partial_rollouts`, issue 28 point 3) on the local target.

The graph is tests/plugins/agent_turns.yaml one step stale (`max_staleness: 1`), its
episodes slowed down (`slow_s`: each tool call and env reply takes 0.2 s) so that one
outlasts a training step: the producer process takes the weights of an update that lands
during an episode at the episode's next turn. Every token records the version that
sampled it; staleness is counted per trained token (mean below max when episodes mix
versions, max within S); under `block` every step trains on the next 4 prompts of the
dataset (`data/train/position`), and so does a run killed (SIGKILL) or stopped (SIGTERM)
in the middle of an episode and resumed: no prompt lost, none trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.compilers import read_metrics
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "tests" / "plugins" / "agent_turns.yaml"
PARTIAL = ("trainer.max_staleness=1", "trainer.partial_rollouts=true",
           "nodes.agent.params.env_params.slow_s=0.2", "trainer.checkpoint_every=1")
POSITIONS = [4.0, 8.0, 12.0, 16.0, 20.0]
"""Where the data cursor stands after each of 5 steps of 4 prompts: none lost, none twice."""

pytestmark = pytest.mark.multiprocess


def _cli(run_dir: Path, *args: str, signal_at: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if signal_at is not None:  # the k-th tool call or env reply signals the trainer
        env["FG_TEST_SIGNAL_PARENT_AT"] = signal_at
    return subprocess.run(
        [sys.executable, "-m", "flowgraph", "run", str(AGENT), *PARTIAL, *args,
         f"trainer.run_dir={run_dir}"], capture_output=True, text=True, timeout=600,
        env=env, cwd=run_dir.parent)


def _positions(rows: list[dict[str, Any]]) -> list[float]:
    return [r["data/train/position"] for r in rows]


@pytest.mark.faults
@pytest.mark.parametrize("signame", ["SIGKILL", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_a_run_signalled_in_an_episode_resumes_with_nothing_lost_or_repeated(
        tmp_path: Path, signame: str) -> None:
    """The trainer signalled at the 30th tool call or env reply (in the middle of an
    episode of the third or fourth rollout): SIGKILL loses the steps after the last
    checkpoint, SIGTERM stops after the step running, its checkpoint holding the next
    rollout, whose episodes the producer finished first. The resumed run trains every
    step once, each on the next prompts; episodes that outlast an update take its
    weights, so staleness per token is below its max where they do."""
    run_dir = tmp_path / "run"
    stopped = _cli(run_dir, "trainer.steps=5", signal_at=f"30:{signame}")
    code = getattr(signal, signame)
    if signame == "SIGKILL":
        assert stopped.returncode == -code, stopped.stderr[-3000:]
    else:
        assert stopped.returncode == 128 + code, stopped.stderr[-3000:]
        assert "stopped by SIGTERM" in stopped.stderr, stopped.stderr[-3000:]
    before = read_metrics(run_dir)
    assert 1 <= len(before) < 5, [r["step"] for r in before]
    resumed = _cli(run_dir, "trainer.steps=5", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert _positions(rows) == POSITIONS
    state = json.loads((run_dir / "checkpoints" / "step_4" / "state.json").read_text())
    assert state["cursors"] == {"train": {"epoch": 0, "position": 20}}
    mixed = [r for r in rows if r["agent/versions_per_episode"] > 1.0]
    assert mixed, [r["agent/versions_per_episode"] for r in rows]
    # every rollout begins with the policy one step behind (`block`), the resumed run's
    # first one too, though its producer loaded its models while the trainer went on
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert any(0.0 < r["async/staleness"] < r["async/staleness_max"] for r in mixed), \
        [(r["async/staleness"], r["async/staleness_max"]) for r in mixed]
    # a checkpoint's buffer holds the next rollout, its tokens' versions with it
    buffer = torch.load(run_dir / "checkpoints" / "step_3" / "rollouts.pt", weights_only=True)
    assert [b["index"] for b in buffer] == [4]
    versions = buffer[0]["env"][("agent", "policy_version")]
    mask = buffer[0]["env"][("agent", "response_mask")].bool()
    assert 3 in set(versions[mask].tolist()) <= {3, 4}  # begun by version 3 (4 may land)
    assert set(versions[~mask].tolist()) <= {-1, 3, 4}  # (a masked episode's sampled too)


@pytest.mark.slow
@pytest.mark.faults
def test_a_run_killed_in_an_episode_resumes_to_the_uninterrupted_numbers(
        tmp_path: Path) -> None:
    """Episodes shorter than an update (no `slow_s`): a run's numbers do not depend on
    timing, and a run SIGKILLed in an episode (the 45th tool call or env reply, in step
    3's rollout, at some 13 a rollout) and resumed gives them, step after step. (The
    resumed producer began its first rollout with the newest weights, not one step
    behind: staleness 0.)"""
    fast = [a for a in PARTIAL if "slow_s" not in a]
    again = subprocess.run(
        [sys.executable, "-m", "flowgraph", "run", str(AGENT), *fast, "trainer.steps=5",
         f"trainer.run_dir={tmp_path / 'whole'}"], capture_output=True, text=True,
        timeout=600, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    run_dir = tmp_path / "run"
    env = dict(os.environ, FG_TEST_SIGNAL_PARENT_AT="45:SIGKILL")
    killed = subprocess.run(
        [sys.executable, "-m", "flowgraph", "run", str(AGENT), *fast, "trainer.steps=5",
         f"trainer.run_dir={run_dir}"], capture_output=True, text=True, timeout=600,
        env=env, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert 1 <= len(read_metrics(run_dir)) < 5
    resumed = subprocess.run(
        [sys.executable, "-m", "flowgraph", "run", str(AGENT), *fast, "trainer.steps=5",
         "--resume", f"trainer.run_dir={run_dir}"], capture_output=True, text=True,
        timeout=600, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_numbers(read_metrics(run_dir), read_metrics(tmp_path / "whole"))
