"""The reported score is the one the advantage trains on (`flowgraph.plan.score.score_plan`): the
step's `critic/score/mean` (and so the console, `val/score/mean` and Prometheus, which
read it) and the validation table's `score`, on the plans the shipped and the users'
graphs compile to, with tensors made up so that every candidate differs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from flowgraph.compilers.metrics import STEP_METRICS, HeldOut, step_metrics
from flowgraph.frontend import load_graph
from flowgraph.nodes.models import load_tokenizer
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan, ScorePlan, plan_from_json, plan_to_json
from flowgraph.plan.score import score_plan

ROOT = Path(__file__).resolve().parents[2]

AGENT_ENV = '''
from flowgraph.agent import Env, Step


class Tools(Env):
    """A tool call earns -0.01 (a tool's own reward); the episode reward is unused."""

    def reset(self, task):
        return task["prompt"]

    def step(self, message):
        return Step(["ok"], reward=-0.01, done=True)
'''
REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25
'''
VERL_WIRING = """
version: 1
name: verl_wiring
dims: {Bp: 2, N: 2, P: 16, T: 24}
plugins: [tools_env.py, rewards.py]
models:
  actor: {path: "builtin:tiny-lm", trainable: true, optimizer: {lr: 1.0e-4}}
data:
  train: {kind: prompts, path: "builtin:reverse"}
nodes:
  agent:
    kind: agent_rollout
    model: actor
    inputs: {row: train.row}
    params: {env: "tools_env.py:Tools", max_turns: 2, max_turn_tokens: 8, max_tool_tokens: 4,
             show_tools: none}
  reward:
    kind: compute_score
    model: actor
    inputs: {responses: agent.responses, response_mask: agent.response_mask}
    params: {fn: "rewards.py:compute_score"}
  adv:
    kind: grpo
    inputs: {scores: reward.scores, response_mask: agent.response_mask, index: agent.index}
  update:
    kind: ppo_actor_update
    model: actor
    inputs: {prompts: agent.prompts, prompt_mask: agent.prompt_mask,
             responses: agent.responses, response_mask: agent.response_mask,
             advantages: adv.advantages}
"""


def _plan(path: Path) -> ExecutionPlan:
    graph, diags = load_graph(str(path), [])
    assert graph is not None, diags
    plan = compile_graph(graph).plan
    assert plan is not None
    return plan


def _verl_wiring(tmp_path: Path) -> ExecutionPlan:
    (tmp_path / "tools_env.py").write_text(AGENT_ENV)
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "graph.yaml").write_text(textwrap.dedent(VERL_WIRING))
    return _plan(tmp_path / "graph.yaml")


def test_with_verls_wiring_the_score_is_compute_scores_not_the_tool_rewards(
        tmp_path: Path) -> None:
    plan = _verl_wiring(tmp_path)
    assert score_plan(plan.nodes) == ScorePlan("adv", "reward.scores", "reward.scores",
                                   mask="agent.response_mask")
    mask = torch.ones(4, 3, dtype=torch.int64)
    env = {("agent", "scores"): torch.full((4,), -0.04),  # the tool rewards, unused
           ("agent", "response_mask"): mask, ("agent", "prompt_mask"): mask,
           ("reward", "scores"): torch.tensor([0.0, 0.5, 0.25, 0.25]),
           ("adv", "advantages"): torch.zeros(4, 3), ("adv", "returns"): torch.zeros(4, 3)}
    metrics = step_metrics(plan, env)
    assert metrics["critic/score/mean"] == pytest.approx(0.25)
    assert metrics["critic/rewards/mean"] == pytest.approx(0.25)
    assert set(metrics) <= {name for name, _ in STEP_METRICS}  # the README's table says each


