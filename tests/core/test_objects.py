"""Python objects in a graph (`flowgraph.objects`): held by reference in params, written
as `{"$python": ref}` in a graph document, listed in the plan's table, pickled only on a
run's own channel, refused where they cannot be rebuilt; and the folder a notebook's or
stdin's plugin files are relative to."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph import GraphBuilder
from flowgraph.errors import IRError, PlanError, PlanFileError, UsageError
from flowgraph.frontend import graph_from_yaml, graph_to_yaml
from flowgraph.ir import Params, from_python
from flowgraph.objects import PyObject, rebuilt
from flowgraph.passes.program import plan_objects
from flowgraph.paths import folder_of, interactive
from flowgraph.plan import plan_from_json, plan_summary, plan_to_json
from flowgraph.source import SourcePos


def length_penalty(completions: list[str], **kwargs: Any) -> list[float]:
    """A module-level reward function: importable by reference."""
    return [-len(c) / 10 for c in completions]


class Judge:
    """A class, as an env or a tool class would be passed."""


def _grpo(fn: object) -> flowgraph.Graph:
    """GRPO whose reward is `compute_score` naming `fn` (checked, compiled, not run)."""
    g = GraphBuilder("objects")
    g.dims(Bp=2, N=2, P=16, T=8)
    g.model("actor", "builtin:tiny-lm", trainable=True)
    data = g.data("train", "prompts", "builtin:arith")
    gen = g.node("gen", "generate", model="actor", prompts=data.input_ids,
                 prompt_mask=data.attention_mask, row=data.row)
    seq = {"prompts": gen.prompts, "prompt_mask": gen.prompt_mask,
           "responses": gen.responses, "response_mask": gen.response_mask}
    old = g.node("old", "logprob", model="actor", **seq)
    reward = g.node("reward", "compute_score", model="actor", params={"fn": fn},
                    responses=gen.responses, response_mask=gen.response_mask,
                    row=gen.row)
    adv = g.node("adv", "grpo", scores=reward.scores, index=gen.index,
                 response_mask=gen.response_mask)
    g.node("update", "ppo_actor_update", model="actor", old_log_prob=old.log_prob,
           advantages=adv.advantages, **seq)
    return g.build()


def test_functions_and_classes_are_held_by_reference_anywhere_in_params() -> None:
    params = Params.of({"fn": length_penalty, "tools": [Judge, {"cls": Judge}], "lr": 0.1})
    fn = params.get("fn")
    assert isinstance(fn, PyObject) and fn.obj is length_penalty and fn.what == "function"
    assert fn.ref == f"{__name__}:length_penalty" and not fn.by_value
    assert fn.where.endswith(f"test_objects.py:{length_penalty.__code__.co_firstlineno}")
    assert params.to_python() == {"fn": {"$python": f"{__name__}:length_penalty"},
                                  "tools": [{"$python": f"{__name__}:Judge"},
                                            {"cls": {"$python": f"{__name__}:Judge"}}],
                                  "lr": 0.1}


def test_a_value_that_is_neither_data_nor_code_says_what_is_accepted() -> None:
    with pytest.raises(IRError, match=r"parameter value <object object at .*> of type object "
                                      r"is neither plain data \(a number, string, list or "
                                      r"mapping\) nor a function or class"):
        from_python(object())


def test_the_graph_document_writes_a_reference_and_reads_the_object_back() -> None:
    graph = _grpo(length_penalty)
    text = graph_to_yaml(graph)
    assert f"fn: {{$python: '{__name__}:length_penalty'}}" in text
    again = graph_from_yaml(text)
    assert again == graph
    fn = again.node("reward").params.get("fn")  # type: ignore[union-attr]
    assert isinstance(fn, PyObject) and fn.obj is length_penalty


def test_a_main_reference_is_rebuilt_only_as_the_object_it_names() -> None:
    """A `__main__` reference resolves in the user's session only: never another object
    of that name (flowgraph's own command line, a function defined elsewhere)."""
    assert rebuilt("__main__:no_such_function").obj is None
    assert rebuilt("os:no_such_function").obj is None
    assert rebuilt("no_such_module_xyz:f").obj is None
    assert rebuilt("os.path:join").obj is os.path.join  # an import path, alias or not
    assert rebuilt("posixpath:join").obj is os.path.join
    assert rebuilt(f"{__name__}:_grpo.<locals>.f").obj is None


def test_the_plan_lists_local_objects_ships_them_pickled_and_its_file_refuses_them(
        tmp_path: Path) -> None:
    def verl_score(data_source: Any, solution_str: str, ground_truth: str,
                   extra_info: Any = None) -> float:
        return float(solution_str.strip() == ground_truth)

    plan = flowgraph.compile(_grpo(verl_score))
    ref = f"{__name__}:test_the_plan_lists_local_objects_ships_them_pickled_and_its_file_" \
          "refuses_them.<locals>.verl_score"
    (held,) = plan.objects
    assert (held.ref, held.obj, held.by_value) == (ref, verl_score, True)
    assert plan.live_params("reward")["fn"] is verl_score
    summary = plan_summary(plan)
    assert f"python objects:\n  {ref}  function, defined at {held.where}: node `reward` " \
           "param `fn`; shipped by value (cloudpickle)" in summary
    text = plan_to_json(plan)
    data = json.loads(text)
    assert data["objects"] == [{"ref": ref, "what": "function", "defined_at": held.where,
                                "shipped": "by value"}]
    assert "verl_score" not in text.replace(ref, "")  # references only, no code
    read = plan_from_json(text)
    assert read == plan and read.objects[0].obj is None
    with pytest.raises(PlanError, match=r"cannot rebuild the Python function .*verl_score` "
                                        r"\(node `reward` param `fn`"):
        read.live_params("reward")
    # the run's own channel: the plan's JSON and its objects, pickled
    shipped = read.with_pickled(plan.pickled_objects())
    fn = shipped.live_params("reward")["fn"]
    assert fn(None, " 4", "4") == 1.0 and fn(None, "5", "4") == 0.0
    file = tmp_path / "plan.json"
    file.write_text(text)
    with pytest.raises(PlanFileError) as err:
        flowgraph.load_plan(file)
    assert str(err.value) == (
        f"`{file}`: cannot rebuild the Python function `{ref}` (node `reward` param `fn`, "
        f"defined at {held.where}): defined in the Python session that compiled the plan; a "
        "plan file records only its reference. Run the plan from the Python session that "
        "defines it (`flowgraph.run(graph)` or `flowgraph.run(plan)` there), or move it into "
        "a module the graph lists under `plugins:`")


def test_an_importable_function_survives_the_plan_file() -> None:
    plan = flowgraph.compile(_grpo(length_penalty))
    (held,) = plan.objects
    assert held.shipped == "by reference"
    read = plan_from_json(plan_to_json(plan))
    assert read.unresolved() is None
    assert read.live_params("reward")["fn"] is length_penalty


def test_two_objects_of_one_name_are_refused() -> None:
    first = eval("lambda rows: rows")  # two lambdas: both `<lambda>`
    second = eval("lambda rows: rows")
    g = GraphBuilder("twice")
    g.node("a", "compute_score", params={"fn": first, "fns": {"x": second}})
    with pytest.raises(PlanError, match=r"two different Python objects are both "
                                        r"`.*:<lambda>`.*give each its own name"):
        plan_objects(g.build(), {})


def test_run_called_by_a_worker_importing_the_script_says_to_guard_it() -> None:
    with pytest.raises(UsageError, match=r'under `if __name__ == "__main__":`'):
        exec("import flowgraph; flowgraph.run('g.yaml')", {"__name__": "__mp_main__"})


@pytest.mark.parametrize(("file", "typed"), [
    ("<stdin>", True), ("<string>", True), ("<ipython-input-3-5f1b2c>", True),
    ("/tmp/ipykernel_4242/1234567.py", True), ("/home/me/train.py", False),
    ("/tmp/ipykernel_x/notes.py", False),
])
def test_code_typed_in_a_session_is_told_apart_from_a_file(file: str, typed: bool) -> None:
    assert interactive(file) == typed


def test_a_notebook_cell_file_that_exists_is_relative_to_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ipykernel writes a cell to its temp folder when a debugger asks; its plugin files
    are still the notebook's, in the working directory."""
    cell = tmp_path / "ipykernel_4242" / "1234567.py"
    cell.parent.mkdir()
    cell.write_text("g.plugin('rewards.py')\n")
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert folder_of(SourcePos(str(cell), 1, 1)) == tmp_path / "notebooks"
    assert folder_of(SourcePos(str(script), 1, 1)) == tmp_path


def test_a_reference_that_imports_nothing_is_found_before_launch(tmp_path: Path) -> None:
    """In a graph document: FG113 at its line; in a plan file (a module without the name):
    refused with the reference; an unloaded plan given to `run`: refused before it starts."""
    text = graph_to_yaml(_grpo(length_penalty)).replace(
        f"{__name__}:length_penalty", f"{__name__}:gone")
    (tmp_path / "g.yaml").write_text(text)
    result = flowgraph.check_graph(flowgraph.load_graph(str(tmp_path / "g.yaml"))[0])
    (found,) = [d for d in result.errors if d.code == "FG113"]
    assert found.message == (f"parameter `fn` of `reward` names the Python function "
                             f"`{__name__}:gone`, which cannot be imported here")
    assert found.pos.line == next(i for i, line in enumerate(text.splitlines(), 1)
                                  if "$python" in line)
    plan_text = plan_to_json(flowgraph.compile(_grpo(length_penalty))).replace(
        f"{__name__}:length_penalty", f"{__name__}:gone")
    (tmp_path / "plan.json").write_text(plan_text)
    with pytest.raises(PlanFileError, match=rf"cannot rebuild the Python function "
                                            rf"`{__name__}:gone` \(node `reward` param `fn`.*"
                                            rf"module `{__name__}` cannot be imported here or "
                                            r"has no `gone`"):
        flowgraph.load_plan(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="cannot rebuild the Python function"):
        flowgraph.run(plan_from_json(plan_text))
