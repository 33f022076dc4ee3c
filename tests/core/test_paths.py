"""Paths resolve from the graph file; the command line and Python from the working
directory; a plan records them absolute; `builtin:` names and hub ids are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgraph import GraphBuilder
from flowgraph.checker import check_graph
from flowgraph.cli import main
from flowgraph.frontend import graph_from_yaml, load_graph
from flowgraph.plan import plan_from_json

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
VERL = GRAPHS / "verl_format" / "grpo.yaml"


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory that is neither the repository nor the graph's folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _line_of(file: Path, needle: str) -> int:
    return next(i for i, line in enumerate(file.read_text().splitlines(), 1) if needle in line)


def test_a_graph_file_s_paths_are_relative_to_its_folder(elsewhere: Path) -> None:
    graph, diags = load_graph(VERL)
    assert graph is not None and not diags
    train = graph.data_source("train")
    assert train is not None
    assert train.path == str(VERL.parent / "train.parquet")
    assert train.params.get("eval_path") == str(VERL.parent / "test.parquet")


def test_check_data_runs_from_another_folder(elsewhere: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(VERL), "--data", "--format", "json"]) == 0
    diags = json.loads(capsys.readouterr().out)
    assert [d for d in diags if d["severity"] != "note"] == []


def test_a_plan_records_absolute_paths_and_runs_from_anywhere(
        elsewhere: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", str(VERL), "-o", "plan.json"]) == 0
    text = (elsewhere / "plan.json").read_text()
    data = json.loads(text)["run"]["data"]["train"]
    assert (data["path"], data["eval_path"]) == (str(VERL.parent / "train.parquet"),
                                                 str(VERL.parent / "test.parquet"))
    (elsewhere / "other").mkdir()
    monkeypatch.chdir(elsewhere / "other")
    plan = plan_from_json(text)
    assert plan.data[0].path == str(VERL.parent / "train.parquet")
    assert plan.plugin_paths == (str(VERL.parent),)


def test_a_command_line_path_is_relative_to_the_working_directory(elsewhere: Path) -> None:
    (elsewhere / "mine.parquet").write_bytes((VERL.parent / "train.parquet").read_bytes())
    graph, diags = load_graph(VERL, ["data.train.path=mine.parquet",
                                     "data.train.eval_path=../held_out.parquet"])
    assert graph is not None and not diags
    assert graph.data[0].path == str(elsewhere / "mine.parquet")
    assert graph.data[0].params.get("eval_path") == str(elsewhere.parent / "held_out.parquet")


def test_a_missing_dataset_names_the_resolved_path_and_the_line(
        elsewhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """From the working directory the old rule's `graphs/verl_format/train.parquet` does
    not exist next to the graph: the warning (FG123) and the --data error (FG501) say
    which path it resolved to, at the data source's line, and the rule."""
    old = VERL.read_text().replace("path: train.parquet", "path: graphs/verl_format/train.parquet")
    (elsewhere / "grpo.yaml").write_text(old)
    (elsewhere / "rewards.py").write_text((VERL.parent / "rewards.py").read_text())
    graph, _ = load_graph(elsewhere / "grpo.yaml")
    assert graph is not None
    resolved = elsewhere / "graphs" / "verl_format" / "train.parquet"
    [warning, _held_out] = [d for d in check_graph(graph).diagnostics if d.code == "FG123"]
    assert f"dataset file `{resolved}` does not exist" in warning.message
    assert warning.pos is not None and warning.pos.line == _line_of(elsewhere / "grpo.yaml",
                                                                    "train:")
    assert warning.hint is not None and "relative to that file's folder" in warning.hint

    assert main(["check", "grpo.yaml", "--data", "--format", "json"]) == 1
    [error, _] = [d for d in json.loads(capsys.readouterr().out) if d["code"] == "FG501"]
    assert f"`{resolved}` does not exist" in error["message"]
    assert error["line"] == _line_of(elsewhere / "grpo.yaml", "path: graphs/verl_format")


