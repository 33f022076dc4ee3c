"""A plugin cannot hurt a run silently (issue #25, point 6): an exit or an interrupt
raised in a node, a node that hangs past its `timeout_s` (or, on the local target,
`trainer.step_timeout_s`), and a node writing into its input tensors in place are each
one error naming the node, the step and the plugin's line."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.errors import NodeError
from flowgraph.passes import compile_graph

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
PLUGIN = PLUGINS / "fg_plugin_faults.py"
GRAPH = (PLUGINS / "faults.yaml").read_text().replace("fg_runtime_faults", "fg_plugin_faults")

pytestmark = pytest.mark.faults


@pytest.fixture(autouse=True)
def _plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def _run(tmp_path: Path, kind: str, *overrides: str, graph: str = GRAPH) -> None:
    file = tmp_path / "g.yaml"
    file.write_text(graph.replace("kind: prompt_score", f"kind: {kind}"))
    result = compile_graph(file, overrides=[f"trainer.run_dir={tmp_path / 'run'}",
                                            "trainer.steps=3", *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    with open(os.devnull, "w") as out:
        run(result.plan, RunOptions(tensorboard=False, out=out))


def _line(marker: str) -> int:
    return next(i for i, t in enumerate(PLUGIN.read_text().splitlines(), 1) if marker in t)


@pytest.mark.parametrize(("how", "raised", "marker"), [
    ("exit", "SystemExit(3)", "the plugin's exit"),
    ("interrupt", "KeyboardInterrupt()", "the plugin's interrupt")])
def test_an_exit_or_interrupt_in_a_plugin_is_the_nodes_error(
        tmp_path: Path, how: str, raised: str, marker: str) -> None:
    with pytest.raises(NodeError) as exc:
        _run(tmp_path, "exiting_score", f"nodes.score.params.how={how}",
             "nodes.score.params.at=1")
    head = str(exc.value).splitlines()[:2]
    assert head[0].startswith("while executing node `score` (kind exiting_score, "), head
    assert f" at step 1: {raised} raised by the node's code; a node may not end" in head[0]
    assert head[1].startswith(f"  at {PLUGIN}:{_line(marker)} in exiting_score"), head
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0]


@pytest.mark.parametrize("setting", ["nodes.score.params.timeout_s", "trainer.step_timeout_s"])
def test_a_node_past_its_timeout_stops_the_run_naming_node_and_line(
        tmp_path: Path, setting: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(NodeError) as exc:
        _run(tmp_path, "sleepy_score", "nodes.score.params.at=1", f"{setting}=0.5")
    assert time.monotonic() - t0 < 30  # not the 60 s the plugin sleeps
    head = str(exc.value).splitlines()[:2]
    assert head[0].startswith("while executing node `score` (kind sleepy_score, "), head
    assert head[0].endswith(f" at step 1: NodeTimeout: the node ran past {setting} = 0.5 s "
                            "and was stopped here"), head
    line = _line("the plugin's hang")
    assert head[1].startswith(f"  at {PLUGIN}:{line} in sleepy_score"), head


def test_timeout_s_is_a_param_of_every_kind_the_checker_bounds(tmp_path: Path) -> None:
    file = tmp_path / "g.yaml"
    file.write_text(GRAPH.replace("kind: prompt_score",
                                  "kind: prompt_score\n    params: {timeout_s: -1}"))
    result = compile_graph(file, overrides=[f"trainer.run_dir={tmp_path / 'run'}"])
    assert result.plan is None
    assert any("timeout_s" in d.one_line() for d in result.diagnostics)


def test_a_node_writing_into_its_input_in_place_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NodeError) as exc:
        _run(tmp_path, "mask_writer", "nodes.score.params.at=1")
    message = str(exc.value)
    assert message.startswith("while executing node `score` (kind mask_writer, ")
    assert " at step 1: it wrote into its input(s) `input_ids` in place" in message


def test_a_node_writing_into_an_object_input_is_an_error_at_its_line(tmp_path: Path) -> None:
    """A row's `extra_info` (a dict) is shared with every node that reads it, as a tensor
    is: a write into it is refused where it is made, naming the node and the line."""
    graph = GRAPH.replace("inputs: {input_ids: train.input_ids}",
                          "inputs: {input_ids: train.input_ids, extra_info: train.extra_info}")
    with pytest.raises(NodeError) as exc:
        _run(tmp_path, "info_writer", "nodes.score.params.at=1", graph=graph)
    head = str(exc.value).splitlines()[:2]
    assert head[0].startswith("while executing node `score` (kind info_writer, "), head
    assert " at step 1: InputWritten: a node's inputs are read-only, and this dict " \
        "(setting `hacked`) is one" in head[0], head
    assert "copy it first (`copy.deepcopy(x)`" in head[0], head
    marker = "the plugin's in-place write into an object input"
    assert head[1].startswith(f"  at {PLUGIN}:{_line(marker)} in info_writer"), head