def test_dapos_score_is_the_penalised_one_the_advantage_saw() -> None:
    """graphs/dapo.yaml: reward -> overlong (penalty) -> keep (filter) -> adv. The step
    reports the kept, penalised scores; the validation table each response's penalised
    score (the filter's input: a row of each response), not the reward's."""
    plan = _plan(ROOT / "graphs" / "dapo.yaml")
    assert score_plan(plan.nodes) == ScorePlan("adv", "keep.scores", "overlong.scores",
                                   mask="keep.response_mask")
    tok = load_tokenizer("builtin:tiny-lm")
    rows = [tok(t, add_special_tokens=False).input_ids for t in ("7", "12", "3", "4")]
    T = max(len(r) for r in rows)
    responses = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    prompts = torch.tensor([tok("1+1=", add_special_tokens=False).input_ids] * 4)
    env = {("gen", "responses"): responses, ("gen", "response_mask"): mask,
           ("gen", "prompts"): prompts, ("gen", "prompt_mask"): torch.ones_like(prompts),
           ("gen", "index"): torch.tensor([0, 0, 1, 1]),
           ("gen", "ground_truth"): ["7", "12", "8", "9"],
           ("reward", "scores"): torch.tensor([1.0, 1.0, 0.1, 0.1]),
           ("overlong", "scores"): torch.tensor([1.0, 0.5, 0.1, -0.4]),
           ("keep", "scores"): torch.tensor([1.0, 0.5]),  # the group kept
           ("keep", "response_mask"): mask[:2], ("adv", "advantages"): torch.zeros(2, T),
           ("adv", "returns"): torch.zeros(2, T)}
    # (1.0 + 0.5) / 2, where the reward's mean is (1 + 1 + .1 + .1) / 4 = 0.55
    assert step_metrics(plan, env)["critic/score/mean"] == pytest.approx(0.75)
    held_out = HeldOut()
    held_out.add(plan, env, {"actor": tok})
    assert [r["score"] for r in held_out.table] == pytest.approx([1.0, 0.5, 0.1, -0.4])
    assert [r["correct"] for r in held_out.table] == [True, True, False, False]


def test_ppos_score_is_verls_and_its_rewards_the_kl_penalised_ones() -> None:
    plan = _plan(ROOT / "graphs" / "ppo.yaml")
    assert score_plan(plan.nodes) == ScorePlan("adv", "reward.scores", "reward.scores",
                                   mask="gen.response_mask", rewards="kl.token_level_rewards")


def test_an_agents_token_rewards_are_summed_and_dpo_reports_no_score() -> None:
    plan = _plan(ROOT / "graphs" / "agent_guess.yaml")
    assert score_plan(plan.nodes) == ScorePlan("adv", "agent.token_level_rewards",
                                   "agent.token_level_rewards", per_token=True,
                                   mask="agent.response_mask",
                                   rewards="agent.token_level_rewards")
    rewards = torch.tensor([[0.0, 0.1, 0.0, 1.0], [0.0, 0.0, 5.0, 0.0]])  # 5: masked out
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    env = {("agent", "token_level_rewards"): rewards, ("agent", "response_mask"): mask,
           ("agent", "prompt_mask"): mask, ("agent", "scores"): torch.tensor([1.1, 0.0]),
           ("adv", "advantages"): torch.zeros(2, 4), ("adv", "returns"): torch.zeros(2, 4)}
    metrics = step_metrics(plan, env)
    assert metrics["critic/score/mean"] == pytest.approx((1.1 + 0.0) / 2)
    assert score_plan(_plan(ROOT / "graphs" / "dpo.yaml").nodes) is None


def test_a_plan_file_cannot_report_another_score() -> None:
    """The score is derived from the plan's nodes, never stored: a plan file written
    while it was stored (a `score` entry, here edited) reads as its nodes say."""
    data = json.loads(plan_to_json(_plan(ROOT / "graphs" / "dapo.yaml")))
    assert "score" not in data
    data["score"] = {"advantage": "adv", "scores": "reward.scores", "rows": "reward.scores"}
    assert score_plan(plan_from_json(json.dumps(data)).nodes) == ScorePlan(
        "adv", "keep.scores", "overlong.scores", mask="keep.response_mask")


