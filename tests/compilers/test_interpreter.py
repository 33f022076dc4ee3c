"""The interpreter (compilers/interpreter.py): `run` -> `run_node` -> the target's
dispatch, the outputs checked and stored, fused forwards stacked and cut back, the
prologue's rows looked up by uid.

Most tests drive an `Interpreter` over a compiled plan with a recording dispatch in place
of a target's (no model loads); the last runs a plan, to see the strict check's message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.compilers import RunOptions, run
from flowgraph.compilers.interpreter import Env, Interpreter, join
from flowgraph.errors import ContractViolation, FlowgraphError, NodeError, NonFiniteError
from flowgraph.passes import PassPipeline, compile_graph
from flowgraph.plan import ExecutionPlan

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "tests" / "plugins"
FAULTS = (PLUGINS / "faults.yaml").read_text()  # one node of the fault plugin
Bp, P, T = 8, 16, 8
"""graphs/dpo.yaml's dims."""


@pytest.fixture(autouse=True)
def _plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def _plan(file: str, *overrides: str, disabled: tuple[str, ...] = ()) -> ExecutionPlan:
    result = compile_graph(ROOT / "graphs" / file, overrides=list(overrides),
                           pipeline=PassPipeline.default(disabled=disabled))
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


class Recording:
    """A target's dispatch that runs nothing: it records each call and returns what
    `outputs(name, inputs)` makes, with `seconds` as the time spent in the node."""

    def __init__(self, outputs: Any, seconds: float = 0.25) -> None:
        self.outputs, self.seconds = outputs, seconds
        self.calls: list[tuple[str, dict[str, Any], int, dict[str, Any], bool]] = []

    def __call__(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float], *, evaluation: bool = False
                 ) -> tuple[dict[str, Any], float]:
        self.calls.append((name, inputs, step, params, evaluation))
        return self.outputs(name, inputs), self.seconds


