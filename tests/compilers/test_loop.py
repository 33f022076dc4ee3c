"""The training loop (compilers/loop.py): steps, strict checks on the first step, a
non-finite batch stopped or skipped, the evaluation and checkpoint cadences, resume.

Most runs are of tests/plugins/faults.yaml (one plugin node, no model to train), so
that each takes a fraction of a second once the first has loaded the tokenizer; resume's
numbers are DPO's.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.compilers.checkpoint.resume import fresher_rollouts
from flowgraph.compilers.interpreter import Interpreter
from flowgraph.compilers.loop import TrainingLoop
from flowgraph.errors import NonFiniteError
from flowgraph.passes import compile_graph
from flowgraph.plan import plan_from_json
from flowgraph.testing.targets import numbers

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
FAULTS = (PLUGINS / "faults.yaml").read_text()  # one node of the fault plugin


@pytest.fixture(autouse=True)
def _plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def _run(graph: str | Path, tmp_path: Path, *overrides: str, text: str | None = None,
         resume: bool = False, out: Any = None) -> list[dict[str, float]]:
    """`graph` (or `text`, written to tmp_path/g.yaml) run locally into tmp_path/run."""
    file = tmp_path / "g.yaml"
    if text is not None:
        file.write_text(text)
    result = compile_graph(file if text is not None else graph,
                           overrides=[f"trainer.run_dir={tmp_path / 'run'}", *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    with open(os.devnull, "w") as devnull:
        return run(result.plan, RunOptions(resume=resume, tensorboard=False,
                                           out=out or devnull)).rows


def _numbers(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [numbers(r) for r in rows]


def _spy(monkeypatch: pytest.MonkeyPatch, cls: type, method: str,
         record: Any) -> list[Any]:
    """Calls of `cls.method` recorded (`record(*args, **kw)` each), then run as before."""
    seen: list[Any] = []
    real = getattr(cls, method)

    def spy(*args: Any, **kw: Any) -> Any:
        seen.append(record(*args, **kw))
        return real(*args, **kw)

    monkeypatch.setattr(cls, method, spy)
    return seen


def test_each_step_is_one_row_numbered_from_zero_with_its_timing(tmp_path: Path) -> None:
    rows = _run(tmp_path, tmp_path, "trainer.steps=3", text=FAULTS)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows == read_metrics(tmp_path / "run")  # what it returns is what it logged
    for row in rows:
        assert row["timing_s/step"] >= row["timing_s/score"] >= 0.0
    # the data cursor: Bp = 4 prompts a step
    assert [r["data/train/position"] for r in rows] == [4.0, 8.0, 12.0]
    plan = plan_from_json((tmp_path / "run" / "plan.json").read_text())
    assert (plan.name, plan.trainer.steps) == ("faults", 3)  # the plan the run dir ran


@pytest.mark.parametrize(("strict", "checked"), [
    ((), [True, False, False]),  # the first step only
    (("trainer.strict=true",), [True, True, True]),
])
def test_contracts_are_checked_on_the_first_step_or_on_every_step_when_strict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strict: tuple[str, ...],
        checked: list[bool]) -> None:
    seen = _spy(monkeypatch, Interpreter, "run_node",
                lambda self, name, env, step, **kw: kw["strict"])
    _run(tmp_path, tmp_path, "trainer.steps=3", *strict, text=FAULTS)
    assert seen == checked


def test_nan_stops_the_run_naming_node_and_step(tmp_path: Path) -> None:
    message = "non-finite output `scores` in node `score` at step 1"
    with pytest.raises(NonFiniteError, match=message):
        _run(tmp_path, tmp_path, "trainer.steps=3", "nodes.score.params.nan_at=1", text=FAULTS)
    # the step before the fault was logged; nothing after it
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0]


def test_nan_batch_is_skipped_when_asked(tmp_path: Path) -> None:
    rows = _run(tmp_path, tmp_path, "trainer.steps=3", "nodes.score.params.nan_at=1",
                "trainer.on_nonfinite=skip", text=FAULTS)
    assert [r.get("skipped", 0.0) for r in rows] == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(("overrides", "evaluated"), [
    (("trainer.eval_every=2",), [1, 3]),  # after steps 2 and 4 (1-based)
    (("trainer.eval_every=2", "trainer.val_before_train=true"), [0, 1, 3]),  # 0: before it
    # eval_every 1 with val_before_train: one evaluation a step, no second one before
    # step 0 (TrainingLoop.train_step)
    (("trainer.eval_every=1", "trainer.val_before_train=true"), [0, 1, 2, 3, 4]),
    (("trainer.eval_every=0", "trainer.val_before_train=true"), [0]),
    (("trainer.eval_every=0",), []),
])
def test_evaluation_is_due_every_eval_every_steps_and_before_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...],
        evaluated: list[int]) -> None:
    seen = _spy(monkeypatch, TrainingLoop, "evaluate", lambda self, step: step)
    _run(tmp_path, tmp_path, "trainer.steps=5", "trainer.val_before_train=false", *overrides,
         text=FAULTS)
    assert seen == evaluated


@pytest.mark.parametrize(("every", "saved"), [
    (2, ["step_1", "step_3", "step_4"]),  # every 2nd step, and the last
    (3, ["step_2", "step_4"]),
    (0, ["step_4"]),  # the last step only
])
def test_a_checkpoint_is_due_every_checkpoint_every_steps_and_after_the_last(
        tmp_path: Path, every: int, saved: list[str]) -> None:
    _run(tmp_path, tmp_path, "trainer.steps=5", f"trainer.checkpoint_every={every}",
         "trainer.max_checkpoints=5", text=FAULTS)
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == saved
    state = json.loads((folder / saved[0] / "state.json").read_text())
    step = int(saved[0].removeprefix("step_"))
    assert (state["step"], state["plan"]) == (step, "faults")
    # the cursor after the step: Bp = 4 prompts each
    assert state["cursors"]["train"]["position"] == 4 * (step + 1)


def test_resume_goes_on_after_the_newest_checkpoint_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path, tmp_path, "trainer.steps=2", text=FAULTS)
    out = io.StringIO()
    ran = _spy(monkeypatch, Interpreter, "run_node", lambda self, name, env, step, **kw: step)
    rows = _run(tmp_path, tmp_path, "trainer.steps=4", text=FAULTS, resume=True, out=out)
    assert ran == [2, 3]  # the steps the checkpoint did not hold
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the run's rows, each once
    folder = tmp_path / "run" / "checkpoints" / "step_1"
    assert (f"resuming from checkpoint `{folder}` (after step 1): the next step is 2"
            in out.getvalue())
    assert rows[2]["data/train/position"] == 12.0  # the cursor went on from 8


@pytest.mark.parametrize(("steps", "told"), [
    (2, "nothing to train: the run finished at step 1; give trainer.steps above 2 to train on"),
    (1, "nothing to train: the run finished at step 1, past trainer.steps = 1; give "
        "trainer.steps above 2 to train on"),
])
def test_resuming_a_finished_run_says_there_is_nothing_to_train(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int, told: str) -> None:
    _run(tmp_path, tmp_path, "trainer.steps=2", text=FAULTS)
    out = io.StringIO()
    ran = _spy(monkeypatch, Interpreter, "run_node", lambda self, name, env, step, **kw: step)
    rows = _run(tmp_path, tmp_path, f"trainer.steps={steps}", text=FAULTS, resume=True,
                out=out)
    assert ran == []
    assert [r["step"] for r in rows] == [0, 1]  # the run's rows, as they were
    folder = tmp_path / "run" / "checkpoints" / "step_1"
    assert f"resuming from checkpoint `{folder}` (after step 1): {told}" in out.getvalue()


@pytest.mark.parametrize(("step", "steps", "staleness", "buffered", "told"), [
    (3, 4, 1, 0, None),  # the run's last checkpoint: nothing ahead to hold
    (3, 6, 1, 1, None),  # a checkpoint of the 6-step run holds step 4's rollout
    (3, 6, 1, 0, "so step 4's rollout is generated now by the policy of step 4, where that "
                 "run generates step j's by the policy of step j − 1"),
    (3, 9, 2, 0, "so the rollouts of steps 4…5 are generated now by the policy of step 4"),
    (3, 9, 2, 1, "so step 5's rollout is generated now by the policy of step 4"),
])
def test_extending_a_finished_asynchronous_run_says_which_steps_are_fresher(
        step: int, steps: int, staleness: int, buffered: int, told: str | None) -> None:
    """`steps=4`, then `--resume trainer.steps=6`: the last checkpoint holds no rollout
    ahead, and step 4's is generated by the policy of step 4 where a 6-step run's is
    step 3's; the resumed run says so."""
    note = fresher_rollouts(step, steps, staleness, buffered)
    if told is None:
        assert note is None
        return
    assert note is not None and told in note, note
    assert note.endswith(f"from step {step + 1 + buffered} on, the numbers are not those "
                         f"of a run of {steps} steps from the start")


def test_resume_without_a_checkpoint_starts_at_step_zero(tmp_path: Path) -> None:
    out = io.StringIO()
    rows = _run(tmp_path, tmp_path, "trainer.steps=2", text=FAULTS, resume=True, out=out)
    assert [r["step"] for r in rows] == [0, 1]
    assert (f"resuming: `{tmp_path / 'run'}` holds no checkpoint yet; from step 0"
            in out.getvalue())


def test_resumed_run_reproduces_the_uninterrupted_one(tmp_path: Path) -> None:
    full = _run(ROOT / "graphs" / "dpo.yaml", tmp_path / "a", "trainer.steps=4",
                "trainer.checkpoint_every=2")
    _run(ROOT / "graphs" / "dpo.yaml", tmp_path / "b", "trainer.steps=2",
         "trainer.checkpoint_every=2")
    later = _run(ROOT / "graphs" / "dpo.yaml", tmp_path / "b", "trainer.steps=4",
                 "trainer.checkpoint_every=2", resume=True)
    # the resumed run's metrics.jsonl: steps 0-1 from before, 2-3 from now, each once
    assert [r["step"] for r in later] == [0, 1, 2, 3]
    assert _numbers(later) == _numbers(full)
