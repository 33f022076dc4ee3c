"""Experiment trackers: where step rows go besides `metrics.jsonl` and the console line.

`trainer.loggers` picks them:

    tensorboard  run_dir/tensorboard/ (event files)
    wandb        run_dir/wandb/offline-run-*/ (offline unless WANDB_MODE says otherwise;
                 `wandb sync run_dir/wandb/offline-run-*` uploads them as one run)
    mlflow       run_dir/mlflow/mlflow.db, a SQLite store (MLflow's own default kind;
                 its file store is in maintenance mode and refuses to start without
                 MLFLOW_ALLOW_FILE_STORE=true), unless `trainer.mlflow_tracking_uri` or
                 MLFLOW_TRACKING_URI names another

Only the process that writes metrics.jsonl opens them: the local process, fsdp rank 0,
the Ray driver. Each gets the numbers of every row under metrics.jsonl's names with the
row's step; NaN and inf (metrics.jsonl writes them as strings) are left out, as
TensorBoard always did. wandb also gets the graph file as its config, mlflow as params
(flattened keys, values cut to MLflow's length limit).

A resumed run (`--resume`, `trainer.resume`) logs into the same wandb and mlflow runs:
their ids are kept in `run_dir/wandb/flowgraph_run_id` and `run_dir/mlflow/flowgraph_run_id`.
A tracker's history is append-only: steps after the last checkpoint, which a resume (or
a Ray worker restart) runs again, are logged again there — metrics.jsonl drops their
first rows, a tracker keeps both — so with `trainer.checkpoint_every=1` no step is
logged twice. mlflow keeps the params of the first start (MLflow params never change).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flowgraph.errors import FlowgraphError
from flowgraph.plan import plan_document

if TYPE_CHECKING:
    from flowgraph.ir import TrainerSpec
    from flowgraph.plan import ExecutionPlan

__all__ = ["Tracker", "check_trackers", "mlflow_tracking_uri", "open_trackers"]

RUN_ID_FILE = "flowgraph_run_id"
"""In `run_dir/wandb/` and `run_dir/mlflow/`: the tracker run a resume continues."""
MLFLOW_NAME = re.compile(r"[^/\w.\- :]")
"""What MLflow refuses in a metric or param name (a plugin's metric may hold it): `_`."""


class Tracker(Protocol):
    """An experiment tracker that step rows are mirrored to."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """The finite numbers of step `step`'s row."""

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """A table logged at step `step` (the validation generations), rows of one
        set of columns."""

    def close(self) -> None:
        """Flush and end the tracker's run."""


def mlflow_tracking_uri(trainer: TrainerSpec, run_dir: Path) -> str:
    """`trainer.mlflow_tracking_uri`, else MLFLOW_TRACKING_URI, else the run's own
    SQLite store."""
    return (trainer.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or _own_store(run_dir))


def _own_store(run_dir: Path) -> str:
    return f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}"


def check_trackers(trainer: TrainerSpec) -> None:
    """Raise before any model loads when a listed tracker's package is missing."""
    needs: dict[str, tuple[str, ...]] = {"wandb": ("wandb",), "mlflow": ("mlflow",)}
    if mlflow_tracking_uri(trainer, Path(trainer.run_dir)).startswith("sqlite:"):
        needs["mlflow"] += ("sqlalchemy", "alembic")  # MLflow's SQL store
    for name in trainer.loggers:
        for module in needs.get(name, ()):
            if importlib.util.find_spec(module) is None:
                raise FlowgraphError(
                    f"trainer.loggers lists {name} but the {module} package is not "
                    "installed; pip install 'flowgraph[trackers]'")


def open_trackers(plan: ExecutionPlan, run_dir: Path, *, resume: bool,
                  tensorboard: bool = True) -> list[Tracker]:
    """The trackers `trainer.loggers` lists, started; `tensorboard=False` (the run
    option) leaves TensorBoard out even when listed."""
    loggers = plan.trainer.loggers
    trackers: list[Tracker] = []
    if "tensorboard" in loggers and tensorboard:
        trackers.append(TensorBoard(run_dir))
    if "wandb" in loggers:
        trackers.append(Wandb.start(plan, run_dir, resume=resume))
    if "mlflow" in loggers:
        trackers.append(Mlflow.start(plan, run_dir, resume=resume))
    return trackers


