"""Datasets given as Python objects (pyarrow Table, pandas DataFrame, datasets.Dataset,
DatasetDict) or hub ids, wherever a data path goes (`flowgraph.data.held`): held at the
builder's call, checked like files, a plan that cannot have them says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import flowgraph
from flowgraph import GraphBuilder
from flowgraph.checker import check_graph
from flowgraph.cli import main
from flowgraph.data import held
from flowgraph.errors import IRError
from flowgraph.plan import plan_to_json

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "ground_truth": str(2 * a)}
        for a in range(8)]


def _graph(path: Any, run_dir: Path | str = "runs/x", **params: Any) -> flowgraph.Graph:
    """GRPO on the tiny model, its data source `train` given `path`."""
    g = GraphBuilder("grpo")
    g.dims(Bp=4, N=2, P=16, T=4)
    g.model("actor", "builtin:tiny-lm", trainable=True, optimizer={"lr": 3e-4})
    train = g.data("train", "prompts", path, **params)
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
    g.trainer(steps=1, seed=0, run_dir=str(run_dir), checkpoint_every=0, eval_every=0)
    return g.build()


OBJECTS = {
    "pyarrow Table": lambda: pa.Table.from_pylist(ROWS),
    "pandas DataFrame": lambda: pd.DataFrame(ROWS),
    "datasets.Dataset": lambda: datasets.Dataset.from_list(ROWS),
}


@pytest.mark.parametrize("what", sorted(OBJECTS))
def test_an_object_is_held_compiled_and_named_by_what_it_is(what: str) -> None:
    graph = _graph(OBJECTS[what]())
    path = graph.data[0].path
    assert path.startswith("memory:")
    assert path.endswith(f"({what}, 8 rows × 2 columns)")
    assert held.held_table(path).to_pylist() == ROWS
    plan = flowgraph.compile(graph)  # no FG123 "file does not exist" on the way
    assert plan.data[0].path == path


def test_the_same_rows_have_the_same_key_whatever_they_came_as() -> None:
    """The fingerprint is of rows and column types, not of schema metadata (datasets'
    features); pandas 3 makes its strings `large_string`, another type."""
    keys = {_graph(make()).data[0].path.split(" ")[0] for make in OBJECTS.values()
            if make is not OBJECTS["pandas DataFrame"]}
    assert len(keys) == 1


def test_a_dataset_dict_gives_train_and_its_test_split_as_held_out_rows() -> None:
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                   "test": datasets.Dataset.from_list(ROWS[:4])})
    source = _graph(splits).data[0]
    held_out = source.params.to_python()["eval_path"]
    assert isinstance(held_out, str)
    assert held.held_table(source.path).num_rows == 8
    assert held.held_table(held_out).num_rows == 4
    assert "(datasets.Dataset, 4 rows × 2 columns)" in held_out
    # an eval_path given beside it wins; a DataFrame is one too
    given = _graph(splits, eval_path=pd.DataFrame(ROWS[:2])).data[0]
    assert held.held_table(str(given.params.to_python()["eval_path"])).num_rows == 2


def test_a_dataframe_changed_after_the_call_is_not_what_runs() -> None:
    df = pd.DataFrame(ROWS)
    path = _graph(df).data[0].path
    df.loc[0, "ground_truth"] = "changed"
    assert held.held_table(path).to_pylist() == ROWS
    assert _graph(df).data[0].path != path  # the changed rows are other rows


@pytest.mark.parametrize(("obj", "needle"), [
    ([{"prompt": "a"}], "got builtins.list"),
    (datasets.DatasetDict({"validation": datasets.Dataset.from_list(ROWS)}),
     "has no `train` split; its splits: validation"),
    (datasets.Dataset.from_list(ROWS).to_iterable_dataset(), "streaming"),
    (pd.DataFrame({"prompt": ["1+1=", 3]}), "its rows cannot be read as a table"),
])
def test_what_cannot_be_a_dataset_names_the_users_line(obj: Any, needle: str) -> None:
    with pytest.raises(IRError) as exc:
        _graph(obj)
    assert needle in str(exc.value)
    assert f"{__file__}:" in str(exc.value) and "data source `train`" in str(exc.value)


def test_check_data_opens_an_object_like_a_file_at_the_users_line() -> None:
    """Columns, malformed rows, ground truth and lengths, before any model loads."""
    from flowgraph.checker.data import check_data
    from flowgraph.nodes.models import load_tokenizer

    long = [{"prompt": "1234567890+1234567890=", "answer": "0"}] * 4 + [
        {"prompt": None, "answer": "1"}]
    graph = _graph(pd.DataFrame(long))
    line = graph.data[0].pos.line
    diags = check_data(graph, load_tokenizer)
    errors = {d.code: d for d in diags if d.is_error}
    assert sorted(errors) == ["FG510"]  # a null prompt: nothing more is measured
    assert "row 4 (0-based), column `prompt`: null" in errors["FG510"].message
    assert (errors["FG510"].pos.file, errors["FG510"].pos.line) == (__file__, line)
    diags = check_data(_graph(pd.DataFrame(long[:4])), load_tokenizer)
    assert {d.code for d in diags if d.is_error} == {"FG502", "FG503"}  # no ground truth;
    # 22 tokens of raw text (a string prompt, TRL's standard format) over P = 16
    assert any("the prompt is 22 tokens, over max_prompt_length 16" in d.message
               for d in diags)
    missing = check_data(_graph(pd.DataFrame([{"question": "1+1="}] * 4)), load_tokenizer)
    assert any(d.code == "FG501" and "has no column `prompt`" in d.message for d in missing)


def test_a_plan_file_naming_an_unwritten_table_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(plan_to_json(flowgraph.compile(_graph(pd.DataFrame(ROWS), tmp_path / "run"))))
    path = json.loads(plan.read_text())["run"]["data"]["train"]["path"]
    assert path.endswith("(pandas DataFrame, 8 rows × 2 columns)")
    monkeypatch.setattr(held, "_HELD", {})  # another process: the CLI's
    assert main(["run", str(plan)]) == 1
    err = capsys.readouterr().err
    assert "was an in-memory table of the Python session that compiled this plan" in err
    assert "(pandas DataFrame, 8 rows × 2 columns)" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_hub_id_is_kept_and_offline_is_one_message(tmp_path: Path) -> None:
    graph = _graph("trl-lib/tldr")
    assert graph.data[0].path == "trl-lib/tldr"  # not a file of the working directory
    assert not [d for d in check_graph(graph).diagnostics if d.code == "FG123"]
    from flowgraph.checker.data import check_data
    from flowgraph.nodes.models import load_tokenizer

    notes = [d for d in check_data(graph, load_tokenizer) if d.code == "FG509"]
    assert any("hub dataset `trl-lib/tldr` is not a local path" in d.message for d in notes)
    # no network here: HF's offline mode answers at once instead of a timeout
    yaml = (ROOT / "graphs" / "grpo.yaml").read_text().replace(
        'train: {kind: prompts, path: "builtin:reverse"}', "train: {kind: prompts, path: "
        "trl-lib/tldr}")
    file = tmp_path / "g.yaml"
    file.write_text(yaml)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "flowgraph", "run", str(file),
                           f"trainer.run_dir={tmp_path / 'run'}"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    for needle in ("`trl-lib/tldr` is no local file, so it was looked up as a Hugging Face "
                   "hub dataset, which failed (HF_HUB_OFFLINE and HF_DATASETS_OFFLINE set",
                   "to_parquet", "data source `train`", "g.yaml:"):
        assert needle in done.stderr
    assert "Traceback" not in done.stderr


def test_a_hub_dataset_is_loaded_and_written_with_its_test_split(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is network: `datasets.load_dataset(id)` (stood in for here), its train
    split the rows, its test split the held-out ones, both written into the run dir."""
    asked: list[str] = []

    def load_dataset(path: str) -> datasets.DatasetDict:
        asked.append(path)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                     "test": datasets.Dataset.from_list(ROWS[:4])})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    plan = held.write_tables(flowgraph.compile(_graph("org/name")), tmp_path)
    source = plan.data[0]
    held_out = str(source.params.to_python()["eval_path"])
    assert asked == ["org/name"]
    assert [Path(p).parent for p in (source.path, held_out)] == [tmp_path / "data"] * 2
    assert pq.read_table(source.path).num_rows == 8
    assert pq.read_table(held_out).num_rows == 4
