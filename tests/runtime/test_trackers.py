"""Experiment trackers (`trainer.loggers`): real wandb (offline) and mlflow (its SQLite
store in the run dir) hold the same numbers under the same names as metrics.jsonl; a
resume continues their runs; a wrong name or a missing package stops before any model
loads. No network: WANDB_MODE=offline, no API key.
"""

from __future__ import annotations

import io
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowgraph.compilers import RunOptions, read_metrics, run
from flowgraph.errors import FlowgraphError
from flowgraph.frontend import graph_from_yaml, graph_to_document, graph_to_yaml, load_graph
from flowgraph.passes import compile_graph

ROOT = Path(__file__).resolve().parents[2]
GRPO = (ROOT / "graphs" / "grpo.yaml").read_text()
SMALL = ("dims.Bp=2", "dims.N=2", "nodes.update_actor.params.mini_batch_size=4")
"""GRPO at its smallest: 2 prompts × 2 samples."""
TRACKERS = "trainer.loggers=[jsonl, wandb, mlflow]"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def _grpo(run_dir: Path, *overrides: str, resume: bool = False) -> str:
    """Run graphs/grpo.yaml small; what it printed."""
    result = compile_graph(ROOT / "graphs" / "grpo.yaml",
                           overrides=[*SMALL, f"trainer.run_dir={run_dir}", *overrides])
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    out = io.StringIO()
    run(result.plan, RunOptions(resume=resume, out=out))
    return out.getvalue()


