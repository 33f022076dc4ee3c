"""The rows of a dataset's table, checked before a tokenizer meets them.

What a data source refuses when it loads and `flowgraph check --data` lists (FG510,
FG502, FG511): malformed text cells (null, mistyped, a message without a role or
content), a missing ground truth a node reads, preference pairs DPO learns nothing
from; and how a row's ground truth and named columns (a struct field by its dotted
name) are read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowgraph.errors import FlowgraphError
from flowgraph.spelling import Word, command

__all__ = [
    "check_columns",
    "check_rows",
    "field_value",
    "ground_truth_getter",
    "has_ground_truth",
    "missing_ground_truth",
    "missing_ground_truth_rows",
    "row_problems",
    "same_pairs",
]


def _rows_where(mask: pa.Array) -> list[int]:
    return [int(i) for i in np.flatnonzero(mask.to_numpy(zero_copy_only=False))]


def _cell_problem(path: str, column: str, rows: Sequence[int], n_rows: int, problem: str
                  ) -> str:
    """`dataset … row R (0-based), column C: problem (k of n rows)`."""
    many = f" ({len(rows)} of {n_rows} rows)" if len(rows) > 1 else ""
    return f"dataset `{path}` row {rows[0]} (0-based), column `{column}`: {problem}{many}"


_TEXT = "a string or a list of chat messages ({role, content} dicts)"


def _message_problems(values: pa.Array, prompt: bool) -> Iterator[tuple[list[int], str]]:
    """Rows of a chat-message list column that are null, hold a message without content
    or (a prompt) a role, or (a prompt) no message: (rows, problem) for each kind found.
    An empty response is counted at load instead (`same_pairs`)."""
    yield _rows_where(pc.is_null(values)), f"null; each row needs {_TEXT}"
    if prompt:
        yield (_rows_where(pc.equal(pc.fill_null(pc.list_value_length(values), 1), 0)),
               "an empty message list; a prompt needs at least one message")
    messages, parents = pc.list_flatten(values), pc.list_parent_indices(values)
    if not pa.types.is_struct(messages.type):
        yield [0], f"holds lists of {messages.type}, not chat messages ({{role, content}} dicts)"
        return
    for key in ("role", "content") if prompt else ("content",):
        if messages.type.get_field_index(key) < 0:
            yield [0] if len(messages) else [], f"its messages have no `{key}`"
            continue
        missing = pc.is_null(pc.struct_field(messages, key))
        rows = sorted({int(parents[i].as_py()) for i in _rows_where(missing)})
        yield rows, f"a message without `{key}`"


def _column_problems(values: pa.Array, prompt: bool) -> Iterator[tuple[list[int], str]]:
    """(rows, problem) of one text column: a string or a chat-message list per row."""
    kind = values.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        yield _rows_where(pc.is_null(values)), f"null; each row needs {_TEXT}"
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        yield from _message_problems(values, prompt)
    else:
        yield [0], f"holds {kind} values; each row needs {_TEXT}"


def row_problems(path: str, table: pa.Table, prompt: str, responses: Sequence[str] = ()
                 ) -> list[str]:
    """Every malformed row, one message per column and kind of problem, naming the file,
    the first such row and the column: no rows at all; a null, empty or mistyped
    `prompt` column cell, a null or mistyped response; a message without a role or
    content; an `extra_info` that is not a dict (struct) column. What `check --data`
    reports and a load refuses, before a tokenizer meets the row."""
    if table.num_rows == 0:
        return [f"dataset `{path}` has no rows"]
    out = []
    for column in (prompt, *responses):
        if column not in table.column_names:
            continue  # a missing column has its own message (`open_table`)
        values = table.column(column).combine_chunks()
        out += [_cell_problem(path, column, rows, table.num_rows, problem)
                for rows, problem in _column_problems(values, column == prompt) if rows]
    if "extra_info" in table.column_names:
        kind = table.schema.field("extra_info").type
        if not (pa.types.is_struct(kind) or pa.types.is_null(kind)):
            first = table.column("extra_info")[0].as_py()
            out.append(_cell_problem(
                path, "extra_info", [0], 1,
                f"holds {kind} values ({first!r}); verl's extra_info is a dict per row (a "
                f"struct column): write the dicts themselves, not their text"))
    return out


def check_rows(path: str, table: pa.Table, prompt: str, responses: Sequence[str] = ()
               ) -> None:
    """Refuse a table with a malformed row (`row_problems`): the first problem, and how
    many more `flowgraph check --data` lists."""
    problems = row_problems(path, table, prompt, responses)
    if problems:
        lister = command("check", Word("GRAPH"), [("data", True)])
        more = (f" (and {len(problems) - 1} more problems: {lister} lists them)"
                if len(problems) > 1 else "")
        raise FlowgraphError(problems[0] + more)


def missing_ground_truth_rows(path: str, table: pa.Table, needed_by: Sequence[str]
                              ) -> str | None:
    """The message for rows whose ground truth is null or NaN where nodes `needed_by`
    read it; None when every row has one. verl would score such a row against None."""
    column = _ground_truth_column(table)
    if column is None or not needed_by:
        return None
    whole = table.column(column.split(".")[0]).combine_chunks()
    values = pc.struct_field(whole, column.split(".")[1]) if "." in column else whole
    rows = _rows_where(pc.is_null(values, nan_is_null=True))
    if not rows:
        return None
    what = "null" if values[rows[0]].as_py() is None else "NaN"
    nodes = ", ".join(f"`{n}`" for n in needed_by)
    return _cell_problem(path, column, rows, table.num_rows,
                         f"the ground truth is missing ({what}); node {nodes} reads it") + (
        ". Fill it in, or drop such rows from the file")


def same_pairs(table: pa.Table, responses: Sequence[str]) -> tuple[list[int], list[int]]:
    """(rows whose responses are equal, rows with an empty response) of a preference
    table, by the text that is tokenized: DPO learns nothing from such a pair (its
    loss stays log 2)."""
    def text(v: Any) -> str:  # what `render_responses` tokenizes
        return v if isinstance(v, str) else "".join(m.get("content") or "" for m in v or [])

    texts = [[text(v) for v in r.values()] for r in table.select(list(responses)).to_pylist()]
    empty = [i for i, r in enumerate(texts) if any(not t for t in r)]
    same = [i for i, r in enumerate(texts) if len(set(r)) == 1 and r[0]]
    return same, empty


def field_value(row: dict[str, Any], name: str) -> Any:
    """`reward_model.style` of a row: a struct column's field, by its dotted name."""
    value: Any = row
    for part in name.split("."):
        value = value[part]
    return value


