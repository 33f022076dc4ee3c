"""Datasets given as Python objects or hub ids, where a graph names a dataset file.

    g.data("train", "prompts", df)                        # a pandas DataFrame
    g.data("train", "prompts", pa_table, eval_path=test_df)
    g.data("train", "preferences", load_dataset(...))     # a DatasetDict: train + test
    g.data("train", "prompts", "trl-lib/tldr")            # a hub id

An object (a pyarrow Table, a pandas DataFrame, a `datasets.Dataset`, a `DatasetDict`
whose `test` split is the held-out data, as `eval_path` is) is copied into a pyarrow
table when `g.data` is called, so a DataFrame changed afterwards is not what runs, and
its content fingerprinted (sha256). The graph names it by a key, `memory:<sha256[:16]>
(pandas DataFrame, 1,000 rows × 3 columns)`: plain data, so the IR, the checker and the
plan stay as they are, and the key says what it stands for wherever it is printed. The
table itself is held by this process (`held_table`).

When a run starts (`write_tables`, called by `flowgraph.compilers.run`), each in-memory
table and each hub dataset is written once into the run dir as
`data/<source>[-eval]-<sha256[:16]>.parquet`, and the plan that runs (and the run dir's
plan.json) names that file: fsdp ranks, Ray workers and a later `flowgraph run
runs/x/plan.json --resume` read the same rows, and a resume with other rows is refused
like any changed data path (the file name holds the fingerprint). A plan file that
names an in-memory table no process holds (compiled in another Python session) says
so. pandas and `datasets` are optional: they are imported only when such an object or
a hub id is met.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgraph.errors import FlowgraphError
from flowgraph.paths import MEMORY_PREFIX, is_hub_dataset

if TYPE_CHECKING:
    from flowgraph.ir import DataSpec
    from flowgraph.plan import ExecutionPlan

__all__ = ["MEMORY_PREFIX", "HeldTable", "held_table", "hold", "is_memory", "load_hub",
           "write_tables"]

@dataclass(frozen=True, slots=True)
class HeldTable:
    """A table given as a Python object, copied when the graph was built."""

    what: str
    """What it was: `pandas DataFrame, 1,000 rows × 3 columns`."""
    sha256: str
    """Of the table's Arrow IPC stream: equal rows, columns and types, equal digest."""
    table: Any = field(compare=False, repr=False)
    """The pyarrow Table."""

    @property
    def key(self) -> str:
        """The path the graph names it by."""
        return f"{MEMORY_PREFIX}{self.sha256[:16]} ({self.what})"


_HELD: dict[str, HeldTable] = {}
"""sha256[:16] -> the table: the tables this process's graphs name, for the life of the
process (the same rows given twice, a notebook cell run again, are held once)."""


def is_memory(path: str) -> bool:
    return path.startswith(MEMORY_PREFIX)


def _module_class(obj: Any) -> tuple[str, str]:
    cls = type(obj)
    return cls.__module__.split(".")[0], cls.__name__


def _as_arrow(obj: Any, what_for: str) -> tuple[Any, str]:
    """(a pyarrow Table copied from `obj`, what `obj` was called)."""
    import pyarrow as pa

    module, name = _module_class(obj)
    if isinstance(obj, pa.Table):
        return obj, "pyarrow Table"
    if module == "pandas" and name == "DataFrame":
        return pa.Table.from_pandas(obj, preserve_index=False), "pandas DataFrame"
    if module == "datasets" and name == "Dataset":
        # `[:]` in arrow format: the rows after any select / shuffle (its indices)
        return obj.with_format("arrow")[:], "datasets.Dataset"
    if module == "datasets" and name == "IterableDataset":
        raise FlowgraphError(
            f"{what_for}: a streaming datasets.IterableDataset cannot be read twice or "
            "resumed; make it a Dataset first (`Dataset.from_generator(lambda: (yield from "
            "ds.take(n)), features=ds.features)`), or write it to a parquet file")
    raise FlowgraphError(
        f"{what_for}: expected a dataset file path, a hub id (`org/name`), a pyarrow Table, "
        f"a pandas DataFrame or a datasets.Dataset / DatasetDict, got {module}.{name}")


def _fingerprint(table: Any) -> str:
    import pyarrow as pa

    sink = io.BytesIO()
    # the same rows, however they were chunked and whatever the schema's metadata says
    # (pandas' index, datasets' features)
    table = table.combine_chunks().replace_schema_metadata(None)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def _hold_one(obj: Any, what_for: str) -> str:
    import pyarrow as pa

    try:
        table, kind = _as_arrow(obj, what_for)
    except (pa.ArrowException, ValueError) as exc:  # a column pyarrow cannot type
        raise FlowgraphError(f"{what_for}: its rows cannot be read as a table: "
                             f"{str(exc).splitlines()[0]}; give each column one type (a "
                             "string, a number, a list of {role, content} dicts)") from exc
    held = HeldTable(f"{kind}, {table.num_rows:,} rows × {table.num_columns} columns",
                     _fingerprint(table), table)
    _HELD.setdefault(held.sha256[:16], held)
    return held.key


