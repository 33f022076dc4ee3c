"""Runs on a pandas DataFrame: written once into the run dir (`run_dir/data/`), read by
every process from there, resumed from the run dir's plan.json by the command line, and
refused on resume when the DataFrame's rows changed."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

import flowgraph
from flowgraph import GraphBuilder
from flowgraph.cli import main
from flowgraph.compilers import read_metrics
from flowgraph.data import held
from flowgraph.data.tasks import arith_problems
from flowgraph.errors import FlowgraphError
from flowgraph.testing.targets import assert_same_numbers

# builtin:arith as a user holds it: string prompts (raw text: TRL's standard format)
ARITH = pd.DataFrame([{"prompt": q, "ground_truth": a} for q, a in arith_problems()])
HELD_OUT = pd.DataFrame([{"prompt": q, "ground_truth": a}
                         for q, a in arith_problems("test")][:8])


def _graph(data: object, run_dir: Path, steps: int = 2, held_out: object = None
           ) -> flowgraph.Graph:
    g = GraphBuilder("grpo")
    g.dims(Bp=4, N=2, P=8, T=4)
    g.model("actor", "builtin:tiny-lm", trainable=True, optimizer={"lr": 3e-4})
    train = g.data("train", "prompts", data,
                   **({} if held_out is None else {"eval_path": held_out}))
    gen = g.node("gen", "generate", model="actor", prompts=train.input_ids,
                 prompt_mask=train.attention_mask, ground_truth=train.ground_truth)
    seq = {"prompts": gen.prompts, "prompt_mask": gen.prompt_mask,
           "responses": gen.responses, "response_mask": gen.response_mask}
    old = g.node("old_logprob", "logprob", model="actor", **seq)
    reward = g.node("reward", "reward", model="actor", params={"fn": "exact_match"},
                    responses=gen.responses, response_mask=gen.response_mask,
                    ground_truth=gen.ground_truth)
    adv = g.node("adv", "grpo", scores=reward.scores, response_mask=gen.response_mask,
                 index=gen.index)
    g.node("update_actor", "ppo_actor_update", model="actor", **seq,
           old_log_prob=old.log_prob, advantages=adv.advantages)
    g.trainer(steps=steps, seed=0, run_dir=str(run_dir), checkpoint_every=0,
              eval_every=0 if held_out is None else 2)
    return g.build()


def test_a_dataframe_run_resumed_from_the_command_line_and_refused_when_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    with open(os.devnull, "w") as out:
        rows = flowgraph.run(_graph(ARITH, run_dir, held_out=HELD_OUT), out=out,
                             tensorboard=False).rows
        file = flowgraph.run(_graph(_write(ARITH, tmp_path / "a.parquet"), tmp_path / "file",
                                    held_out=_write(HELD_OUT, tmp_path / "b.parquet")),
                             out=out, tensorboard=False).rows
    assert [r["step"] for r in rows] == [0, 1]
    assert any(k.startswith("val/") for k in rows[-1])  # the held-out DataFrame evaluated
    assert_same_numbers(rows, file)  # the DataFrames' rows are the parquet files'
    written = sorted((run_dir / "data").glob("*.parquet"))
    assert {w.name.rsplit("-", 1)[0] for w in written} == {"train", "train-eval"}
    plan = (run_dir / "plan.json").read_text()
    assert all(str(w) in plan for w in written)
    # another process (no DataFrame held): the run dir's plan names the written file
    monkeypatch.setattr(held, "_HELD", {})
    assert main(["run", str(run_dir / "plan.json"), "--resume", "trainer.steps=3"]) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    changed = ARITH.copy()
    changed.loc[0, "ground_truth"] = "99"
    with pytest.raises(FlowgraphError) as exc:
        flowgraph.run(_graph(changed, run_dir, steps=4, held_out=HELD_OUT), resume=True)
    assert "data.train.path" in str(exc.value) and "changed since it was written" in str(exc.value)


def _write(df: pd.DataFrame, path: Path) -> str:
    df.to_parquet(path)
    return str(path)


@pytest.mark.multiprocess
def test_fsdp_ranks_read_the_dataframe_the_driver_wrote(tmp_path: Path) -> None:
    with open(os.devnull, "w") as out:
        fsdp = flowgraph.run(_graph(ARITH, tmp_path / "fsdp", steps=1), target="fsdp",
                             nproc=2, out=out, tensorboard=False).rows
        local = flowgraph.run(_graph(ARITH, tmp_path / "local", steps=1), out=out,
                              tensorboard=False).rows
    assert_same_numbers(fsdp, local)
    assert len(list((tmp_path / "fsdp" / "data").glob("train-*.parquet"))) == 1


def test_a_dataframe_is_checked_before_any_model_loads_naming_the_users_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flowgraph.nodes.models as models

    def no_loading(*args: object, **kw: object) -> None:
        raise AssertionError("a model was loaded before the dataset was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    graph = _graph(ARITH.rename(columns={"ground_truth": "answer"}), tmp_path / "run")
    with pytest.raises(FlowgraphError) as exc:
        flowgraph.run(graph, tensorboard=False)
    message = str(exc.value)  # the rows as written into the run dir, and the g.data line
    assert f"{tmp_path / 'run' / 'data' / 'train-'}" in message
    assert "has no ground truth, which node `reward` needs; its columns: prompt, answer" \
        in message
    assert f"(data source `train` at {__file__}:{graph.data[0].pos.line}:1)" in message