def check_columns(table: pa.Table, columns: Sequence[str], path: str) -> None:
    """Every column (or struct field) `columns` names is in the dataset."""
    for name in columns:
        kind: Any = table.schema
        for part in name.split("."):
            names = ([f.name for f in kind] if isinstance(kind, (pa.Schema, pa.StructType))
                     else [])
            if part not in names:
                raise FlowgraphError(
                    f"{path}: the param columns names `{name}`, which the dataset does not "
                    f"have; its columns: {', '.join(table.column_names)}")
            kind = kind.field(part).type


def has_ground_truth(table: pa.Table) -> bool:
    """Whether rows carry a ground truth (verl's `reward_model.ground_truth`, or flat)."""
    return ground_truth_getter(table) is not None


def missing_ground_truth(path: str, columns: Sequence[str], needed_by: Sequence[str]) -> str:
    """The message for a dataset without ground truth that a node needs."""
    nodes = ", ".join(f"`{n}`" for n in needed_by)
    return (
        f"dataset `{path}` has no ground truth, which node {nodes} needs; its columns: "
        f"{', '.join(columns)}; add a `ground_truth` column (or verl's struct column "
        f"`reward_model` with a `ground_truth` field), or use a reward that needs none "
        f"(fn: format, or a reward_model node) and unwire ground_truth"
    )


def _ground_truth_column(table: pa.Table) -> str | None:
    """Where rows keep their ground truth: verl's nested field first, then a flat column."""
    names = table.column_names
    if "reward_model" in names:
        kind = table.schema.field("reward_model").type
        if pa.types.is_struct(kind) and kind.get_field_index("ground_truth") >= 0:
            return "reward_model.ground_truth"
    return "ground_truth" if "ground_truth" in names else None


def ground_truth_getter(table: pa.Table) -> Callable[[dict[str, Any]], Any] | None:
    """How to read a row's ground truth (`_ground_truth_column`), as it is."""
    column = _ground_truth_column(table)
    if column == "reward_model.ground_truth":
        return lambda row: (row["reward_model"] or {}).get("ground_truth")
    return None if column is None else (lambda row: row["ground_truth"])
