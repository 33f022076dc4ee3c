"""Which env plays a row: an `agent_rollout` with several `envs` routes each dataset row
by a column (`route_by`: SkyRL's `env_class` by default; verl's `agent_name` where a row
has no `env_class`). One rule, read by the rollout when it starts a row's episodes and by
`flowgraph check --data` over every row of the dataset (FG609), so a row the check
accepts is a row the run routes.

Torch-free.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flowgraph.choices import ROUTE_ALIAS, ROUTE_COLUMN
from flowgraph.errors import FlowgraphError

__all__ = ["ENV_NAME_RE", "RouteError", "bad_env_names", "closest", "route", "unrouted"]

ENV_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
"""An env's name in `envs`: a part of metric names (`agent/<env>/turns`), so no `/`."""


class RouteError(FlowgraphError):
    """A row that names no env of the rollout's `envs` (or names none at all)."""


def closest(name: str, names: Iterable[str]) -> str:
    """`did you mean `x`?` for the declared env nearest `name`, else the declared ones."""
    known = sorted(names)
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f"did you mean `{near[0]}`?" if near else f"the node declares {', '.join(known)}"


def _named(row: Mapping[str, Any], route_by: str) -> tuple[str, object]:
    """(the column the row's env is read from, its value); the value is `None` where the
    row has neither that column nor, for the default column, verl's (a column a table
    holds for other rows is null in this one: as absent)."""
    value = row.get(route_by)
    if value is None and route_by == ROUTE_COLUMN:
        return ROUTE_ALIAS, row.get(ROUTE_ALIAS)
    return route_by, value


def unrouted(row: Mapping[str, Any], route_by: str, names: Iterable[str]) -> str | None:
    """Why `row` cannot be routed to one of `names` (the message's middle part: the row's
    value, the column, the closest name); None when it can."""
    known = list(names)
    column, value = _named(row, route_by)
    if value is None:
        alias = f" (nor `{ROUTE_ALIAS}`, verl's name)" if column == ROUTE_ALIAS else ""
        shown = route_by if column == ROUTE_ALIAS else column
        return (f"has no `{shown}`{alias} naming its env: add the column (one of "
                f"{', '.join(sorted(known))}), or set `route_by` to the column that names it")
    if str(value) in known:
        return None
    return (f"names the env `{value}` (column `{column}`), which the node does not declare "
            f"in `envs`: {closest(str(value), known)}")


def route(rows: Sequence[Mapping[str, Any]], route_by: str, names: Iterable[str],
          where: str, offset: int = 0) -> list[str]:
    """Each row's env name; RouteError naming the first row (its number in the step's
    batch: `offset` + its place) that names none of `names`."""
    known = list(names)
    out = []
    for i, row in enumerate(rows):
        why = unrouted(row, route_by, known)
        if why is not None:
            raise RouteError(f"{where}: row {offset + i} {why}")
        out.append(str(_named(row, route_by)[1]))
    return out


def bad_env_names(names: Iterable[str]) -> list[str]:
    """The names of `envs` that cannot be part of a metric name."""
    return [n for n in names if not ENV_NAME_RE.match(n)]
