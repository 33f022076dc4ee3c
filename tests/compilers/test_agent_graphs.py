"""Agent rollouts under the algorithms downstream of them, unchanged: GRPO (token-mean),
PPO with a critic and GAE over per-turn rewards (holes skipped), DAPO's dynamic-sampling
filter, and strict mode, each two steps on the local target."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

import flowgraph

ENV = '''
from flowgraph.agent import Env, Step


class Again(Env):
    """Asks again twice; rewards an odd-length first answer (the groups differ)."""

    def reset(self, task):
        self.turn = 0
        return task["prompt"]

    def step(self, message):
        self.turn += 1
        return Step(["again"], reward=0.1, done=self.turn == 3)

    def reward(self, episode):
        return float(len(episode.messages[1]["content"]) % 2)
'''

HEAD = """
version: 1
name: agent_{name}
dims: {{Bp: 4, N: 4, P: 16, T: 40}}
plugins: [again_env.py]
models:
  actor: {{path: "builtin:tiny-lm", trainable: true, optimizer: {{lr: 1.0e-4}}}}
{critic}
data:
  train: {{kind: prompts, path: "builtin:reverse"}}
nodes:
  agent:
    kind: agent_rollout
    model: actor
    inputs: {{row: train.row}}
    params: {{env: "again_env.py:Again", max_turns: 3, max_turn_tokens: 8, max_tool_tokens: 6,
             show_tools: none}}
"""
SEQUENCES = """      prompts: {src}.prompts
      prompt_mask: {src}.prompt_mask
      responses: {src}.responses
      response_mask: {src}.response_mask
"""
GRAPHS = {
    "grpo": """
  adv:
    kind: grpo
    inputs: {scores: agent.scores, response_mask: agent.response_mask, index: agent.index}
  update:
    kind: ppo_actor_update
    model: actor
    inputs:
""" + SEQUENCES.format(src="agent") + """      advantages: adv.advantages
    params: {loss_agg_mode: token-mean}
""",
    "ppo": """
  values:
    kind: values
    model: critic
    inputs:
""" + SEQUENCES.format(src="agent") + """  adv:
    kind: gae
    inputs: {token_level_rewards: agent.token_level_rewards, values: values.values,
             response_mask: agent.response_mask}
  update:
    kind: ppo_actor_update
    model: actor
    inputs:
""" + SEQUENCES.format(src="agent") + """      advantages: adv.advantages
  update_critic:
    kind: ppo_critic_update
    model: critic
    inputs:
""" + SEQUENCES.format(src="agent") + """      values: values.values
      returns: adv.returns
""",
    "dapo": """
  keep:
    kind: filter
    inputs:
      scores: agent.scores
      index: agent.index
""" + SEQUENCES.format(src="agent") + """    params: {metric: std_nonzero, max_tries: 5, groups: 2}
  adv:
    kind: grpo
    inputs: {scores: keep.scores, response_mask: keep.response_mask, index: keep.index}
  update:
    kind: ppo_actor_update
    model: actor
    inputs:
""" + SEQUENCES.format(src="keep") + """      advantages: adv.advantages
    params: {loss_agg_mode: token-mean}
""",
}
CRITIC = """  critic: {path: "builtin:tiny-lm", trainable: true, optimizer: {lr: 1.0e-4}}"""


def write(tmp_path: Path, name: str) -> Path:
    (tmp_path / "again_env.py").write_text(ENV)
    head = HEAD.format(name=name, critic=CRITIC if name == "ppo" else "")
    graph = tmp_path / f"{name}.yaml"
    graph.write_text(textwrap.dedent(head) + GRAPHS[name]
                     + f"trainer: {{steps: 2, seed: 0, run_dir: {tmp_path / 'run'}}}\n")
    return graph


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_an_agent_rollout_feeds_the_algorithms_unchanged(tmp_path: Path, name: str) -> None:
    with open(os.devnull, "w") as out:
        flowgraph.run(write(tmp_path, name), out=out, tensorboard=False, strict=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(rows) == 2
    for row in rows:
        assert row["agent/turns"] >= 1.0 and "actor/pg_loss" in row
        assert row["agent/status/completed"] + row["agent/status/context_exhausted"] == 1.0
    if name == "ppo":
        assert "critic/vf_loss" in rows[0] and "critic/values/mean" in rows[0]


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("graph", ["tests/plugins/agent_turns.yaml", "graphs/grpo.yaml"],
                         ids=["agent", "single_turn"])
def test_bf16_runs_two_steps(tmp_path: Path, graph: str) -> None:
    # an agent run stopped at step 0: its self-check held bf16 log-probs to fp32's 1e-3
    # (2.46e-2 on tiny-lm-sft; `nodes.agent.TOLERANCE`)
    with open(os.devnull, "w") as out:
        flowgraph.run(ROOT / graph, out=out, tensorboard=False, overrides=[
            "models.actor.dtype=bfloat16", "trainer.steps=2", "trainer.eval_every=0",
            "trainer.val_before_train=false", "trainer.checkpoint_every=0",
            f"trainer.run_dir={tmp_path / 'run'}"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(rows) == 2 and all("actor/pg_loss" in row for row in rows)
