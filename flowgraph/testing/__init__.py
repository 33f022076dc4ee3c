"""flowgraph.testing: helpers for testing graphs and custom nodes in your own CI.

* `check_file(path)` returns the `CheckResult` of a graph file and raises
  `GraphError` (listing every error) when it does not check clean;
* the pytest plugin (installed with flowgraph) provides the same as the fixture
  `flowgraph_check`;
* `flowgraph.testing.strategies` holds hypothesis strategies (imported on demand);
* `assert_honours_contract(kind)` property-tests a kind's implementation against its contract;
* `assert_policy_loss_honours_contract(loss)` property-tests a `@policy_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flowgraph.checker import CheckResult, check_graph
from flowgraph.diagnostics import render_text
from flowgraph.errors import FlowgraphError, GraphError
from flowgraph.frontend import load_graph
from flowgraph.testing.contracts import assert_honours_contract
from flowgraph.testing.losses import assert_policy_loss_honours_contract

__all__ = ["assert_honours_contract", "assert_policy_loss_honours_contract", "check_file"]


def check_file(path: str | Path, overrides: Sequence[str] = (), dp: int | None = None
               ) -> CheckResult:
    """Load and check a graph file; raise `GraphError` when it has errors."""
    graph, diags = load_graph(path, overrides)
    if graph is None:
        raise FlowgraphError(render_text(diags, lambda _: None))
    result = check_graph(graph, dp=dp)
    every = tuple(diags) + result.diagnostics
    if any(d.is_error for d in every):
        raise GraphError(every)
    return result