LOO = '''
import torch
from jaxtyping import Float, Int
from torch import Tensor

from flowgraph.registry import node_kind


@node_kind("length_loo", outputs=["advantages"], category="advantage")
def length_loo(scores: Float[Tensor, "b"], response_mask: Int[Tensor, "b T"],
               index: Int[Tensor, "b"]) -> Float[Tensor, "b T"]:
    """A leave-one-out advantage over length-normalised scores; no `returns`."""
    mask = response_mask.float()
    x = scores / mask.sum(-1).clamp_min(1.0)
    same = (index[:, None] == index[None, :]).float()
    others = (same.sum(-1) - 1).clamp_min(1.0)
    baseline = (same @ x - x) / others
    return (x - baseline)[:, None] * mask
'''


def test_a_plugin_advantage_without_returns_runs_and_reports_its_score(
        tmp_path: Path) -> None:
    """A researcher's advantage kind that declares no `returns`: `run` reports the
    metrics of what it declares (no `critic/returns/mean`; it stopped with
    `KeyError: ('adv', 'returns')`), and its score is the shaped one it reads
    (`length_penalty` after the reward), not the reward's."""
    import flowgraph

    (tmp_path / "my_algos.py").write_text(LOO)
    (tmp_path / "graph.yaml").write_text(textwrap.dedent(f"""
        version: 1
        name: loo
        dims: {{Bp: 2, N: 2, P: 16, T: 8}}
        plugins: [my_algos.py]
        models:
          actor: {{path: "builtin:tiny-lm", trainable: true, optimizer: {{lr: 1.0e-4}}}}
        data:
          train: {{kind: prompts, path: "builtin:arith"}}
        nodes:
          gen:
            kind: generate
            model: actor
            inputs: {{prompts: train.input_ids, prompt_mask: train.attention_mask,
                     ground_truth: train.ground_truth}}
            params: {{backend: hf, temperature: 1.0}}
          reward:
            kind: reward
            model: actor
            inputs: {{responses: gen.responses, response_mask: gen.response_mask,
                     ground_truth: gen.ground_truth}}
            params: {{fn: format, format_score: 1.0}}
          shaped:
            kind: length_penalty
            inputs: {{scores: reward.scores, response_mask: gen.response_mask}}
            params: {{coef: 1.0}}
          adv:
            kind: length_loo
            inputs: {{scores: shaped.scores, response_mask: gen.response_mask,
                     index: gen.index}}
          update:
            kind: ppo_actor_update
            model: actor
            inputs: {{prompts: gen.prompts, prompt_mask: gen.prompt_mask,
                     responses: gen.responses, response_mask: gen.response_mask,
                     advantages: adv.advantages}}
        trainer: {{steps: 2, seed: 0, run_dir: {tmp_path / 'run'}}}
        """))
    assert flowgraph.check(tmp_path / "graph.yaml").ok
    rows = flowgraph.run(tmp_path / "graph.yaml", tensorboard=False).rows
    assert len(rows) == 2
    for row in rows:
        assert "critic/advantages/mean" in row and "critic/returns/mean" not in row
        # the reward is in [0, 1]; the shaped score, the reward minus 1 a token
        # (length_penalty), is at most 1 - the mean length: below 0 for responses longer
        # than a token on average, where the reward's mean is not
        assert row["response_length/mean"] > 1
        assert row["critic/score/mean"] <= 1.0 - row["response_length/mean"] + 1e-6


def test_the_readme_says_where_each_step_metric_comes_from() -> None:
    """Its table is `STEP_METRICS`, row for row."""
    readme = (ROOT / "README.md").read_text()
    rows = [f"| `{name}` | {source} |" for name, source in STEP_METRICS]
    start = readme.index(rows[0])
    assert readme[start:].splitlines()[:len(rows)] == rows