def _numbers(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl by step, without NaN/inf (written as strings; trackers skip them)."""
    return {row["step"]: {k: v for k, v in row.items() if k != "step" and isinstance(v, float)}
            for row in read_metrics(run_dir)}


# --- reading the trackers back -----------------------------------------------------------


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run's `.wandb` file. wandb >= 0.19 reads it only in its
    Go core; the format is LevelDB's log (32 KiB blocks, each record a 7-byte header:
    CRC, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4) after a 7-byte `:W&B` header,
    each record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _wandb_runs(run_dir: Path) -> list[tuple[str, dict[str, Any], dict[int, dict[str, float]]]]:
    """(run id, config, history by step) of every offline run folder, oldest first."""
    out = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (file,) = folder.glob("run-*.wandb")
        run_id, config, history = "", {}, {}
        for record in _wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                          for i in record.run.config.update}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item}
                history[row["_step"]] = {  # the validation table's fields: elsewhere
                    k: v for k, v in row.items()
                    if not k.startswith(("_", "val/validation/"))}
        out.append((run_id, config, history))
    return out


def _mlflow(run_dir: Path) -> tuple[Any, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    return client, (run_dir / "mlflow" / "flowgraph_run_id").read_text().strip()


def _mlflow_history(client: Any, run_id: str, names: set[str]) -> dict[int, dict[str, float]]:
    """Every (step, value) of each metric, by step; a step logged twice fails."""
    by_step: dict[int, dict[str, float]] = {}
    for name in names:
        for m in client.get_metric_history(run_id, name):
            assert name not in by_step.setdefault(m.step, {}), (name, m.step)
            by_step[m.step][name] = m.value
    return by_step


# --- runs ----------------------------------------------------------------------------------


def test_wandb_and_mlflow_hold_the_rows_of_metrics_jsonl(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    printed = _grpo(run_dir, "trainer.steps=3", "trainer.eval_every=3", TRACKERS)
    assert printed == ""  # no `console` logger: no step lines
    assert not (run_dir / "tensorboard").exists()  # not listed
    expected = _numbers(run_dir)
    assert sorted(expected) == [0, 1, 2]
    names = {name for row in expected.values() for name in row}
    assert {"timing_s/gen", "critic/score/mean", "actor/pg_loss", "val/accuracy"} <= names

    ((run_id, config, history),) = _wandb_runs(run_dir)
    assert history == expected
    assert run_id == (run_dir / "wandb" / "flowgraph_run_id").read_text().strip()
    assert config["name"] == "grpo" and config["trainer"]["steps"] == 3
    assert config["nodes"]["adv"] == {"kind": "grpo", "inputs": {
        "scores": "reward.scores", "response_mask": "gen.response_mask",
        "index": "gen.index"}, "params": {"norm_by_std": True}}

    client, run_id = _mlflow(run_dir)
    assert _mlflow_history(client, run_id, names) == expected
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.run_name == "run" and mlflow_run.info.status == "FINISHED"
    assert client.get_experiment(mlflow_run.info.experiment_id).name == "grpo"
    params = mlflow_run.data.params
    assert params["trainer.steps"] == "3" and params["dims.Bp"] == "2"
    assert params["nodes.gen.params.backend"] == "hf"
    assert params["models.actor.optimizer.lr"] == "0.0003"


def test_validation_generations_reach_the_run_dir_and_every_tracker(tmp_path: Path) -> None:
    """Before training (val_before_train) and after step 1: run_dir/validation/step_*.jsonl,
    an MLflow table artifact and a wandb Table, of the same rows."""
    run_dir = tmp_path / "run"
    _grpo(run_dir, "trainer.steps=2", "trainer.eval_every=2",
          "trainer.loggers=[jsonl, tensorboard, wandb, mlflow]")
    tables = sorted(p.name for p in (run_dir / "validation").iterdir())
    assert tables == ["step_0.jsonl", "step_1.jsonl"]
    rows = [json.loads(line) for line in (run_dir / "validation" / "step_1.jsonl").open()]
    assert len(rows) == 100  # every held-out string of builtin:reverse, once
    assert rows[0]["prompt"].startswith("reverse ") and "ground_truth" in rows[0]
    client, run_id = _mlflow(run_dir)
    logged = json.loads(Path(client.download_artifacts(
        run_id, "val/validation/step_1.json", str(tmp_path))).read_text())
    column = logged["columns"].index("response")
    assert [row[column] for row in logged["data"]] == [r["response"] for r in rows]
    (media,) = (run_dir / "wandb").glob("offline-run-*/files/media/table/val/validation_1_*")
    table = json.loads(media.read_text())
    assert [row[table["columns"].index("response")] for row in table["data"]] == \
        [r["response"] for r in rows]


def test_a_resumed_run_continues_the_tracker_runs(tmp_path: Path) -> None:
    # A checkpoint after every step: the resume re-runs no step, so each is logged once.
    run_dir = tmp_path / "run"
    _grpo(run_dir, "trainer.steps=2", "trainer.checkpoint_every=1", TRACKERS)
    printed = _grpo(run_dir, "trainer.steps=4", "trainer.checkpoint_every=1",
                    "trainer.loggers=[console, wandb, mlflow]", resume=True)
    assert printed.startswith(f"resuming from checkpoint `{run_dir / 'checkpoints' / 'step_1'}`")
    assert [line.split()[1] for line in printed.splitlines()[1:]] == ["2/4", "3/4"]
    expected = _numbers(run_dir)
    assert sorted(expected) == [0, 1, 2, 3]
    names = {name for row in expected.values() for name in row}

    client, run_id = _mlflow(run_dir)
    (experiment,) = [e for e in client.search_experiments() if e.name == "grpo"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert _mlflow_history(client, run_id, names) == expected
    assert client.get_run(run_id).data.params["trainer.steps"] == "2"  # of the first start

    # two offline folders of one wandb run: `wandb sync` uploads them in order as one
    (first, second) = _wandb_runs(run_dir)
    assert first[0] == second[0]
    assert sorted(first[2]) == [0, 1] and sorted(second[2]) == [2, 3]
    assert first[2] | second[2] == expected


# --- errors before any model loads ----------------------------------------------------------


@pytest.mark.parametrize(("trainer", "message"), [
    ("{loggers: [console, wandbb]}", ":30: error[FG004]: `trainer.loggers` lists `wandbb`, "
                                     "which is not a logger"),
    ("{loggers: [console, 3]}", ":30: error[FG004]: `trainer.loggers` lists `3`, which is "
                                "not a logger"),
    ("{loggers: wandb}", ":20: error[FG004]: `trainer.loggers` must be a list, got a string "
                         "'wandb'"),
])
def test_unknown_loggers_are_named_at_their_line(tmp_path: Path, trainer: str,
                                                 message: str) -> None:
    file = tmp_path / "g.yaml"
    text = GRPO.rsplit("trainer:", 1)[0] + f"trainer: {trainer}\n"
    file.write_text(text)
    _, diags = load_graph(file)
    assert [d.one_line() for d in diags if d.is_error] == [
        f"{file}:{text.count(chr(10))}{message}"]
    if "wandbb" in trainer:
        assert diags[-1].hint == ("did you mean `wandb`? the loggers are console, jsonl, "
                                  "tensorboard, wandb, mlflow")


@pytest.mark.parametrize(("loggers", "module"), [
    ("[wandb]", "wandb"), ("[console, mlflow]", "mlflow"), ("[mlflow]", "sqlalchemy"),
])
def test_a_missing_tracker_package_stops_the_run_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loggers: str, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # find_spec and import now fail
    name = loggers.strip("[]").split(", ")[-1]
    with pytest.raises(FlowgraphError) as caught:
        _grpo(tmp_path / "run", f"trainer.loggers={loggers}")
    assert str(caught.value) == (f"trainer.loggers lists {name} but the {module} package is "
                                 "not installed; pip install 'flowgraph[trackers]'")
    assert not (tmp_path / "run").exists()  # before the run dir, let alone a model


def test_loggers_round_trip_through_the_graph_file() -> None:
    default = graph_from_yaml(GRPO)
    assert default.trainer.loggers == ("console", "jsonl", "tensorboard")
    assert "loggers" not in graph_to_document(default)["trainer"]  # type: ignore[operator]
    listed = graph_from_yaml(GRPO.replace(
        "trainer: {", "trainer: {loggers: [wandb, mlflow], mlflow_tracking_uri: 'file:/x', "))
    trainer = graph_to_document(listed)["trainer"]
    assert trainer["loggers"] == ["wandb", "mlflow"]  # type: ignore[index]
    assert trainer["mlflow_tracking_uri"] == "file:/x"  # type: ignore[index]
    assert graph_from_yaml(graph_to_yaml(listed)) == listed


def test_mlflow_params_are_cut_to_its_limits() -> None:
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    from flowgraph.runtime.trackers import Mlflow

    class Client:
        def __init__(self) -> None:
            self.batches: list[list[Any]] = []

        def log_batch(self, run_id: str, params: list[Any]) -> None:
            self.batches.append(params)

    client = Client()
    document = {"nodes": {f"n{i}": {"params": {"p": i}} for i in range(250)},
                "data": {"train": {"path": "x" * 7000, "odd key@1": [1, 2]}}}
    Mlflow(client, "r").log_params(document)
    # 252 params in batches of MLflow's most per call (100); values cut, names it refuses
    # mended, lists as JSON
    assert [len(b) for b in client.batches] == [100, 100, 52]
    params = {p.key: p.value for b in client.batches for p in b}
    assert params["nodes.n7.params.p"] == "7"
    assert params["data.train.path"] == "x" * MAX_PARAM_VAL_LENGTH
    assert params["data.train.odd key_1"] == "[1, 2]"
