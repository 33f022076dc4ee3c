"""The `filter` kind with a user's predicate (#26 point 1, filters): the Python function
given as itself in the builder, or `file.py:keep` of a plugin in YAML, checked against the
call the node makes before launch, and run (local, the tiny model, DAPO's graph)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph import GraphBuilder
from flowgraph.errors import FlowgraphError

CALLS: list[list[float]] = []


def spread(scores: list[float]) -> bool:
    """A demanding user's DAPO filter: keep the groups whose best and worst differ."""
    CALLS.append(scores)
    return max(scores) - min(scores) > 0.05


def two_args(scores, threshold):  # type: ignore[no-untyped-def]
    return max(scores) > threshold


def drops_all(scores: list[float]) -> bool:
    return False


def not_a_bool(scores: list[float]) -> float:
    return sum(scores)


def raises(scores: list[float]) -> bool:
    raise KeyError("no threshold for this data source")


def _dapo(params: dict[str, object], *, tries: int = 30) -> flowgraph.Graph:
    """graphs/dapo.yaml in the builder, its filter's params `params`."""
    g = GraphBuilder("dapo_fn")
    g.dims(Bp=4, N=4, P=16, T=8)
    g.model("actor", "builtin:tiny-lm", trainable=True,
            optimizer={"lr": 5e-4, "warmup_steps": 2, "grad_clip": 1.0})
    data = g.data("train", "prompts", "builtin:arith")
    gen = g.node("gen", "generate", model="actor", prompts=data.input_ids,
                 prompt_mask=data.attention_mask, ground_truth=data.ground_truth,
                 params={"backend": "hf", "temperature": 1.0})
    reward = g.node("reward", "reward", model="actor", responses=gen.responses,
                    response_mask=gen.response_mask, ground_truth=gen.ground_truth,
                    params={"fn": "exact_match", "format_score": 0.1})
    overlong = g.node("overlong", "overlong_penalty", scores=reward.scores,
                      response_mask=gen.response_mask,
                      params={"overlong_buffer_len": 2, "penalty_factor": 0.5})
    keep = g.node("keep", "filter", scores=overlong.scores, index=gen.index,
                  prompts=gen.prompts, prompt_mask=gen.prompt_mask,
                  responses=gen.responses, response_mask=gen.response_mask,
                  params={**params, "max_tries": tries})
    seq: dict[str, Any] = {"prompts": keep.prompts, "prompt_mask": keep.prompt_mask,
                           "responses": keep.responses, "response_mask": keep.response_mask}
    old = g.node("old_logprob", "logprob", model="actor", **seq)
    adv = g.node("adv", "grpo", scores=keep.scores, response_mask=keep.response_mask,
                 index=keep.index, params={"norm_by_std": True})
    g.node("update_actor", "ppo_actor_update", model="actor", old_log_prob=old.log_prob,
           advantages=adv.advantages, params={"mini_batch_size": 8}, **seq)
    g.trainer(steps=2, seed=0)
    return g.build()


def _def_line(fn: object) -> int:
    return inspect.getsourcelines(fn)[1]  # type: ignore[arg-type]


def test_a_predicate_given_as_itself_checks_clean() -> None:
    assert [d.one_line() for d in flowgraph.check_graph(_dapo({"fn": spread})).errors] == []


def test_a_predicate_that_cannot_take_the_scores_is_found_at_its_def_line() -> None:
    (found,) = [d for d in flowgraph.check_graph(_dapo({"fn": two_args})).errors]
    assert found.code == "FG112" and found.pos is not None
    assert (Path(found.pos.file).resolve(), found.pos.line) == (
        Path(__file__).resolve(), _def_line(two_args))
    assert "`two_args` (parameter `fn` of `keep`" in found.message
    assert "cannot be called as `two_args(scores)`" in found.message
    assert "def keep(scores: list[float]) -> bool" in (found.hint or "")


def test_fn_and_metric_both_set_is_refused() -> None:
    (found,) = flowgraph.check_graph(_dapo({"fn": spread, "metric": "std_nonzero"})).errors
    assert found.code == "FG112"
    assert found.message == ("`keep` sets both `fn` and `metric`; `fn` replaces `metric`, "
                             "which would be ignored")


def test_a_plugin_file_predicate_in_yaml_is_checked_at_its_def_line(tmp_path: Path) -> None:
    (tmp_path / "filters.py").write_text(
        "def keep(scores):\n    return True\n\n\ndef bad():\n    return True\n")
    dapo = (Path(__file__).resolve().parents[2] / "graphs" / "dapo.yaml").read_text()
    assert "params: {metric: std_nonzero, max_tries: 30}" in dapo
    for fn, errors in (("keep", []), ("bad", [("FG112", 5)]), ("gone", [("FG112", None)])):
        text = "plugins: [filters.py]\n" + dapo.replace(
            "params: {metric: std_nonzero, max_tries: 30}",
            f"params: {{fn: 'filters.py:{fn}', max_tries: 30}}")
        (tmp_path / "g.yaml").write_text(text)
        graph = flowgraph.load_graph(str(tmp_path / "g.yaml"))[0]
        assert graph is not None
        result = flowgraph.check_graph(graph)
        got = [(d.code, d.pos.line if d.pos and d.pos.file.endswith("filters.py") else None)
               for d in result.errors]
        assert got == errors, [d.one_line() for d in result.errors]


def _run(graph: flowgraph.Graph, run_dir: Path) -> list[dict[str, float]]:
    with open(os.devnull, "w") as out:
        return flowgraph.run(flowgraph.compile(graph), overrides=[
            f"trainer.run_dir={run_dir}"], tensorboard=False, out=out).rows


def test_a_predicate_given_as_itself_filters_the_run(tmp_path: Path) -> None:
    """Two steps of DAPO's graph with `spread` in place of std_nonzero: each step's batch
    is full (Bp groups kept) after the tries its predicate asked for."""
    CALLS.clear()
    rows = _run(_dapo({"fn": spread}), tmp_path / "run")
    assert len(rows) == 2
    assert len(CALLS) == 4 * sum(r["filter/tries"] for r in rows)  # once per group
    assert all(len(c) == 4 and all(isinstance(s, float) for s in c) for c in CALLS)
    for row in rows:
        assert row["filter/kept_groups"] >= 4
        assert row["filter/tries"] >= 1
        assert row["filter/kept_groups"] + row["filter/dropped_groups"] == \
            4 * row["filter/tries"]


@pytest.mark.faults
@pytest.mark.parametrize(("fn", "message", "line"), [
    (not_a_bool, r"returned -?[0-9.]+ \(float\), not a bool: return True to keep", None),
    (raises, r"raised KeyError: 'no threshold for this data source'", "raise KeyError"),
    (drops_all, r"1 tries \(max_tries\) kept 0 of the 4 groups the batch needs \(4 "
                r"dropped: `drops_all` refused them\)", None),
])
def test_a_predicate_that_fails_names_the_node_step_group_and_its_line(
        tmp_path: Path, fn: object, message: str, line: str | None) -> None:
    with pytest.raises(FlowgraphError, match=message) as caught:
        _run(_dapo({"fn": fn}, tries=1), tmp_path / "run")
    text = str(caught.value)
    assert "node `keep` (kind filter, " in text and " at step 0: " in text
    if fn is not drops_all:
        name = fn.__name__  # type: ignore[attr-defined]
        assert f"filter predicate `{name}` ({__file__}:{_def_line(fn)}) on group 0 " \
               "(scores [" in text
    if line is not None:  # the user's own line that raised
        assert f"in {fn.__name__}: {line}" in text  # type: ignore[attr-defined]
