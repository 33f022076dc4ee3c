"""Property tests of the checker with `flowgraph.testing.strategies`.

(a) random well-formed pipelines check clean and survive `graph_to_yaml` -> load;
(b) one random contract-breaking edit of a clean graph file is always reported, with
    the expected code, on the expected line, naming the expected edge;
(c) every diagnostic of a mutated file points at a line of that file.

Examples are derandomized (the same on every run, so CI is stable) and few enough
that the module runs in well under a minute; raise `max_examples` locally to dig.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowgraph.checker import check_graph
from flowgraph.diagnostics import Diagnostic
from flowgraph.frontend import graph_from_yaml, graph_to_yaml, load_graph
from flowgraph.ir import Graph, NodeSpec, Param, Params, PortRef
from flowgraph.testing.strategies import MUTATIONS, Mutation, graph_texts, graphs, mutate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "graphs").glob("*.yaml"))]
FILE = "mutated.yaml"

CI = settings(max_examples=60, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])


def check_text(text: str) -> list[Diagnostic]:
    graph, diags = load_graph(FILE, text=text)
    if graph is not None:
        diags += list(check_graph(graph).diagnostics)
    return diags


def describe(diags: list[Diagnostic]) -> list[tuple[str, int | None, str | None, str]]:
    return [(d.code, d.pos.line if d.pos else None, d.edge, d.message) for d in diags]


# --- (a) well-formed graphs ------------------------------------------------------------


@CI
@given(graphs())
def test_random_pipelines_check_clean(graph: Graph) -> None:
    result = check_graph(graph)
    assert result.ok, describe(list(result.errors))
    # Extra nodes may go unused; nothing else is worth a warning.
    assert {d.code for d in result.diagnostics} <= {"FG108"}


@CI
@given(graphs())
def test_graph_to_yaml_round_trips(graph: Graph) -> None:
    text = graph_to_yaml(graph)
    assert graph_from_yaml(text) == graph, text


@pytest.mark.parametrize("value", ["1E2", "1e-5", "+3e8", "yes", "null", "~", "1_000",
                                   "2001-12-14", ".inf", "", " padded ", "a: b", "*x"])
def test_yaml_lookalike_strings_round_trip(value: str) -> None:
    # `1E2` was written plain and read back as the float 100.0 (the reader takes
    # YAML 1.1's string `1e-5` for a number); found by test_graph_to_yaml_round_trips.
    node = NodeSpec("adv", "gae", (("values", PortRef("v", "values")),),
                    params=Params((Param("note", value),)))
    graph = Graph(name=value, nodes=(node,))
    assert graph_from_yaml(graph_to_yaml(graph)) == graph


# --- (b), (c) mutations -----------------------------------------------------------------


def assert_reported(m: Mutation, diags: list[Diagnostic]) -> None:
    errors = [d for d in diags if d.is_error]
    for code in m.codes:
        hits = [d for d in errors if d.code == code and d.pos is not None
                and d.pos.line == m.line and (m.edge is None or d.edge == m.edge)]
        assert hits, (f"{m.what}: expected {code} on line {m.line} about {m.edge}",
                      describe(errors), m.text)


def assert_located(m: Mutation, diags: list[Diagnostic]) -> None:
    lines = len(m.text.splitlines())
    for d in diags:
        assert d.pos is not None, (m.what, d)
        assert d.pos.file == FILE and 1 <= d.pos.line <= lines and d.pos.col >= 1, (m.what, d)


@settings(CI, max_examples=100)
@given(graph_texts().flatmap(mutate))
def test_a_mutation_of_a_random_graph_is_reported(m: Mutation) -> None:
    diags = check_text(m.text)
    assert_reported(m, diags)
    assert_located(m, diags)


@settings(CI, max_examples=40)
@given(st.sampled_from(EXAMPLES).flatmap(mutate))
def test_a_mutation_of_an_example_graph_is_reported(m: Mutation) -> None:
    # The examples use YAML anchors and merge keys (`<<: *sequences`): one edit may
    # change several nodes, the expected report is among them.
    diags = check_text(m.text)
    assert_reported(m, diags)
    assert_located(m, diags)


@pytest.mark.parametrize("kind", sorted(MUTATIONS))
def test_every_mutation_kind_applies_and_is_reported(kind: str) -> None:
    # Each kind at least a few times, whatever the random mix above chose.
    @settings(CI, max_examples=8)
    @given(st.sampled_from(EXAMPLES).flatmap(lambda text: mutate(text, (kind,))))
    def run(m: Mutation) -> None:
        diags = check_text(m.text)
        assert_reported(m, diags)
        assert_located(m, diags)

    run()
