"""The agent graph on every target and in every mode (issue 27, point 7): episodes split
across workers sample what one worker samples; a run killed in the middle of a rollout
resumes to the uninterrupted run's numbers; one-step-stale rollouts (max_staleness 1)
give the same numbers on ray(2) as locally; vLLM-CPU rollouts (token-id prompts) give
the log-probs the trainer computes, as the HF ones do.

The graph is tests/plugins/agent_turns.yaml: GRPO over episodes of 1-3 turns whose
parser reads a turn of odd length as a tool call (the tiny models write no Hermes call
of their own), so every step runs tools and env replies and ends episodes with several
statuses. Equal numbers on fsdp(2) and ray(2) against the local run (untied and tied
models) are `test_fsdp.py::test_agent_rollouts_equal_local` and
`test_ray.py::test_ray_gives_the_numbers_of_the_local_run[agent-*]` (slow: the same
local reference, `conftest.LocalReference`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.compilers import read_metrics
from flowgraph.compilers.worker import rollout_engine
from flowgraph.nodes.agent import agent_rollout
from flowgraph.nodes.data import prompt_source
from flowgraph.nodes.logprob import logprob
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.runtime.context import NodeContext
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
AGENT = PLUGINS / "agent_turns.yaml"
MODEL = "builtin:tiny-lm-sft"
PARAMS = {"env_params": {"one_turn_from": 2}, "parser": "every_other", "max_turns": 3,
          "max_turn_tokens": 10, "max_tool_tokens": 6, "show_tools": "none"}
"""The graph's agent node (agent_turns.yaml) but its env."""


@pytest.fixture(autouse=True)
def _plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def rows(tokenizer: Any) -> list[Any]:
    return prompt_source("builtin:reverse", tokenizer=tokenizer, max_prompt_length=16,
                         shuffle=False).train.next_batch(4)["row"]


def _rollout(model: Any, tokenizer: Any, rows: list[Any], *, row_offset: int = 0,
             node: str = "agent", **params: Any) -> dict[str, Any]:
    from agent_turns_env import Turns

    ctx = NodeContext(node, "agent_rollout", step=3, seed=7, row_offset=row_offset,
                      dims={"N": 2, "P": 16, "T": 48}, engines=rollout_engine)
    out = agent_rollout(ctx, model, tokenizer, row=rows, env=Turns, **{**PARAMS, **params})
    out["metrics"] = ctx.metrics
    return out


def _cat(halves: list[dict[str, Any]], key: str) -> Any:
    if isinstance(halves[0][key], torch.Tensor):
        return torch.cat([h[key] for h in halves])
    return [x for h in halves for x in h[key]]


def test_episodes_split_across_workers_sample_what_one_worker_samples(
        tokenizer: Any, rows: list[Any]) -> None:
    """Two workers' halves of the batch (row offsets 0 and 2): each episode's turns,
    tool calls, statuses, tokens and log-probs are those of the whole batch on one
    worker, though the halves' episodes end at other turns (so each turn's batch
    differs: the second half's episodes take one turn); the tool and the env's replies
    both ran."""
    model = load_model(MODEL)
    whole = _rollout(model, tokenizer, rows)
    halves = [_rollout(model, tokenizer, rows[k:k + 2], row_offset=k) for k in (0, 2)]
    for key in ("prompts", "responses", "response_mask", "num_turns", "tool_calls",
                "turn_rewards", "turn_mask", "scores"):
        assert torch.equal(_cat(halves, key), whole[key]), key
    assert _cat(halves, "status") == whole["status"]
    torch.testing.assert_close(_cat(halves, "rollout_log_prob"), whole["rollout_log_prob"],
                               atol=1e-5, rtol=0)
    assert whole["tool_calls"].sum() > 0, "some turns called the tool"
    assert (whole["num_turns"] > whole["tool_calls"]).any(), "some turns had env replies"
    turns = whole["num_turns"].tolist()
    assert turns[4:] == [1] * 4 and min(turns[:4]) >= 2, turns
    assert (whole["response_mask"] == 0).logical_and(whole["responses"] != 0).any(), \
        "tool and env tokens are holes in the mask"


