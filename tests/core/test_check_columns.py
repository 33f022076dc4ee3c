"""`flowgraph check --data`: a reward function called as TRL calls reward_funcs that needs
a dataset column the rows reaching it lack is an error (FG512) on its `def` line, before
launch, not a TypeError at the first batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from flowgraph import GraphBuilder
from flowgraph.checker import check_graph
from flowgraph.checker.data import check_data, row_source
from flowgraph.cli import main
from flowgraph.nodes.models import load_tokenizer
from flowgraph.runtime.reward_call import unmet_parameters

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "graphs" / "trl_format"


def _diags(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, Any]]]:
    status = main(["check", *args, "--data", "--format", "json"])
    return status, json.loads(capsys.readouterr().out)


def _def_line(file: Path, name: str) -> int:
    return next(i for i, line in enumerate(file.read_text().splitlines(), 1)
                if line.startswith(f"def {name}("))


def test_the_trl_format_example_checks_clean(capsys: pytest.CaptureFixture[str]) -> None:
    status, diags = _diags(capsys, str(EXAMPLE / "grpo.yaml"))
    assert status == 0, diags
    assert not [d for d in diags if d["severity"] != "note"]


def test_a_plugin_function_naming_a_column_the_file_lacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """rewards.py's `correct` and `brevity` read `solution`; the dataset calls it
    `solutions`. A function with a default for a missing column is fine."""
    shutil.copytree(EXAMPLE, tmp_path / "p")
    rows = [json.loads(line) for line in (EXAMPLE / "train.jsonl").read_text().splitlines()]
    (tmp_path / "p" / "train.jsonl").write_text("".join(
        json.dumps({"prompt": r["prompt"], "solutions": r["solution"]}) + "\n" for r in rows))
    rewards = tmp_path / "p" / "rewards.py"
    rewards.write_text(rewards.read_text() + "\n\ndef lenient(completions, solution=None, "
                       "**kwargs):\n    return [0.0] * len(completions)\n")
    graph = tmp_path / "p" / "grpo.yaml"
    graph.write_text(graph.read_text().replace(
        '"rewards.py:brevity"]', '"rewards.py:brevity", "rewards.py:lenient"]')
        .replace("weights: [1.0, 0.5]", "weights: [1.0, 0.5, 1.0]"))

    status, diags = _diags(capsys, str(graph))
    assert status == 1
    found = [d for d in diags if d["code"] == "FG512"]
    assert [(d["severity"], d["line"]) for d in found] == [
        ("error", _def_line(rewards, "correct")), ("error", _def_line(rewards, "brevity"))]
    for d, fn in zip(found, ("correct", "brevity"), strict=True):
        assert d["file"] == str(rewards) and d["node"] == "reward"
        for needle in (f"`rewards.py:{fn}`", "needs `solution`", "train.jsonl",
                       "columns prompt, solutions", "TypeError at the first batch"):
            assert needle in d["message"], d["message"]
        assert d["hint"].startswith("did you mean `solutions`?")


def correct(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """A TRL reward that reads the column `answer`."""
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def _python_graph(rows: pd.DataFrame, fn: Any = correct) -> Any:
    """GRPO built in Python: a DataFrame as the data, `correct` given as itself, the rows
    reaching the reward through generate (`reward.row` <- `gen.row` <- `train.row`)."""
    g = GraphBuilder("grpo_py")
    g.dims(Bp=2, N=2, P=16, T=4)
    g.model("actor", "builtin:tiny-lm-sft", trainable=True, optimizer={"lr": 3e-4})
    train = g.data("train", "prompts", rows)
    gen = g.node("gen", "generate", model="actor", prompts=train.input_ids,
                 prompt_mask=train.attention_mask, row=train.row)
    seq = {"prompts": gen.prompts, "prompt_mask": gen.prompt_mask,
           "responses": gen.responses, "response_mask": gen.response_mask}
    old = g.node("old_logprob", "logprob", model="actor", **seq)
    reward = g.node("reward", "compute_score", model="actor", params={"fn": [fn]},
                    responses=gen.responses, response_mask=gen.response_mask, row=gen.row)
    adv = g.node("adv", "grpo", scores=reward.scores, response_mask=gen.response_mask,
                 index=gen.index)
    g.node("update_actor", "ppo_actor_update", model="actor", **seq,
           old_log_prob=old.log_prob, advantages=adv.advantages)
    g.trainer(steps=1, seed=0, run_dir="runs/x", checkpoint_every=0, eval_every=0)
    return g.build()


def test_a_function_given_as_itself_on_a_dataframe_without_its_column() -> None:
    rows = [{"prompt": f"{a}+{a}=", "solution": str(2 * a)} for a in range(4)]
    graph = _python_graph(pd.DataFrame(rows))
    assert row_source(graph, graph.node("reward")) == "train"
    assert not [d for d in check_graph(graph).diagnostics if d.is_error]
    found = [d for d in check_data(graph, load_tokenizer) if d.code == "FG512"]
    assert len(found) == 1 and found[0].severity == "error"
    here = Path(__file__)
    assert (found[0].pos.file, found[0].pos.line) == (str(here), _def_line(here, "correct"))
    for needle in ("correct`", "needs `answer`", "columns prompt, solution", "memory:"):
        assert needle in found[0].message, found[0].message
    assert found[0].hint is not None and "(solution)" in found[0].hint

    fixed = _python_graph(pd.DataFrame([{**r, "answer": r["solution"]} for r in rows]))
    assert not [d for d in check_data(fixed, load_tokenizer) if d.code == "FG512"]


def test_the_parameters_trl_leaves_without_a_value() -> None:
    """Required keyword parameters that are neither TRL's own keywords nor columns; a
    default, `**kwargs` or `*args` need nothing."""
    def f(prompts, completions, answer, *args, trainer_state, log_metric, level=1,
          hint, **kwargs):  # type: ignore[no-untyped-def]
        return []

    assert unmet_parameters(f, ["answer"]) == ["hint"]
    assert unmet_parameters(f, ["hint"]) == ["answer"]
    assert unmet_parameters(len, []) == []


def test_the_prompt_column_is_not_a_keyword(tmp_path: Path) -> None:
    """TRL passes the prompt column as `prompts`, never under its own name."""
    def by_prompt(completions, prompt, **kwargs):  # type: ignore[no-untyped-def]
        return [0.0] * len(completions)

    rows = pd.DataFrame([{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)])
    graph = _python_graph(rows, by_prompt)
    found = [d for d in check_data(graph, load_tokenizer) if d.code == "FG512"]
    assert len(found) == 1
    assert "needs `prompt`, a column of dataset" in found[0].message
    assert "reaches a reward function as `prompts`" in found[0].message
    assert found[0].hint is not None and "did you mean `prompts`" in found[0].hint
