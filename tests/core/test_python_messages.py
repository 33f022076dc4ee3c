"""A Python user sees what the CLI shows (issue 40, point 6): `str(CompileError)`,
`str(GraphError)` and a printed `flowgraph.check(...)` carry every diagnostic's expected
and actual values, notes and hint, and a hint that says how to change the graph speaks as
the graph was written (GraphBuilder's keywords, or the graph file's YAML)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import flowgraph
from flowgraph import GraphBuilder
from flowgraph.ir import Graph

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def correct(completions: list[str], solution: list[str], **kwargs: object) -> list[float]:
    return [0.0] * len(completions)


def _trl_graph() -> Graph:
    """TRL's reward function without the data's `row` wired (FG104) and TRL's `beta`
    given to the update (FG112)."""
    df = pd.DataFrame({"prompt": ["1+1=", "2+3="] * 4, "solution": ["2", "5"] * 4})
    g = GraphBuilder("trl_user")
    g.dims(Bp=4, N=2, P=16, T=8)
    g.model("actor", "builtin:tiny-lm", trainable=True)
    train = g.data("train", "prompts", df)
    gen = g.node("gen", "generate", model="actor", prompts=train.input_ids,
                 prompt_mask=train.attention_mask, row=train.row)
    seq = {"prompts": gen.prompts, "prompt_mask": gen.prompt_mask,
           "responses": gen.responses, "response_mask": gen.response_mask}
    old = g.node("old", "logprob", model="actor", **seq)
    reward = g.node("reward", "compute_score", model="actor", params={"fn": correct},
                    responses=gen.responses, response_mask=gen.response_mask)
    adv = g.node("adv", "grpo", scores=reward.scores, score_mask=reward.score_mask,
                 response_mask=gen.response_mask, index=gen.index)
    g.node("update", "ppo_actor_update", model="actor",
           params={"beta": 0.04, "mini_batch_size": 8}, old_log_prob=old.log_prob,
           advantages=adv.advantages, **seq)
    return g.build()


def test_compile_error_and_a_printed_check_carry_every_hint_in_python_words() -> None:
    graph = _trl_graph()
    with pytest.raises(flowgraph.CompileError) as exc:
        flowgraph.compile(graph)
    for text in (str(exc.value), str(flowgraph.check(graph))):
        assert "error[FG104]" in text and "error[FG112]" in text, text
        assert "= hint: wire `row=gen.row` (generate passes on the data's `row`: " \
               "`row=train.row`)" in text, text
        assert "= hint: `beta` is TRL's name; here: `ppo_actor_update.kl_loss_coef`" in text
        assert "inputs:" not in text  # no YAML for a graph that has no file


def test_a_graph_file_keeps_its_yaml_words_from_python_too() -> None:
    result = flowgraph.check(GRAPHS / "broken" / "missing_required_input.yaml")
    text = str(result)
    assert "error[FG104]" in text
    assert "\n  = expected: " in text  # the port's contract, as the CLI shows it
    assert "= hint: wire it: `inputs: {values: <node>.<port>}`" in text, text

