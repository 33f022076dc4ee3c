"""`flowgraph.agent.routing`: the one rule that names a row's env, read by the rollout
and by `check --data` (FG609)."""

from __future__ import annotations

import pytest

from flowgraph.agent.routing import RouteError, bad_env_names, route, unrouted

NAMES = ("calc", "guess")


@pytest.mark.parametrize(("row", "route_by", "env"), [
    ({"env_class": "calc"}, "env_class", "calc"),
    ({"agent_name": "guess"}, "env_class", "guess"),                      # verl's column
    ({"env_class": None, "agent_name": "guess"}, "env_class", "guess"),   # null: absent
    ({"env_class": "calc", "agent_name": "guess"}, "env_class", "calc"),  # SkyRL's first
    ({"task": "guess", "env_class": "calc"}, "task", "guess"),
])
def test_a_row_is_routed_by_its_column(row: dict[str, str | None], route_by: str,
                                       env: str) -> None:
    assert unrouted(row, route_by, NAMES) is None
    assert route([row], route_by, NAMES, "node") == [env]


@pytest.mark.parametrize(("row", "route_by", "why"), [
    ({"env_class": "gues"}, "env_class", "names the env `gues` (column `env_class`), which "
     "the node does not declare in `envs`: did you mean `guess`?"),
    ({"agent_name": "tool_agent"}, "env_class", "names the env `tool_agent` (column "
     "`agent_name`), which the node does not declare in `envs`: the node declares calc, "
     "guess"),
    ({}, "env_class", "has no `env_class` (nor `agent_name`, verl's name) naming its env: "
     "add the column (one of calc, guess), or set `route_by` to the column that names it"),
    ({"agent_name": "calc"}, "task", "has no `task` naming its env: add the column (one of "
     "calc, guess), or set `route_by` to the column that names it"),
])
def test_a_row_that_names_no_declared_env_says_why(row: dict[str, str], route_by: str,
                                                   why: str) -> None:
    assert unrouted(row, route_by, NAMES) == why
    with pytest.raises(RouteError) as info:
        route([row], route_by, NAMES, "agent_rollout `agent`", offset=8)
    assert str(info.value) == f"agent_rollout `agent`: row 8 {why}"


def test_the_error_names_the_row_of_the_batch() -> None:
    with pytest.raises(RouteError, match=r"^node: row 9 names the env `x`"):
        route([{"env_class": "calc"}, {"env_class": "x"}], "env_class", NAMES, "node", 8)


def test_env_names_are_metric_name_parts() -> None:
    assert bad_env_names(["calc", "guess-v2", "math.gsm8k", "a/b", "", " x"]) == \
        ["a/b", "", " x"]
