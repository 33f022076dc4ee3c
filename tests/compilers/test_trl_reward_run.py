"""A GRPO run on the local target with reward functions as TRL users write them, in a
plugin file next to the graph (graphs/trl_format): the dataset's columns reach them as
keyword arguments, conversational completions as message lists, and each function's
values are in metrics.jsonl as `rewards/<fn>/mean` and `/std`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import flowgraph

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "graphs" / "trl_format"
BONUS = '''

def bonus(prompts, completions, bonus, trainer_state, **kwargs):
    """The row's `bonus` column, read as a keyword argument; a TypeError unless the
    completions are message lists (the prompts are) and the step is the run's."""
    if not all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions):
        raise TypeError(f"conversational completions expected, got {completions[0]!r}")
    if not isinstance(prompts[0], list) or trainer_state.global_step not in (0, 1):
        raise TypeError(f"prompts {prompts[0]!r}, step {trainer_state.global_step}")
    return list(bonus)
'''


def test_a_grpo_run_calls_trl_reward_functions_with_the_dataset_columns(
        tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project)
    (project / "rewards.py").write_text((EXAMPLE / "rewards.py").read_text() + BONUS)
    rows = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()]
    (project / "train.jsonl").write_text(
        "".join(json.dumps({**r, "bonus": 0.25}) + "\n" for r in rows))
    graph = (project / "grpo.yaml").read_text()
    listed = '''fn: ["rewards.py:correct", "rewards.py:brevity"]'''
    assert listed in graph
    (project / "grpo.yaml").write_text(graph.replace(
        listed, '''fn: ["rewards.py:correct", "rewards.py:brevity", "rewards.py:bonus"]''')
        .replace("weights: [1.0, 0.5]", "weights: [1.0, 0.5, 1.0]"))

    run = flowgraph.run(project / "grpo.yaml", overrides=[
        "trainer.steps=2", "dims.Bp=4", "dims.N=4", "nodes.update_actor.params."
        "mini_batch_size=16", f"trainer.run_dir={tmp_path / 'run'}"], tensorboard=False)
    assert [r["step"] for r in run.rows] == [0, 1]
    for row in run.rows:
        assert (row["rewards/bonus/mean"], row["rewards/bonus/std"]) == (0.25, 0.0)
        correct = row["rewards/correct/mean"]  # 0 or 1 on every row: never NaN
        assert 0.0 <= correct <= 1.0 and "rewards/correct/std" in row
        # brevity applies to right answers only (None elsewhere): NaN with none right
        assert math.isnan(float(row["rewards/brevity/mean"])) == (correct == 0.0)
        brevity = 0.0 if correct == 0.0 else correct * row["rewards/brevity/mean"]
        assert row["critic/score/mean"] == pytest.approx(correct + 0.5 * brevity + 0.25)


@pytest.mark.faults
def test_a_trl_function_that_raises_names_the_node_step_and_the_users_line(
        tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project)
    source = (EXAMPLE / "rewards.py").read_text()
    bug = "    return [-0.01 * len(ids) if _answer(c) == s else None"
    assert bug in source
    (project / "rewards.py").write_text(source.replace(
        bug, "    kwargs['level'][0]  # the user's bug: no such column\n" + bug))
    line = 1 + next(i for i, text in enumerate(source.splitlines()) if text == bug)
    with pytest.raises(flowgraph.FlowgraphError) as exc:
        flowgraph.run(project / "grpo.yaml", overrides=[
            "trainer.steps=1", "dims.Bp=4", "dims.N=4", "nodes.update_actor.params."
            "mini_batch_size=16", f"trainer.run_dir={tmp_path / 'run'}"], tensorboard=False)
    text = str(exc.value)
    assert text.startswith("while executing node `reward` (kind compute_score"), text
    assert "reward fn `rewards.py:brevity` raised at step 0 on a batch of 16 completions " \
           "(rows 0..15): KeyError: 'level'" in text, text
    assert f"at {project / 'rewards.py'}:{line} in brevity" in text, text