def _stored_id(folder: Path, resume: bool) -> str | None:
    """The tracker run id a resumed run continues; None for a new run."""
    path = folder / RUN_ID_FILE
    return path.read_text().strip() if resume and path.exists() else None


def _store_id(folder: Path, run_id: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_ID_FILE).write_text(run_id + "\n")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """An `OSError` inside names `path` when it names no file (a `write` or a flush
    that found the disk full does not), so that the run can say what it was writing."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


class TensorBoard:
    """Scalars in `run_dir/tensorboard`."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = run_dir / "tensorboard"
        with writing(self.folder):
            self.writer = SummaryWriter(str(self.folder))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        with writing(self.folder):
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """A markdown table in the Text tab."""
        columns = list(rows[0]) if rows else []
        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(str(r[c]).replace("|", "\\|").replace("\n", " ")
                                    for c in columns) + " |" for r in rows]
        with writing(self.folder):
            self.writer.add_text(name, "\n".join(lines), step)
            self.writer.flush()

    def close(self) -> None:
        with writing(self.folder):
            self.writer.close()


class Wandb:
    """A Weights & Biases run: project = the graph's name, name = the run dir's, config =
    the graph file. Offline in `run_dir/wandb/` unless WANDB_MODE is set; WANDB_PROJECT,
    when set, wins over the graph's name."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def start(cls, plan: ExecutionPlan, run_dir: Path, *, resume: bool) -> Wandb:
        import wandb

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        run_id = _stored_id(folder, resume)
        # None leaves a setting to wandb, which reads WANDB_MODE and WANDB_PROJECT
        run = wandb.init(
            dir=str(run_dir), name=run_dir.resolve().name, config=plan_document(plan),
            mode=None if "WANDB_MODE" in os.environ else "offline",
            project=None if "WANDB_PROJECT" in os.environ else plan.name,
            id=run_id, resume="allow" if run_id else None)
        _store_id(folder, run.id)
        return cls(run)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        import wandb

        columns: list[str | int] = list(rows[0]) if rows else []
        data = [[r[str(c)] for c in columns] for r in rows]
        self.run.log({name: wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    """An MLflow run: experiment = the graph's name, run name = the run dir's, params =
    the graph file flattened (`nodes.adv.params.lam`). A name character MLflow refuses
    becomes `_`."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    @classmethod
    def start(cls, plan: ExecutionPlan, run_dir: Path, *, resume: bool) -> Mlflow:
        from mlflow.tracking import MlflowClient

        folder = run_dir / "mlflow"
        folder.mkdir(parents=True, exist_ok=True)
        uri = mlflow_tracking_uri(plan.trainer, run_dir)
        client = MlflowClient(uri)
        run_id = _stored_id(folder, resume)
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            return cls(client, run_id)
        # the run's own store keeps its artifacts beside it, not in the working directory
        artifacts = ((folder / "artifacts").resolve().as_uri() if uri == _own_store(run_dir)
                     else None)
        found = client.get_experiment_by_name(plan.name)
        experiment = (found.experiment_id if found is not None
                      else client.create_experiment(plan.name, artifact_location=artifacts))
        run_id = client.create_run(experiment, run_name=run_dir.resolve().name).info.run_id
        _store_id(folder, run_id)
        tracker = cls(client, run_id)
        tracker.log_params(plan_document(plan))
        return tracker

    def log_params(self, document: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [Param(MLFLOW_NAME.sub("_", key), value[:MAX_PARAM_VAL_LENGTH])
                  for key, value in _flat(document)]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        rows = [Metric(MLFLOW_NAME.sub("_", name), value, now, step)
                for name, value in metrics.items()]
        for i in range(0, len(rows), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i:i + MAX_METRICS_PER_BATCH])

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """An artifact `<name>/step_<step>.json` in the layout of MLflow's `log_table`
        ({"columns", "data"}; written here: `log_table` needs pandas)."""
        import tempfile

        columns = list(rows[0]) if rows else []
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / f"step_{step}.json"
            file.write_text(json.dumps({"columns": columns,
                                        "data": [[r[c] for c in columns] for r in rows]}))
            self.client.log_artifact(self.run_id, str(file), name)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(value: object, key: str = "") -> Iterator[tuple[str, str]]:
    """(`a.b.c`, text) for every leaf of a graph document; lists as JSON."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _flat(v, f"{key}.{k}" if key else str(k))
        return
    yield key, value if isinstance(value, str) else json.dumps(value)