def _cli(run_dir: Path, *args: str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flowgraph", "run", str(AGENT), *args,
                           f"trainer.run_dir={run_dir}"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, **(env or {})})


@pytest.mark.faults
def test_a_run_killed_in_a_rollout_resumes_to_the_uninterrupted_numbers(
        tmp_path: Path, local_run: Any) -> None:
    """SIGKILL while step 2's episodes start (the 19th env reset: 8 episodes a step):
    steps 0-1 and their checkpoint survive; the resumed run's step 2 is the
    uninterrupted run's, agent metrics included."""
    steps = ("trainer.steps=3", "trainer.checkpoint_every=2")
    killed = _cli(tmp_path / "killed", *steps, env={"FG_TEST_KILL_AT_RESET": "19"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "killed")] == [0, 1]
    resumed = local_run(AGENT, tmp_path / "killed", *steps, resume=True)
    full = local_run(AGENT, tmp_path / "full", *steps)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert_same_numbers(resumed, full)
    assert full[2]["agent/tool_calls"] > 0 and full[2]["agent/turns"] > 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_step_stale_agent_rollouts_on_ray_equal_the_local_producer(
        tmp_path: Path, local_run: Any) -> None:
    """`trainer.max_staleness: 1`: locally the episodes run in a producer process one
    step ahead; on ray(2) the rollout pool's worker runs them one step ahead while the two
    trainer workers train: the same numbers, staleness 0 then 1."""
    overrides = ("trainer.steps=3", "trainer.max_staleness=1")
    local = local_run(AGENT, tmp_path / "local", *overrides)
    assert [r["async/staleness"] for r in local] == [0.0, 1.0, 1.0]
    done = _cli(tmp_path / "ray", "--target", "ray", "--nproc", "2", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_numbers(read_metrics(tmp_path / "ray"), local)
    assert all(r["agent/tool_calls"] > 0 for r in local)


@pytest.mark.slow
def test_vllm_agent_rollouts_have_the_trainers_log_probs_as_hf_ones_do(
        tokenizer: Any, rows: list[Any], tmp_path: Path, local_run: Any) -> None:
    """As the generate kind's vLLM test: vLLM-CPU turns (each prompt the token ids of the
    history, never re-rendered) have, token for token, the log-probs the trainer's forward
    computes of the assembled rows (holes included); so do the HF ones; greedy episodes
    are the same episodes on both. Then the graph runs 2 steps with vLLM rollouts."""
    try:
        from flowgraph.compilers.vllm import engine as _vllm
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable: {exc}", pytrace=False)
    model = load_model(MODEL)
    try:
        for backend in ("vllm", "hf"):
            out = _rollout(model, tokenizer, rows, backend=backend, node=f"agent-{backend}",
                           temperature=0.7)
            mask = out["response_mask"]
            mine = logprob(model, out["prompts"], out["prompt_mask"], out["responses"], mask,
                           temperature=0.7)["log_prob"]
            torch.testing.assert_close(mine * mask, out["rollout_log_prob"] * mask,
                                       atol=1e-3, rtol=0)
            assert out["tool_calls"].sum() > 0 and mask.sum() > 0, backend
        greedy = {b: _rollout(model, tokenizer, rows, backend=b, do_sample=False)
                  for b in ("vllm", "hf")}
        for key in ("responses", "response_mask", "num_turns", "tool_calls"):
            assert torch.equal(greedy["vllm"][key], greedy["hf"][key]), key
        torch.testing.assert_close(greedy["vllm"]["rollout_log_prob"],
                                   greedy["hf"]["rollout_log_prob"], atol=1e-4, rtol=0)
    finally:
        _vllm.close_engines()
    try:
        run = local_run(AGENT, tmp_path / "vllm", "trainer.steps=2",
                        "nodes.agent.params.backend=vllm")
    finally:
        _vllm.close_engines()
    assert [r["step"] for r in run] == [0, 1] and run[1]["agent/tool_calls"] > 0
