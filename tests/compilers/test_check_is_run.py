"""Check is run: what `flowgraph check` accepts, `flowgraph run` runs, from any folder.

Everything a run opens — a plugin file in a subfolder of the graph's, a verl tool config
named by `env:`, the tool classes it names (no `plugins:` entry: the README's example),
a plugin given on the command line — is resolved once, when the graph is compiled, by the
rule `check` finds it by, and the plan carries the absolute result. The default suite
checks and runs one such project (2 steps) from another folder with the CLI and once
from Python; `-m slow` checks and runs every graph under graphs/ both ways.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import flowgraph
from flowgraph.cli import main
from flowgraph.compilers import read_metrics
from flowgraph.compilers.build import import_plugins
from flowgraph.diagnostics import render_github

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SHAPING = '''
from jaxtyping import Float
from torch import Tensor

from flowgraph import node_kind


@node_kind("bonus_in_a_subfolder", outputs=["scores"], category="transform")
def bonus(scores: Float[Tensor, " b"], add: float = 0.5) -> Float[Tensor, " b"]:
    """The scores plus a constant (a plugin kept in a subfolder of the graph's)."""
    return scores + add
'''
MY_TOOLS = '''
from typing import Any
from uuid import uuid4


class Gsm8kTool:  # verl's BaseTool shape, without verl
    def __init__(self, config: dict, tool_schema: Any):
        self.config, self.tool_schema = config, tool_schema

    async def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid4()), None

    async def execute(self, instance_id, parameters, **kwargs):
        return f"checked {parameters.get('answer')}", 0.0, {}

    async def release(self, instance_id, **kwargs):
        pass
