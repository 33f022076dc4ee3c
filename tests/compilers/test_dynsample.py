"""DAPO's dynamic sampling (#13.4): graphs/dapo.yaml's filter and the plan's refill loop.

The local run shows the loop's bookkeeping; fsdp(2) and ray(2) give its numbers (a few
steps, the tiny model); a run resumed from a checkpoint after a filtering step goes on
from the right data position; too few kept groups stop the run with one message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph.api import load_plan
from flowgraph.compilers import read_metrics
from flowgraph.errors import FlowgraphError
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan, plan_from_json, plan_to_json
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
DAPO = ROOT / "graphs" / "dapo.yaml"
SHORT = ("trainer.steps=3", "trainer.checkpoint_every=1")
BP, N = 4, 4


def _plan(run_dir: Path, *overrides: str, target: str = "local") -> ExecutionPlan:
    """Compiled, written to a plan file and read back (`flowgraph run plan.json`)."""
    result = compile_graph(DAPO, target=target, nproc=None if target == "local" else 2,
                           overrides=[f"trainer.run_dir={run_dir}", *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    file = run_dir.parent / f"{run_dir.name}.plan.json"
    file.write_text(plan_to_json(result.plan))
    return load_plan(file)


def _run(run_dir: Path, *overrides: str, target: str = "local", resume: bool = False
         ) -> list[dict[str, Any]]:
    """Its rows; a ray plan starts its own Ray instance and shuts it down after."""
    with open(os.devnull, "w") as out:
        return flowgraph.run(_plan(run_dir, *overrides, target=target), resume=resume,
                             tensorboard=False, out=out).rows


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The local run's rows, 3 steps, a checkpoint after each."""
    return _run(tmp_path_factory.mktemp("dapo") / "local", *SHORT)


def test_the_plan_holds_the_loop(tmp_path: Path) -> None:
    loop = _plan(tmp_path / "p").resample
    assert loop is not None
    assert (loop.filter, loop.repeat) == ("keep", ("train", "gen", "reward", "overlong", "keep"))
    assert (loop.groups, loop.group_size, loop.rows, loop.max_tries) == (BP, N, BP * N, 30)


def test_each_step_trains_on_bp_kept_groups(local: list[dict[str, Any]]) -> None:
    rows = local
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        # every try draws Bp prompts: their groups are kept or dropped
        assert r["filter/kept_groups"] + r["filter/dropped_groups"] == BP * r["filter/tries"]
        assert r["filter/kept_groups"] >= BP
        assert r["train/num_gen_batches"] == r["filter/tries"] >= 1
    # the tiny model gives some groups all-equal scores: the loop really refilled
    assert any(r["filter/tries"] > 1 for r in rows), rows
    assert any(r["filter/dropped_groups"] > 0 for r in rows), rows


def test_a_resumed_run_continues_from_the_data_the_tries_consumed(
        local: list[dict[str, Any]], tmp_path: Path) -> None:
    """Steps 0-1 then resume at step 2 from step 1's checkpoint: step 2 draws the same
    batches as the uninterrupted run (the checkpoint holds the data cursor after every
    try), so every number is equal."""
    rows = local
    assert any(r["filter/tries"] > 1 for r in rows[:2]), "no refill before the checkpoint"
    first = _run(tmp_path / "r", "trainer.steps=2", "trainer.checkpoint_every=1")
    assert_same_numbers(first, rows[:2], rel=0, abs_floor=0)
    resumed = _run(tmp_path / "r", *SHORT, resume=True)
    assert_same_numbers(resumed, rows, rel=0, abs_floor=0)


def test_too_few_kept_groups_stop_the_run_naming_the_filter(tmp_path: Path) -> None:
    # no group mean reaches 5: every group is dropped
    with pytest.raises(FlowgraphError) as info:
        _run(tmp_path / "x", "trainer.steps=1", "nodes.keep.params.metric=mean_in_range",
             "nodes.keep.params.min_score=5.0", "nodes.keep.params.max_tries=2")
    text = str(info.value)
    assert "node `keep` (kind filter, " in text and "at step 0: 2 tries (max_tries) kept 0 " \
        "of the 4 groups the batch needs (8 dropped" in text, text
    assert "nodes.keep.params.max_tries" in text


def test_a_plan_that_changes_the_loop_is_refused(tmp_path: Path) -> None:
    from flowgraph.errors import PlanError

    plan = _plan(tmp_path / "p")
    data = json.loads(plan_to_json(plan))
    data["resample"]["repeat"] = ["train", "gen", "keep"]
    with pytest.raises(PlanError, match="repeats \\['train', 'gen', 'keep'\\]; the data "
                                        "sources and the step nodes before the filter are"):
        plan_from_json(json.dumps(data))


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp_gives_the_numbers_of_the_local_run(
        local: list[dict[str, Any]], tmp_path: Path) -> None:
    assert_same_numbers(_run(tmp_path / "fsdp", *SHORT, target="fsdp"), local)


@pytest.mark.multiprocess
def test_ray_gives_the_numbers_of_the_local_run(
        local: list[dict[str, Any]], tmp_path: Path) -> None:
    assert_same_numbers(_run(tmp_path / "ray", *SHORT, target="ray"), local)


def test_the_yaml_run_gives_the_numbers_of_the_plan_file(
        local: list[dict[str, Any]], tmp_path: Path) -> None:
    """`flowgraph run graphs/dapo.yaml` and `flowgraph run plan.json` (the fixture's run)."""
    from flowgraph.cli import main

    assert main(["run", str(DAPO), f"trainer.run_dir={tmp_path / 'yaml'}", *SHORT]) == 0
    assert_same_numbers(read_metrics(tmp_path / "yaml"), local, rel=0, abs_floor=0)


@pytest.mark.slow
def test_the_default_dapo_run_learns(tmp_path: Path) -> None:
    """graphs/dapo.yaml as shipped (60 steps, ~15 s): the filtered batch's mean shaped
    score (exact match with partial credit, plus the overlong penalty) rises (measured:
    -0.46 over the first 10 steps, -0.06 over the last, responses 7.9 -> 4.3 tokens)."""
    from flowgraph.cli import main

    assert main(["run", str(DAPO), f"trainer.run_dir={tmp_path / 'run'}"]) == 0
    scores = [r["critic/score/mean"] for r in read_metrics(tmp_path / "run")]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last > first + 0.1, (first, last)


def test_a_plan_without_its_loop_is_refused(tmp_path: Path) -> None:
    from flowgraph.errors import PlanError

    data = json.loads(plan_to_json(_plan(tmp_path / "p")))
    data["resample"] = None
    with pytest.raises(PlanError, match="node `keep` \\(kind `filter`, category `filter`\\) "
                                        "and the plan's resample loop \\(none\\) disagree"):
        plan_from_json(json.dumps(data))


def test_held_out_evaluation_runs_through_the_filter(tmp_path: Path) -> None:
    """Evaluation answers each prompt once (n = 1): every group is a singleton, kept."""
    rows = _run(tmp_path / "e", "trainer.steps=1", "trainer.eval_every=1",
                "data.train.eval_path=builtin:arith")
    assert "val/score/mean" in rows[0]