@pytest.mark.parametrize("key", ["path", "tokenizer"])
def test_a_missing_absolute_model_path_is_never_taken_for_a_hub_id(
        elsewhere: Path, capsys: pytest.CaptureFixture[str], key: str) -> None:
    """An absolute path is not a hub id: `check` warns (FG123, as for a dataset: the plan
    may be compiled for a machine that has it) and `check --data` fails (FG506)."""
    missing = elsewhere / "no" / "such-model"
    graph, _ = load_graph(VERL, [f"models.actor.{key}={missing}"])
    assert graph is not None
    [warning] = [d for d in check_graph(graph).diagnostics if d.code == "FG123"]
    assert (warning.severity, warning.node) == ("warning", "actor")
    assert f"model `actor`: folder `{missing}` does not exist" in warning.message
    assert main(["check", str(VERL), f"models.actor.{key}={missing}", "--data",
                 "--format", "json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert [(d["code"], d["severity"]) for d in found if d["node"] == "actor"] == [
        ("FG123", "warning"), ("FG506", "error")], found  # no FG509 note "a hub id"


@pytest.mark.parametrize("path", ["Qwen/Qwen2.5-0.5B", "gpt2", "builtin:tiny-lm"])
def test_hub_ids_and_builtin_names_are_kept(elsewhere: Path, path: str) -> None:
    yaml = VERL.read_text().replace('ref: {path: "builtin:tiny-lm"}', f'ref: {{path: "{path}"}}')
    (elsewhere / "g.yaml").write_text(yaml)
    graph, _ = load_graph(elsewhere / "g.yaml", [f"models.actor.path={path}"])
    assert graph is not None
    assert [m.path for m in graph.models] == [path, path]


def test_a_local_folder_named_like_a_hub_id_is_a_path(elsewhere: Path) -> None:
    (elsewhere / "org" / "model").mkdir(parents=True)
    yaml = VERL.read_text().replace('ref: {path: "builtin:tiny-lm"}',
                                    'ref: {path: org/model, tokenizer: org/model}')
    (elsewhere / "sub").mkdir()
    (elsewhere / "g.yaml").write_text(yaml)
    graph, _ = load_graph(elsewhere / "g.yaml")
    assert graph is not None
    ref = graph.model("ref")
    assert ref is not None and ref.path == ref.tokenizer == str(elsewhere / "org" / "model")


def test_text_and_python_graphs_resolve_from_the_working_directory(elsewhere: Path) -> None:
    """Neither has a file: their relative paths are the working directory's."""
    graph = graph_from_yaml("nodes: {}\ndata: {train: {kind: prompts, path: d/train.jsonl}}\n"
                            "models: {actor: {path: ./actor}}\n")
    assert graph.data[0].path == str(elsewhere / "d" / "train.jsonl")
    assert graph.models[0].path == str(elsewhere / "actor")

    g = GraphBuilder("py")
    g.model("actor", "./actor", tokenizer="Qwen/Qwen2.5-0.5B")
    g.data("train", "prompts", "d/train.jsonl", eval_path="d/test.jsonl")
    built = g.build()
    assert (built.models[0].path, built.models[0].tokenizer) == (str(elsewhere / "actor"),
                                                                 "Qwen/Qwen2.5-0.5B")
    assert built.data[0].path == str(elsewhere / "d" / "train.jsonl")
    assert built.data[0].params.get("eval_path") == str(elsewhere / "d" / "test.jsonl")


def test_a_plugin_on_the_command_line_is_found_in_the_working_directory(
        elsewhere: Path) -> None:
    (elsewhere / "fg_noop_plugin.py").write_text('"""A plugin that registers nothing."""\n')
    graph, _ = load_graph(GRAPHS / "grpo.yaml", ["plugins=[fg_noop_plugin.py]"])
    assert graph is not None
    assert [d for d in check_graph(graph).diagnostics if d.code == "FG113"] == []

    (elsewhere / "other").mkdir()
    graph, _ = load_graph(GRAPHS / "grpo.yaml", ["plugins=[other/missing.py]"])
    assert graph is not None
    [missing] = [d for d in check_graph(graph).diagnostics if d.code == "FG113"]
    assert f"looked in {elsewhere}" in missing.message