'''
GRAPH = """version: 1
name: check_is_run
dims: {Bp: 2, N: 2, P: 8, T: 24}
plugins: [plug/shaping.py]
models:
  actor: {path: "builtin:tiny-lm-sft", trainable: true, optimizer: {lr: 1.0e-4}}
data:
  train: {kind: prompts, path: "builtin:mul"}
nodes:
  agent:
    kind: agent_rollout
    model: actor
    inputs: {row: train.row}
    params: {env: tools.yaml, max_turns: 2, max_turn_tokens: 8, max_tool_tokens: 8,
             show_tools: none}
  bonus:
    kind: bonus_in_a_subfolder
    inputs: {scores: agent.scores}
  adv:
    kind: grpo
    inputs: {scores: bonus.scores, response_mask: agent.response_mask, index: agent.index}
  update:
    kind: ppo_actor_update
    model: actor
    inputs: {prompts: agent.prompts, prompt_mask: agent.prompt_mask,
             responses: agent.responses, response_mask: agent.response_mask,
             advantages: adv.advantages}
    params: {mini_batch_size: 4}
trainer: {steps: 2, seed: 0, run_dir: runs/check_is_run, val_before_train: false}
"""


def readme_block(starts: str) -> str:
    """The README's fenced block whose first line starts with `starts`."""
    found = re.search(r"```\w*\n(" + re.escape(starts) + r".*?)```", README, re.DOTALL)
    assert found, f"the README has no block starting {starts!r}"
    return found.group(1)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's folder: the graph, `plug/shaping.py`, the README's verl `tools.yaml` and
    the `my_tools.py` its `class_name` names, beside it (no `plugins:` entry for it)."""
    folder = tmp_path_factory.mktemp("project")
    (folder / "plug").mkdir()
    (folder / "plug" / "shaping.py").write_text(SHAPING)
    (folder / "tools.yaml").write_text(readme_block("# tools.yaml, verl's format as it is"))
    (folder / "my_tools.py").write_text(MY_TOOLS)
    (folder / "g.yaml").write_text(GRAPH)
    return folder


def _flowgraph(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "flowgraph", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_check_then_run_from_another_folder(project: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: check passed, then the run stopped (`plugin file plug/shaping.py not found;
    looked in …/plug`; the tool config opened from the working directory: EnvError
    [Errno 2] at step 0; `No module named 'my_tools'`). The run is a process of its own,
    as a user's is (nothing imported by the check)."""
    monkeypatch.chdir(tmp_path)
    assert main(["check", str(project / "g.yaml")]) == 0
    ran = _flowgraph(tmp_path, "run", str(project / "g.yaml"),
                     f"trainer.run_dir={tmp_path / 'run'}")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]


def test_check_then_run_from_python_in_another_folder(
        project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = flowgraph.check(project / "g.yaml")
    assert result.ok, str(result)
    run = flowgraph.run(project / "g.yaml", run_dir=tmp_path / "run")
    assert [r["step"] for r in run.rows] == [0, 1]


def test_the_plan_carries_what_check_resolved(project: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan holds the plugin file and the tool config by their absolute paths; a
    process started elsewhere imports the plugin from there (as every run's worker does)."""
    monkeypatch.chdir(tmp_path)
    plan = flowgraph.compile(project / "g.yaml")
    assert [p.module for p in plan.plugins] == [str(project / "plug" / "shaping.py")]
    assert plan.live_params("agent")["env"] == str(project / "tools.yaml")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    import_plugins(plan)  # before: PluginError, looked in …/plug/plug


def test_a_plugin_given_on_the_command_line_is_relative_to_the_working_directory(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """9.2: `plugins=[plug/shaping.py]` typed in the project's parent folder: check,
    compile and the run's import find the same file (before: the run looked in
    …/plug/plug)."""
    monkeypatch.chdir(project.parent)
    overrides = [f"plugins=[{project.name}/plug/shaping.py]"]
    text = (project / "g.yaml").read_text().replace("plugins: [plug/shaping.py]\n", "")
    (project / "unlisted.yaml").write_text(text)
    assert flowgraph.check(project / "unlisted.yaml", overrides=overrides).ok
    plan = flowgraph.compile(project / "unlisted.yaml", overrides=overrides)
    assert [p.module for p in plan.plugins] == [str(project / "plug" / "shaping.py")]
    monkeypatch.chdir(project / "plug")
    import_plugins(plan)


def test_an_env_file_override_is_relative_to_the_working_directory(
        project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    override = ["nodes.agent.params.env=tools.yaml"]
    (error,) = flowgraph.check(project / "g.yaml", overrides=override).errors
    assert error.code == "FG605" and f"which is not there ({tmp_path / 'tools.yaml'})" in \
        error.message
    monkeypatch.chdir(project)
    plan = flowgraph.compile(project / "g.yaml", overrides=override)
    assert plan.live_params("agent")["env"] == str(project / "tools.yaml")


def test_a_tool_class_that_cannot_be_imported_is_fg605_at_its_config_line(
        project: Path, tmp_path: Path) -> None:
    """Before: check passed and the run failed at step 0 with `No module named …`."""
    (tmp_path / "g.yaml").write_text(GRAPH.replace("plugins: [plug/shaping.py]\n", "")
                                     .replace("bonus.scores", "agent.scores"))
    (tmp_path / "tools.yaml").write_text((project / "tools.yaml").read_text()
                                         .replace("my_tools.Gsm8kTool", "my_tools.Gsm8kTol"))
    (tmp_path / "my_tools.py").write_text(MY_TOOLS)
    errors = [d for d in flowgraph.check(tmp_path / "g.yaml").errors if d.code != "FG102"]
    (error,) = errors
    assert error.code == "FG605"
    assert (error.pos.file, error.pos.line, error.pos.col) == (str(tmp_path / "tools.yaml"),
                                                              3, 17)
    assert "`my_tools.Gsm8kTol` cannot be imported: AttributeError" in error.message
    assert f"{tmp_path / 'g.yaml'}:13:" in error.message  # the graph's `env:` line


def test_a_plugin_syntax_error_is_annotated_at_the_plugins_own_line(tmp_path: Path) -> None:
    """9.6: under --format github the annotation was the graph's `plugins:` line."""
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "shaping.py").write_text("x = 1\ndef f(:\n    pass\n")
    (tmp_path / "g.yaml").write_text(GRAPH)
    diags = [d for d in flowgraph.check(tmp_path / "g.yaml").errors if d.code == "FG113"]
    annotation = render_github(diags)
    assert annotation.startswith(
        f"::error file={tmp_path / 'plug' / 'shaping.py'},line=2,col=7,title=FG113"), annotation
    assert f"note: listed under plugins: at {tmp_path / 'g.yaml'}:4:11" in annotation


def test_the_readme_sandbox_snippet_checks(tmp_path: Path) -> None:
    """It failed with FG605 (`flowgraph.agent.sandbox` not listed under plugins:) and
    set `tools` beside the node's params."""
    snippet = yaml.safe_load(readme_block("rollout:\n  kind: agent_rollout"))["rollout"]
    graph = yaml.safe_load(GRAPH)
    del graph["plugins"]
    graph["nodes"]["adv"]["inputs"]["scores"] = "agent.scores"
    del graph["nodes"]["bonus"]
    agent = graph["nodes"]["agent"]
    agent["params"] = {**snippet["params"], "max_turns": 2, "max_turn_tokens": 8,
                       "max_tool_tokens": 8, "show_tools": "none"}
    assert agent["kind"] == snippet["kind"]
    (tmp_path / "g.yaml").write_text(json.dumps(graph))
    result = flowgraph.check(tmp_path / "g.yaml")
    assert result.ok, str(result)


def test_the_readme_node_added_by_an_override_is_checked_and_compiled() -> None:
    """9.8: the README's `nodes.lp={...}` example adds a node that runs between the reward
    and the advantage; a misspelt port in it is the checker's FG106."""
    line = next(ln for ln in README.splitlines() if ln.startswith("flowgraph check graphs/"
                                                                  "grpo.yaml 'nodes.lp="))
    words = [w.strip("'") for w in re.findall(r"'[^']*'|\S+", line)]
    assert words[:3] == ["flowgraph", "check", "graphs/grpo.yaml"]
    plan = flowgraph.compile(ROOT / words[2], overrides=words[3:])
    lp = plan.node("lp")
    assert lp.kind == "length_penalty"
    assert [i.src for i in plan.node("adv").inputs if i.port == "scores"] == ["lp.scores"]
    wrong = [w.replace("gen.response_mask", "gen.respons_mask") for w in words[3:]]
    codes = [d.code for d in flowgraph.check(ROOT / words[2], overrides=wrong).errors]
    assert codes == ["FG106"]


# --- every graph under graphs/, both ways (-m slow) ------------------------------------

GRAPHS = sorted(p for p in (ROOT / "graphs").glob("**/*.yaml") if "broken" not in p.parts)
SMALL = ["trainer.steps=2", "trainer.val_before_train=false", "trainer.eval_every=0",
         "trainer.checkpoint_every=0"]


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["cli", "python"])
@pytest.mark.parametrize("graph", GRAPHS, ids=lambda p: str(p.relative_to(ROOT / "graphs")))
def test_every_graph_checks_then_runs_from_another_folder(
        graph: Path, launch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `check` accepts, `run` runs: no run-time error `check` could have reported."""
    overrides = [*SMALL, f"trainer.run_dir={tmp_path / 'run'}"]
    if launch == "cli":
        check = _flowgraph(tmp_path, "check", str(graph), *SMALL)
        assert check.returncode == 0, check.stdout + check.stderr
        ran = _flowgraph(tmp_path, "run", str(graph), *overrides)
        assert ran.returncode == 0, ran.stderr[-3000:]
    else:
        monkeypatch.chdir(tmp_path)
        assert flowgraph.check(graph, overrides=SMALL).ok
        flowgraph.run(graph, overrides=overrides)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]


# --- issue 40, 6: a reward function's missing column, before the models load -------------


@pytest.fixture
def missing_column(tmp_path: Path) -> Path:
    """graphs/trl_format with `correct` reading `answer`, which train.jsonl lacks."""
    for name in ("grpo.yaml", "rewards.py", "train.jsonl"):
        (tmp_path / name).write_text((ROOT / "graphs" / "trl_format" / name).read_text())
    rewards = tmp_path / "rewards.py"
    text = rewards.read_text()
    assert "def correct(completions, solution, **kwargs):" in text
    rewards.write_text(text.replace("def correct(completions, solution, **kwargs):",
                                    "def correct(completions, answer, **kwargs):\n"
                                    "    solution = answer"))
    return tmp_path / "grpo.yaml"


def test_flowgraph_run_refuses_a_missing_column_before_the_models_load(
        missing_column: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the run loaded the models and failed at the first batch (a TypeError)."""
    import flowgraph.compilers

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run started")

    monkeypatch.setattr(flowgraph.compilers, "run", never)
    with pytest.raises(flowgraph.CompileError) as raised:
        flowgraph.run(missing_column, overrides=["trainer.steps=1"])
    (error,) = raised.value.diagnostics
    assert error.code == "FG512" and "needs `answer`" in error.message
    assert (error.pos.file, error.pos.line) == (str(missing_column.parent / "rewards.py"), 15)


def test_the_cli_run_refuses_a_missing_column_before_the_models_load(
        missing_column: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(missing_column), "trainer.steps=1",
                 f"trainer.run_dir={tmp_path / 'run'}"]) == 1
    assert "error[FG512]: reward fn `rewards.py:correct` of `reward` needs `answer`" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()
