"""`flowgraph.check` from Python (issue #26, point 5): the diagnostics and a readable
table of every edge with its bound shape, printed or shown in a notebook; the raw data
(`table`, `shapes`) stays."""

from __future__ import annotations

from pathlib import Path

import pytest

import flowgraph
from flowgraph.checker import CheckResult, Resolved
from flowgraph.errors import UsageError

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def test_check_returns_the_diagnostics_and_every_edge_with_its_shape() -> None:
    result = flowgraph.check(GRAPHS / "grpo.yaml", nproc=1, overrides=[
        "dims.Bp=2", "nodes.update_actor.params.mini_batch_size=16"])
    assert isinstance(result, CheckResult) and result.ok
    assert all(isinstance(r, Resolved) for r in result.table.values())  # the data stays
    lines = result.edge_lines()
    assert len(lines) == len(result.shapes.edges) == 24
    # Bp=2 prompts, N=8 samples each (graphs/grpo.yaml), T=8
    assert any(line.split() == ["gen.responses", "->", "reward.responses", "int",
                                "(Bp*N,", "T)", "=", "(16,", "8)"] for line in lines), lines
    text = str(result)
    assert text.splitlines()[0] == "graph `grpo`: ok, 0 error(s), 0 warning(s); 24 edges"
    assert "\n  reward.scores -> adv.scores" in text
    assert result._repr_html_().startswith("<pre>graph `grpo`: ok")
    assert repr(result) == "<CheckResult graph `grpo`: ok, 0 error(s), 0 warning(s); 24 edges>"


def test_a_broken_edge_is_marked_and_its_diagnostic_printed() -> None:
    result = flowgraph.check(GRAPHS / "broken" / "rank_mismatch_scores_into_gae.yaml")
    assert not result.ok
    text = str(result)
    assert "error[FG201]: edge `reward.scores -> adv.token_level_rewards`" in text
    (broken,) = [line for line in result.edge_lines() if line.endswith("✗")]
    assert broken.startswith("reward.scores -> adv.token_level_rewards")
    assert "float (Bp*N,) = (16,)" in broken


def test_check_takes_a_python_graph_and_refuses_overrides_for_it() -> None:
    graph = flowgraph.load_graph(GRAPHS / "dpo.yaml")[0]
    assert graph is not None
    assert flowgraph.check(graph).ok
    for call in (flowgraph.check, flowgraph.compile, flowgraph.run):
        with pytest.raises(UsageError) as refused:
            call(graph, overrides=["trainer.steps=1"])
        assert str(refused.value).startswith(
            "overrides apply to graph files (trainer.steps=1): give the graph's file, or "
            "change a graph built in Python in Python (GraphBuilder's `trainer(steps=...)`")


def test_an_unreadable_file_raises_with_its_diagnostics(tmp_path: Path) -> None:
    with pytest.raises(flowgraph.GraphError) as exc:
        flowgraph.check(tmp_path / "missing.yaml")
    assert exc.value.diagnostics[0].code == "FG001"
