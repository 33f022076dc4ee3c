"""The plan is the program: `flowgraph run plan.json` runs a compiled plan as it is
(hand edits included, checked by the plan verifier), and Python users compile and run
graphs with `flowgraph.compile` / `flowgraph.run`, the code path of the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import flowgraph
from flowgraph import GraphBuilder
from flowgraph.cli import main
from flowgraph.compilers import read_metrics
from flowgraph.compilers.interpreter import Interpreter
from flowgraph.testing.targets import assert_same_numbers

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"


def _compile_to(file: Path, graph: str, *args: str) -> dict[str, Any]:
    assert main(["compile", str(GRAPHS / graph), *args, "-o", str(file)]) == 0
    data: dict[str, Any] = json.loads(file.read_text())
    return data


def _move(data: dict[str, Any], node: str, stage: str) -> None:
    """Move `node` to `stage` in the plan's stage list and its node record."""
    for s in data["stages"]:
        s["nodes"] = [n for n in s["nodes"] if n != node] + ([node] if s["name"] == stage else [])
    next(n for n in data["nodes"] if n["name"] == node)["stage"] = stage


def test_a_hand_edited_stage_takes_effect(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """PPO's critic forward moved from step.2 to step.4 (after the KL penalty, still
    before the advantage that reads it): it runs there, and the numbers do not move."""
    ran: list[str] = []  # the nodes of the first step, in the order the executor ran them
    run_node = Interpreter.run_node

    def recording(self: Interpreter, name: str, *args: Any, **kwargs: Any) -> float:
        ran.append(name)
        return run_node(self, name, *args, **kwargs)

    monkeypatch.setattr(Interpreter, "run_node", recording)
    run = ("trainer.steps=2", "trainer.eval_every=0", "trainer.checkpoint_every=0")
    plan = tmp_path / "plan.json"
    data = _compile_to(plan, "ppo.yaml", *run, f"trainer.run_dir={tmp_path / 'edited'}")
    _move(data, "values", "step.4")
    plan.write_text(json.dumps(data))
    assert main(["run", str(plan)]) == 0
    edited, ran[:] = ran[:], []
    assert main(["run", str(GRAPHS / "ppo.yaml"), *run,
                 f"trainer.run_dir={tmp_path / 'as_compiled'}"]) == 0
    compiled = ran[:]
    assert edited.index("token_reward") < edited.index("kl")
    assert edited.index("kl") + 1 == edited.index("values")  # step.4: kl, then values
    assert compiled.index("values") < compiled.index("reward")  # step.2, as compiled
    assert_same_numbers(read_metrics(tmp_path / "edited"), read_metrics(tmp_path / "as_compiled"))


def test_a_plan_that_breaks_a_dependency_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    data = _compile_to(plan, "ppo.yaml", f"trainer.run_dir={tmp_path / 'run'}")
    _move(data, "values", "step.1")  # with gen, whose responses it reads
    plan.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["run", str(plan)]) == 1  # read, and wrong: as a graph with errors
    err = capsys.readouterr().err
    assert err.startswith("flowgraph: error: invalid execution plan: node `values` (stage "
                          "`step.1`) reads `gen.prompts`, which stage `step.1` only computes "
                          "at the same time or later"), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_plan_from_another_version_or_with_overrides_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    data = _compile_to(plan, "grpo.yaml", "--target", "ray", "--nproc", "2")
    capsys.readouterr()
    assert main(["run", str(plan), "trainer.steps=3", "dims.Bp=8", "trainer.seed=1"]) == 2
    assert ("a compiled plan runs as it is: dims.Bp=8, trainer.seed=1 would change what it "
            "runs (it takes only trainer.run_dir, trainer.steps)") in capsys.readouterr().err
    assert main(["run", str(plan), "--target", "local"]) == 2
    assert "is a plan compiled for target ray, nproc 2; it runs as it is: drop --target" \
        in capsys.readouterr().err
    data["version"] = 1
    plan.write_text(json.dumps(data))
    assert main(["run", str(plan)]) == 2
    assert "the plan is format version 1; this flowgraph reads version" in \
        capsys.readouterr().err


