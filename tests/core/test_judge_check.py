"""FG611: a judge that cannot run, each case on graphs/grpo_judge.yaml with one edit
(graphs/broken/judge_template_field.yaml holds a field that does not exist)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgraph.checker import check_graph
from flowgraph.frontend import load_graph

GRAPH = (Path(__file__).resolve().parents[2] / "graphs" / "grpo_judge.yaml").read_text()


def _errors(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "g.yaml"
    path.write_text(text)
    graph, diags = load_graph(path)
    assert graph is not None, diags
    return [f"{d.code}: {d.message}" for d in check_graph(graph).diagnostics if d.is_error]


def test_grpo_judge_checks_clean(tmp_path: Path) -> None:
    assert _errors(GRAPH, tmp_path) == []


@pytest.mark.parametrize(("old", "new", "message"), [
    ("Answer: {response}", "Answer: {reply}",
     "FG611: `reward`: `template` names the field {reply}, which does not exist"),
    ("      ground_truth: gen.ground_truth\n    params:\n", "    params:\n",
     "FG611: `reward`: `template` names {ground_truth}, but its input `ground_truth` is not "
     "wired"),
    ("Answer: {response}", "Answer: {response",
     "FG611: `reward`: `template` is not a format string: expected '}' before end of string"),
    ("policy: actor", "policy: actr",
     "FG611: `reward`: `policy` names model `actr`, which the graph does not declare"),
    ("      max_new_tokens: 8\n", "      max_new_tokens: 8\n      url: http://127.0.0.1:1/v1\n",
     "FG611: `reward` (kind judge) has both a model and `url`: it needs exactly one"),
    ("    kind: judge\n    model: judge\n", "    kind: judge\n",
     "FG611: `reward` (kind judge) has neither a model nor `url`: it needs exactly one"),
])
def test_judge_that_cannot_run(old: str, new: str, message: str, tmp_path: Path) -> None:
    assert old in GRAPH
    assert _errors(GRAPH.replace(old, new), tmp_path) == [message]


def test_check_data_probes_the_judge(tmp_path: Path) -> None:
    from flowgraph.checker.data import check_data
    from flowgraph.nodes.models import load_tokenizer

    def probed(text: str) -> list[str]:
        path = tmp_path / "g.yaml"
        path.write_text(text)
        graph, _ = load_graph(path)
        assert graph is not None
        return [f"{d.code}: {d.message}" for d in check_data(graph, load_tokenizer)
                if d.is_error]

    assert probed(GRAPH) == []  # the judge model's tokenizer renders the rubric
    # nothing listens on port 9 of loopback (discard): the probe fails, naming the url
    url = GRAPH.replace("    kind: judge\n    model: judge\n", "    kind: judge\n").replace(
        "      max_new_tokens: 8\n",
        "      max_new_tokens: 8\n      url: http://127.0.0.1:9/v1\n")
    assert [m.split(": [")[0] for m in probed(url)] == [
        "FG611: `reward`: the judge server http://127.0.0.1:9/v1 does not answer a probe: "
        "ConnectError"]