def _log_probs(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """A sequence log-prob per row that says which row it is: -(row + 1)."""
    return {"log_prob": -1.0 - torch.arange(len(inputs["prompts"]), dtype=torch.float32)}


def _pairs(uids: range) -> Env:
    """A batch of DPO's `pairs` source: chosen responses of 1s, rejected of 2s."""
    b = len(uids)
    ones = torch.ones(b, T, dtype=torch.long)
    return {("pairs", "prompts"): torch.zeros(b, P, dtype=torch.long),
            ("pairs", "prompt_mask"): torch.ones(b, P, dtype=torch.long),
            ("pairs", "chosen"): ones, ("pairs", "chosen_mask"): torch.ones_like(ones),
            ("pairs", "rejected"): 2 * ones, ("pairs", "rejected_mask"): torch.ones_like(ones),
            ("pairs", "uid"): torch.tensor(list(uids))}


def test_run_runs_each_node_in_order_and_adds_up_its_seconds() -> None:
    plan = _plan("dpo.yaml", disabled=("hoist", "fusion"))
    dispatch = Recording(_log_probs)
    ip = Interpreter(plan, dispatch)
    before: list[str] = []
    ip.before_node = before.append
    env, metrics = _pairs(range(Bp)), {"timing_s/ref_chosen": 1.0}
    ip.run(["ref_chosen", "ref_rejected"], env, 3, strict=True, metrics=metrics)
    assert before == [c[0] for c in dispatch.calls] == ["ref_chosen", "ref_rejected"]
    assert {c[2] for c in dispatch.calls} == {3}  # the step, as given
    # 1.0 already there (a node that ran twice in a step) plus the dispatch's 0.25
    assert metrics == {"timing_s/ref_chosen": 1.25, "timing_s/ref_rejected": 0.25}
    assert torch.equal(env[("ref_rejected", "log_prob")], -1.0 - torch.arange(Bp).float())


def test_a_node_gets_its_wired_inputs_and_the_params_of_its_split() -> None:
    plan = _plan("grpo.yaml", "dims.Bp=4", "dims.N=4",
                 "nodes.update_actor.params.mini_batch_size=8")
    ports = [p.port for p in plan.node("gen").outputs]
    dispatch = Recording(lambda name, inputs: {port: torch.zeros(1) for port in ports})
    ip = Interpreter(plan, dispatch)
    env: Env = {("train", "input_ids"): "ids", ("train", "attention_mask"): "mask",
                ("train", "ground_truth"): "answers", ("train", "uid"): "not read"}
    for split in ("train", "eval"):
        ip.run_node("gen", env, 0, strict=False, metrics={}, split=split)
    (_, train, _, params, _), (_, held_out, _, eval_params, _) = dispatch.calls
    assert train == held_out and sorted(train.values()) == ["answers", "ids", "mask"]
    assert params == plan.live_params("gen")
    assert eval_params == plan.live_params("gen", evaluation=True)
    # the held-out rollouts: one greedy answer a prompt (val_n, val_temperature's default)
    assert (params["n"], params["do_sample"]) == (None, True)
    assert (eval_params["n"], eval_params["do_sample"]) == (1, False)


def test_a_missing_output_a_later_node_reads_names_node_kind_and_step() -> None:
    plan = _plan("grpo.yaml", "dims.Bp=4", "dims.N=4",
                 "nodes.update_actor.params.mini_batch_size=8")
    ip = Interpreter(plan, Recording(lambda name, inputs: {}))
    env: Env = {("gen", p): None for p in ("responses", "response_mask", "ground_truth")}
    with pytest.raises(NodeError) as exc:
        ip.run_node("reward", env, 2, strict=False, metrics={})
    assert str(exc.value) == ("while executing node `reward` (kind reward) at step 2: it "
                              "returned no output `scores`")


def test_an_output_nobody_reads_may_be_missing() -> None:
    # faults.yaml's one node: its scores feed nothing (FG108)
    result = compile_graph(PLUGINS / "faults.yaml")
    assert result.plan is not None
    env: Env = {("train", "input_ids"): torch.zeros(4, 16, dtype=torch.long)}
    Interpreter(result.plan, Recording(lambda name, inputs: {})).run_node(
        "score", env, 0, strict=False, metrics={})
    assert ("score", "scores") not in env


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_float_output_stops_the_step_and_is_not_stored(bad: float) -> None:
    plan = _plan("dpo.yaml", disabled=("hoist", "fusion"))
    ip = Interpreter(plan, Recording(
        lambda name, inputs: {"log_prob": torch.tensor([-1.0, bad, -2.0, -1.0] * 2)}))
    env = _pairs(range(Bp))
    with pytest.raises(NonFiniteError, match=r"^non-finite output `log_prob` in node "
                                             r"`ref_chosen` at step 5$"):
        ip.run_node("ref_chosen", env, 5, strict=False, metrics={})
    assert ("ref_chosen", "log_prob") not in env


def test_strict_mode_checks_inputs_before_the_call() -> None:
    plan = _plan("dpo.yaml", disabled=("hoist", "fusion"))
    dispatch = Recording(_log_probs)
    env = _pairs(range(Bp))
    env[("pairs", "chosen_mask")] = 3 * env[("pairs", "chosen_mask")]  # not binary
    ip = Interpreter(plan, dispatch)
    ip.run_node("ref_chosen", env, 0, strict=False, metrics={})  # unchecked: it runs
    with pytest.raises(ContractViolation, match="chosen_mask"):
        ip.run_node("ref_chosen", env, 1, strict=True, metrics={})
    assert [c[2] for c in dispatch.calls] == [0]  # the strict step never called the node


def test_a_fused_group_is_one_call_over_its_rows_stacked_each_getting_its_own() -> None:
    plan = _plan("dpo.yaml", disabled=("hoist",))
    assert plan.node("ref_chosen").fused == ("ref_rejected",)
    dispatch = Recording(_log_probs, seconds=0.5)
    ip = Interpreter(plan, dispatch)
    env, metrics = _pairs(range(Bp)), {}
    ip.run(["ref_chosen", "ref_rejected"], env, 0, strict=True, metrics=metrics)
    ((name, inputs, *_),) = dispatch.calls  # one forward for both
    assert name == "ref_chosen"
    assert sorted(inputs) == ["prompt_mask", "prompts", "response_mask", "responses"]
    # chosen rows (1s) then rejected rows (2s): 2 x Bp rows
    assert inputs["responses"][:, 0].tolist() == [1] * Bp + [2] * Bp
    assert inputs["prompts"].shape == (2 * Bp, P)
    # row i of the stack is -(i + 1): the first Bp back to ref_chosen, the rest to
    # ref_rejected; the member's own run costs nothing
    assert env[("ref_chosen", "log_prob")].tolist() == [-1.0 - i for i in range(Bp)]
    assert env[("ref_rejected", "log_prob")].tolist() == [-1.0 - i for i in range(Bp, 2 * Bp)]
    assert metrics == {"timing_s/ref_chosen": 0.5, "timing_s/ref_rejected": 0.0}


class _Rows:
    """A dataset of `n` DPO pairs whose prologue batches the interpreter reads."""

    def __init__(self, n: int) -> None:
        self.n = n

    def batches(self, rows: int) -> Any:
        for start in range(0, self.n, rows):
            batch = _pairs(range(start, min(start + rows, self.n)))
            yield {port: value for (_, port), value in batch.items()}


def test_the_prologue_runs_once_per_split_and_steps_look_its_rows_up_by_uid() -> None:
    plan = _plan("dpo.yaml")  # ref_chosen and ref_rejected hoisted, and fused
    dispatch = Recording(_log_probs)
    ip = Interpreter(plan, dispatch)
    assert ip.prologue.names == ["ref_chosen", "ref_rejected"]
    seconds = ip.prologue.run("train", lambda source: _Rows(12), Bp, strict=False)
    assert seconds >= 0.0
    assert len(dispatch.calls) == 2  # 12 rows in batches of 8: 8, then 4; fused: one call
    assert ip.prologue.run("train", lambda source: _Rows(12), Bp, strict=False) == 0.0
    assert len(dispatch.calls) == 2  # once per split
    # a step's batch: rows 10, 3, 8 (their uids), looked up without a call
    env = {k: v[:3] for k, v in _pairs(range(3)).items()}
    env[("pairs", "uid")] = torch.tensor([10, 3, 8])
    assert ip.run_node("ref_rejected", env, 0, strict=False, metrics={}) == 0.0
    assert len(dispatch.calls) == 2
    # each prologue call stacks its chosen rows, then its rejected ones (row i: -(i + 1)):
    # uid 10 is rejected row 2 of the second call's 4, stack row 4 + 2: -7; uid 3 is
    # rejected row 3 of the first call's 8, stack row 8 + 3: -12; uid 8, stack row 4: -5
    assert env[("ref_rejected", "log_prob")].tolist() == [-7.0, -12.0, -5.0]
    env[("pairs", "uid")] = torch.tensor([3, 12])
    with pytest.raises(FlowgraphError, match=r"^prologue node `ref_chosen` has no outputs "
                                             r"for rows \[12\] of the train data: the "
                                             r"prologue ran over other data$"):
        ip.run_node("ref_chosen", env, 1, strict=False, metrics={})


def test_join_concatenates_tensors_and_chains_lists() -> None:
    assert join([torch.tensor([1, 2]), torch.tensor([3])]).tolist() == [1, 2, 3]
    assert join([["a"], ["b", "c"]]) == ["a", "b", "c"]


def test_strict_mode_catches_a_wrong_output_shape(tmp_path: Path) -> None:
    text = FAULTS.replace("kind: prompt_score", "kind: wide_score")
    (tmp_path / "g.yaml").write_text(text)
    result = compile_graph(tmp_path / "g.yaml", overrides=[
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=1"])
    assert result.plan is not None
    with pytest.raises(ContractViolation) as exc, open(os.devnull, "w") as out:
        run(result.plan, RunOptions(tensorboard=False, out=out))
    message = str(exc.value)
    assert "output `score.scores`" in message and "at step 0" in message
    assert "shape is (4, 2), expected 1 axes (Bp,) = (4,)" in message
    assert f"{tmp_path / 'g.yaml'}:9:3" in message  # the node's line
