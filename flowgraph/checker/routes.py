"""Rows, where they come from and where they go: the data source whose rows reach a
node's input (`row_source`), and FG609 under `check --data`, the rows an agent rollout
with several `envs` would route to none of them (`route_problems`), read by the rule
the rollout routes by (`flowgraph.agent.routing`). Reads the datasets (pyarrow): the
CLI imports it with `flowgraph.checker.data`, only for `--data` and before `run` loads
the models.
"""

from __future__ import annotations

from typing import Any

from flowgraph.agent.routing import unrouted
from flowgraph.builtin_models import held_out_path
from flowgraph.choices import ROUTE_COLUMN
from flowgraph.data.held import is_memory
from flowgraph.data.readers import open_table
from flowgraph.diagnostics import Diagnostic
from flowgraph.errors import FlowgraphError
from flowgraph.ir import DataSpec, Graph, NodeSpec, Param, Params
from flowgraph.paths import is_local

__all__ = ["route_problems", "row_source"]


def row_source(graph: Graph, node: NodeSpec, port: str = "row") -> str | None:
    """The data source whose rows reach `node`'s input `port`: back along the wiring, each
    node passing on its input of the output's name (`reward.row` <- `gen.row` <-
    `train.row`); None when it starts at no data source."""
    ref, seen = node.input(port), set()
    while ref is not None and (ref.node, ref.port) not in seen:
        seen.add((ref.node, ref.port))
        if graph.data_source(ref.node) is not None:
            return ref.node
        producer = graph.node(ref.node)
        ref = producer.input(ref.port) if producer is not None else None
    return None


def route_problems(graph: Graph, d: DataSpec) -> list[Diagnostic]:
    """FG609 for each agent rollout with several `envs` whose rows come from `d`, on each
    of `d`'s local tables (its held-out one too: evaluation routes its rows the same way)
    that holds a row naming no env the node declares, by the rule the rollout routes by
    (`flowgraph.agent.routing`); at the node's `envs` line, naming the first such row,
    its value and the closest name."""
    nodes = [(n, p) for n in graph.nodes if (p := n.params.find("envs")) is not None
             and isinstance(p.value, Params) and p.value.items
             and row_source(graph, n) == d.name]
    if not nodes:
        return []
    params = d.params.to_python()
    held = held_out_path(d.path, str(params["eval_path"]) if params.get("eval_path") else None)
    diags = []
    for path in dict.fromkeys(p for p in (d.path, held) if p is not None):
        if not (is_memory(path) or is_local(path)):
            continue
        try:
            rows = open_table(path, str(params.get("format", "auto")), []).to_pylist()
        except FlowgraphError:
            continue  # the dataset's own check says why
        for node, envs in nodes:
            diags += _unrouted(node, envs, rows, path)
    return diags


def _unrouted(node: NodeSpec, envs: Param, rows: list[dict[str, Any]], path: str
              ) -> list[Diagnostic]:
    assert isinstance(envs.value, Params)
    names = list(envs.value.names())
    given = node.params.get("route_by", ROUTE_COLUMN)
    route_by = given if isinstance(given, str) else ROUTE_COLUMN
    bad = [(i, why) for i, row in enumerate(rows)
           if (why := unrouted(row, route_by, names)) is not None]
    if not bad:
        return []
    i, why = bad[0]
    more = f" ({len(bad)} of its {len(rows)} rows name none of them)" if len(bad) > 1 else ""
    return [Diagnostic(
        "FG609", "error", f"`{node.name}` routes each row to one of its envs "
        f"({', '.join(names)}) by `{route_by}`: row {i} (0-based) of dataset `{path}` {why}"
        f"{more}", envs.pos, node=node.name,
        hint="declare the env under `envs` by the name the rows use, or fix the rows")]