def hold(obj: Any, what_for: str) -> tuple[str, str | None]:
    """(the key of `obj`'s rows, the key of its held-out rows or None): a DatasetDict
    gives its `train` split and its `test` split; any other object, itself."""
    module, name = _module_class(obj)
    if module == "datasets" and name in ("DatasetDict", "IterableDatasetDict"):
        if "train" not in obj:
            raise FlowgraphError(f"{what_for}: the DatasetDict has no `train` split; its "
                                 f"splits: {', '.join(obj)}; pass the split to train on "
                                 "(`ds['<split>']`)")
        test = obj.get("test")
        return (_hold_one(obj["train"], f"{what_for} (split train)"),
                None if test is None else _hold_one(test, f"{what_for} (split test)"))
    return _hold_one(obj, what_for), None


def held_table(path: str) -> Any:
    """The pyarrow Table a `memory:` key names; an error saying what it was when this
    process does not hold it (a plan compiled in another Python session)."""
    held = _HELD.get(path[len(MEMORY_PREFIX):][:16])
    if held is None:
        raise FlowgraphError(
            f"dataset `{path}` was an in-memory table of the Python session that compiled "
            "this plan, and was never written to a file: run the plan from that session "
            "(flowgraph.run(plan)), run the plan.json of a run dir it ran in (it names the "
            "written file, runs/<run>/data/…parquet), or give the data as a file path")
    return held.table


def load_hub(path: str, what_for: str) -> tuple[Any, Any | None]:
    """(train rows, test rows or None) of hub dataset `path`, by `datasets.load_dataset`;
    an error saying why not (no network, offline mode, no such dataset)."""
    try:
        import datasets
    except ImportError as exc:
        raise FlowgraphError(
            f"{what_for}: `{path}` is no local file, so it names a Hugging Face hub dataset, "
            "and reading one needs the `datasets` package: pip install 'flowgraph[data]'"
        ) from exc
    try:
        splits = datasets.load_dataset(path)
    # load_dataset raises ConnectionError offline, DatasetNotFoundError (a FileNotFoundError),
    # ValueError for a bad config: each means the same to the user, said once here
    except Exception as exc:
        offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
                   if os.environ.get(v, "").lower() in ("1", "true", "yes", "on")]
        why = (f" ({' and '.join(offline)} set: offline mode)" if offline else "")
        raise FlowgraphError(
            f"{what_for}: `{path}` is no local file, so it was looked up as a Hugging Face "
            f"hub dataset, which failed{why}: {str(exc).splitlines()[0] if str(exc) else exc!r}. "
            "Where this machine has no network, load it where there is one and save it "
            f"(`datasets.load_dataset({path!r})['train'].to_parquet('train.parquet')`), "
            "then give that file's path, or pass the Dataset object itself") from exc
    if "train" not in splits:
        raise FlowgraphError(f"{what_for}: hub dataset `{path}` has no `train` split; its "
                             f"splits: {', '.join(splits)}")
    test = _as_arrow(splits["test"], what_for)[0] if "test" in splits else None
    return _as_arrow(splits["train"], what_for)[0], test


def _write(table: Any, folder: Path, stem: str) -> str:
    """`folder/data/<stem>-<sha256[:16]>.parquet`, written once (atomically: fsdp ranks
    started by torchrun each write it)."""
    import pyarrow.parquet as pq

    out = folder.resolve() / "data" / f"{stem}-{_fingerprint(table)[:16]}.parquet"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    return str(out)


def _written(d: DataSpec, folder: Path) -> DataSpec:
    """`d` with its in-memory or hub rows written into `folder/data` and named there."""
    what_for = f"data source `{d.name}` ({d.pos})"
    params = d.params.to_python()
    eval_path = params.get("eval_path")
    path, held_out = d.path, eval_path if isinstance(eval_path, str) else None
    if is_memory(path):
        path = _write(held_table(path), folder, d.name)
    elif is_hub_dataset(path):
        train, test = load_hub(path, what_for)
        path = _write(train, folder, d.name)
        if held_out is None and test is not None:
            held_out = _write(test, folder, f"{d.name}-eval")
    if held_out is not None and is_memory(held_out):
        held_out = _write(held_table(held_out), folder, f"{d.name}-eval")
    elif held_out is not None and is_hub_dataset(held_out):  # its test split, or its only
        train, test = load_hub(held_out, f"{what_for}, eval_path")
        held_out = _write(train if test is None else test, folder, f"{d.name}-eval")
    if path == d.path and held_out == eval_path:
        return d
    given = {**params, "eval_path": held_out} if held_out is not None else params
    return replace(d, path=path, params=type(d.params).of(given, d.pos))


def write_tables(plan: ExecutionPlan, run_dir: Path) -> ExecutionPlan:
    """`plan` naming files in `run_dir/data` for its in-memory tables and hub datasets
    (written there once); the plan itself when it has none."""
    data = tuple(_written(d, run_dir) for d in plan.data)
    if data == plan.data:
        return plan
    return replace(plan, run=replace(plan.run, data=data))
