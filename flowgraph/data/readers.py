"""A dataset's table, as the data sources and `flowgraph check --data` read it.

Files are parquet (`.parquet`, `.pq`) or JSON lines (`.jsonl`, `.json`); `builtin:<task>`
is a generated table (`flowgraph.data.tasks`); a `memory:` key names a table given in
Python or a hub dataset (`flowgraph.data.held`). Preference tables in TRL's
implicit-prompt format (`chosen` and `rejected` only) get their prompt here
(`with_prompt`, TRL's `extract_prompt`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from flowgraph.builtin_models import BUILTIN_PREFIX
from flowgraph.data.held import held_table, is_memory
from flowgraph.data.rows import check_rows
from flowgraph.data.tasks import builtin_columns
from flowgraph.errors import FlowgraphError

__all__ = ["open_table", "shared_prompt", "with_prompt"]

_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


def _read_table(path: str, fmt: str) -> pa.Table:
    if path.startswith(BUILTIN_PREFIX) and fmt in ("auto", "builtin"):
        return pa.table(builtin_columns(path[len(BUILTIN_PREFIX) :]))
    if is_memory(path):  # a DataFrame or Dataset given in Python (`flowgraph.data.held`)
        table: pa.Table = held_table(path)
        return table
    file = Path(path).expanduser()
    fmt = _SUFFIXES.get(file.suffix, "") if fmt == "auto" else fmt
    if fmt not in ("parquet", "jsonl"):
        raise FlowgraphError(
            f"dataset `{path}`: cannot tell its format from the suffix; "
            f"set the param format to parquet or jsonl"
        )
    if not file.is_file():
        raise FlowgraphError(f"dataset file `{path}` does not exist")
    try:
        return pq.read_table(file) if fmt == "parquet" else pa_json.read_json(file)
    except (OSError, pa.ArrowException) as exc:
        raise FlowgraphError(f"cannot read dataset `{path}` as {fmt}: {exc}") from exc


def open_table(path: str, fmt: str, required: Sequence[str]) -> pa.Table:
    """The dataset's table; it must have the `required` columns."""
    table = _read_table(path, fmt)
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise FlowgraphError(
            f"dataset `{path}` has no column {', '.join(f'`{c}`' for c in missing)}; "
            f"its columns: {', '.join(table.column_names)}"
        )
    return table


def shared_prompt(chosen: Any, rejected: Any) -> int:
    """How much of a pair is its prompt: TRL 1.16's `extract_prompt`, as it is — the
    first position where `chosen` and `rejected` (message lists, or strings) differ,
    one back over a space before it; the last shared position when one is a prefix of
    the other."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return idx


def with_prompt(path: str, table: pa.Table) -> pa.Table:
    """A preference table in TRL's explicit-prompt layout: `table` itself when it has a
    `prompt` column; else (TRL's implicit prompt) `chosen` and `rejected` cut where they
    first differ (`shared_prompt`): the shared messages are the prompt, the rest each
    response."""
    if "prompt" in table.column_names:
        return table
    check_rows(path, table, "chosen", ["rejected"])
    rows = table.select(["chosen", "rejected"]).to_pylist()
    cuts = [shared_prompt(r["chosen"], r["rejected"]) for r in rows]
    columns = {"prompt": [r["chosen"][:i] for r, i in zip(rows, cuts, strict=True)],
               "chosen": [r["chosen"][i:] for r, i in zip(rows, cuts, strict=True)],
               "rejected": [r["rejected"][i:] for r, i in zip(rows, cuts, strict=True)]}
    rest = [c for c in table.column_names if c not in columns]
    return pa.table({**columns, **{c: table.column(c) for c in rest}})