def test_a_plan_reruns_into_another_run_dir_for_other_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`trainer.run_dir` and `trainer.steps` change where and how long a plan runs, not
    what it runs: a plan run takes them, and its run dir's plan.json records them."""
    plan = tmp_path / "plan.json"
    _compile_to(plan, "sft.yaml", f"trainer.run_dir={tmp_path / 'compiled'}", "dims.Bp=4",
                "nodes.update.params.mini_batch_size=4", "trainer.eval_every=0",
                "trainer.loggers=[jsonl]")
    again = tmp_path / "again"
    assert main(["run", str(plan), f"trainer.run_dir={again}", "trainer.steps=2"]) == 0
    assert [r["step"] for r in read_metrics(again)] == [0, 1]
    assert not (tmp_path / "compiled").exists()
    recorded = json.loads((again / "plan.json").read_text())["run"]["trainer"]
    assert (recorded["run_dir"], recorded["steps"]) == (str(again), 2)
    capsys.readouterr()
    for bad, words in (("trainer.steps=-1", "trainer.steps is -1; it must be >= 0"),
                       ("trainer.steps=two", "trainer.steps takes a whole number"),
                       ("trainer.run_dir=[a]", "trainer.run_dir takes a folder")):
        assert main(["run", str(plan), bad]) == 2
        assert f"flowgraph: error: override `{bad}`: {words}" in capsys.readouterr().err


def _grpo_in_python(run_dir: Path) -> flowgraph.Graph:
    """graphs/grpo.yaml, built with GraphBuilder (the README's example)."""
    g = GraphBuilder("grpo")
    g.dims(Bp=16, N=8, P=16, T=8)
    g.model("actor", "builtin:tiny-lm-sft", trainable=True,
            optimizer={"lr": 3e-4, "warmup_steps": 2, "grad_clip": 1.0})
    g.model("ref", "builtin:tiny-lm-sft")
    train = g.data("train", "prompts", "builtin:reverse")
    gen = g.node("gen", "generate", model="actor", params={"backend": "hf", "temperature": 1.0},
                 prompts=train.input_ids, prompt_mask=train.attention_mask,
                 ground_truth=train.ground_truth)
    seq = {"prompts": gen.prompts, "prompt_mask": gen.prompt_mask,
           "responses": gen.responses, "response_mask": gen.response_mask}
    old = g.node("old_logprob", "logprob", model="actor", **seq)
    ref = g.node("ref_logprob", "logprob", model="ref", **seq)
    reward = g.node("reward", "reward", model="actor",
                    params={"fn": "exact_match", "format_score": 0.1},
                    responses=gen.responses, response_mask=gen.response_mask,
                    ground_truth=gen.ground_truth)
    adv = g.node("adv", "grpo", params={"norm_by_std": True}, scores=reward.scores,
                 response_mask=gen.response_mask, index=gen.index)
    g.node("update_actor", "ppo_actor_update", model="actor",
           params={"kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "mini_batch_size": 128},
           **seq, old_log_prob=old.log_prob, advantages=adv.advantages,
           ref_log_prob=ref.log_prob)
    g.trainer(steps=2, seed=0, run_dir=str(run_dir), checkpoint_every=0, eval_every=0)
    return g.build()


def test_grpo_built_compiled_and_run_from_python_equals_the_yaml(tmp_path: Path) -> None:
    graph = _grpo_in_python(tmp_path / "python")
    plan = flowgraph.compile(graph, target="local")
    assert isinstance(plan, flowgraph.ExecutionPlan) and plan.target == "local"
    with open(os.devnull, "w") as out:
        result = flowgraph.run(plan, out=out, tensorboard=False)
        yaml = flowgraph.run(GRAPHS / "grpo.yaml", out=out, tensorboard=False, overrides=(
            "trainer.steps=2", "trainer.checkpoint_every=0", "trainer.eval_every=0",
            "trainer.val_before_train=false", f"trainer.run_dir={tmp_path / 'yaml'}"))
    assert result.run_dir == tmp_path / "python"
    assert [r["step"] for r in result.rows] == [0, 1]
    assert result.rows == read_metrics(tmp_path / "python")
    assert_same_numbers(result.rows, yaml.rows)


def test_compile_errors_and_plan_mismatches_from_python(tmp_path: Path) -> None:
    graph = _grpo_in_python(tmp_path / "run")
    broken = flowgraph.Graph(**{**{f: getattr(graph, f) for f in (
        "name", "models", "data", "dims", "trainer", "resources", "plugins")},
        "nodes": graph.nodes[:-2] + graph.nodes[-1:]})  # the update reads `adv`, now gone
    with pytest.raises(flowgraph.CompileError) as exc:
        flowgraph.compile(broken)
    assert any(d.code == "FG105" for d in exc.value.diagnostics)
    plan = flowgraph.compile(graph, target="ray", nproc=2)
    with pytest.raises(flowgraph.FlowgraphError, match="a plan runs as compiled"):
        flowgraph.run(plan, target="local")


def test_the_prologue_runs_once_per_row_before_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DPO's reference log-probs (the plan's prologue): every training row once, in
    batches of Bp before step 0, then read by uid at every step; never at a step."""
    from flowgraph.compilers.worker import Worker

    calls: list[tuple[str, int, int]] = []  # (node, step, rows)
    real = Worker.call

    def spy(self: Worker, name: str, inputs: Any, step: int, *args: Any,
            **kwargs: Any) -> Any:
        out = real(self, name, inputs, step, *args, **kwargs)
        calls.append((name, step, len(out[0]["log_prob"]) if "log_prob" in out[0] else 0))
        return out

    monkeypatch.setattr(Worker, "call", spy)
    plan = flowgraph.compile(GRAPHS / "dpo.yaml", overrides=(
        "trainer.steps=3", "trainer.eval_every=0", "trainer.checkpoint_every=0",
        f"trainer.run_dir={tmp_path / 'run'}"))
    assert [s.name for s in plan.stages if s.once] == ["prologue"]
    with open(os.devnull, "w") as out:
        rows = flowgraph.run(plan, out=out, tensorboard=False).rows
    from flowgraph.nodes.data import preference_source

    rows_in_data = len(preference_source("builtin:arith-pairs", tokenizer=_tokenizer(),
                                         seed=0, max_prompt_length=16,
                                         max_response_length=8).train)
    ref = [(step, n) for name, step, n in calls if name.startswith("ref_")]
    assert {step for step, _ in ref} == {-1}, calls  # -1: the prologue
    assert sum(n for _, n in ref) == 2 * rows_in_data  # ref_chosen and ref_rejected
    assert [step for name, step, _ in calls if name == "update"] == [0, 1, 2]
    assert rows[0]["timing_s/prologue"] > 0 and "timing_s/prologue" not in rows[1]
    assert "timing_s/ref_chosen" not in rows[0]


def _tokenizer() -> Any:
    from flowgraph.nodes.models import load_tokenizer

    return load_tokenizer("builtin:tiny-lm")


def test_a_plan_whose_input_contract_disagrees_with_its_output_is_refused(tmp_path: Path
                                                                        ) -> None:
    """An input's dims (`InputPlan.dims`, the contract strict mode holds its tensors to)
    edited to T+1 where the output it reads gives T: the plan contradicts itself and is
    refused before any model loads, naming the node, the port and both dims."""
    plan = tmp_path / "plan.json"
    data = _compile_to(plan, "grpo.yaml", "trainer.steps=1", "trainer.eval_every=0",
                       f"trainer.run_dir={tmp_path / 'run'}")
    reward = next(n for n in data["nodes"] if n["name"] == "reward")
    port = next(i for i in reward["inputs"] if i["port"] == "responses")
    assert port["dims"] == "Bp*N T"
    port["dims"] = "Bp*N T+1"
    plan.write_text(json.dumps(data))
    with pytest.raises(flowgraph.FlowgraphError) as exc, open(os.devnull, "w") as out:
        flowgraph.run(plan, out=out, tensorboard=False)
    assert str(exc.value) == (
        "invalid execution plan: node `reward` input `responses`: `dims` is `Bp*N T+1`, but "
        "the output it reads, `gen.responses`, has `dims` `Bp*N T`: edit both alike, or "
        "compile the graph again")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


EXAMPLES = sorted(p.name for p in GRAPHS.glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["local", "fsdp", "ray"])
@pytest.mark.parametrize("graph", EXAMPLES)
def test_every_example_plan_file_runs_with_the_numbers_of_its_yaml(
        graph: str, target: str, tmp_path: Path) -> None:
    """`flowgraph compile g.yaml --target t -o plan.json; flowgraph run plan.json` equals
    `flowgraph run g.yaml --target t`, for every shipped graph on every target (the
    default suite holds ppo, grpo and dpo on fsdp and ray to the local run)."""
    where = ["--target", target] + (["--nproc", "2"] if target != "local" else [])
    run = ("trainer.steps=2", "trainer.eval_every=0", "trainer.checkpoint_every=0")
    plan = tmp_path / "plan.json"
    _compile_to(plan, graph, *where, *run, f"trainer.run_dir={tmp_path / 'plan'}")
    assert main(["run", str(plan)]) == 0
    assert main(["run", str(GRAPHS / graph), *where, *run,
                 f"trainer.run_dir={tmp_path / 'yaml'}"]) == 0
    assert_same_numbers(read_metrics(tmp_path / "plan"), read_metrics(tmp_path / "yaml"))
