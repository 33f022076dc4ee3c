"""What the pass tests share: the shipped graphs as editable documents, and their plans at
the small dims the numbers in the tests are of (see `plan_of`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowgraph.frontend import graph_from_yaml
from flowgraph.ir import Graph
from flowgraph.passes import compile_graph
from flowgraph.plan import ExecutionPlan

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
SMALL = {
    "ppo.yaml": ("dims.Bp=16", "nodes.update_actor.params.mini_batch_size=8",
                 "nodes.update_critic.params.mini_batch_size=8"),
    "grpo.yaml": ("dims.Bp=4", "dims.N=4", "nodes.update_actor.params.mini_batch_size=8"),
}
SMALL["grpo_lora.yaml"] = SMALL["grpo.yaml"]
"""graphs/ppo.yaml and grpo.yaml at the small dims the numbers in the tests are of (the
shipped graphs use larger batches, so that they learn), the test's own overrides after them."""


def read_doc(name: str) -> dict[str, Any]:
    data = yaml.safe_load((GRAPHS / f"{name}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def read_graph(doc: dict[str, Any]) -> Graph:
    return graph_from_yaml(yaml.safe_dump(doc, sort_keys=False), "test.yaml")


def small_overrides(file: str, overrides: Any = ()) -> list[str]:
    return [*SMALL.get(file, ()), *overrides]


def compile_plan(file: str | Graph, **kw: Any) -> ExecutionPlan:
    if isinstance(file, str):
        kw["overrides"] = small_overrides(file, kw.get("overrides", ()))
    result = compile_graph(GRAPHS / file if isinstance(file, str) else file, **kw)
    assert result.plan is not None, [d.one_line() for d in result.diagnostics]
    return result.plan


@pytest.fixture(scope="session")
def doc_of() -> Callable[[str], dict[str, Any]]:
    """`doc_of("ppo")`: graphs/ppo.yaml as a dict to edit."""
    return read_doc


@pytest.fixture(scope="session")
def graph_of() -> Callable[[dict[str, Any]], Graph]:
    """`graph_of(doc)`: the graph of an (edited) document."""
    return read_graph


@pytest.fixture(scope="session")
def small() -> Callable[..., list[str]]:
    """`small("ppo.yaml", overrides)`: the file's `SMALL` overrides, then `overrides`."""
    return small_overrides


@pytest.fixture(scope="session")
def plan_of() -> Callable[..., ExecutionPlan]:
    """`plan_of("ppo.yaml", **compile_graph_kw)`: the shipped graph's plan at its `SMALL`
    dims; `plan_of(graph, ...)`: a built graph's plan as it is."""
    return compile_plan


@pytest.fixture
def ppo_with_dead_nodes() -> Graph:
    """PPO plus a reward model whose score feeds only a token_reward nobody reads."""
    doc = read_doc("ppo")
    doc["models"]["rm"] = {"path": "builtin:tiny-lm"}
    seq = {p: f"gen.{p}" for p in ("prompts", "prompt_mask", "responses", "response_mask")}
    doc["nodes"]["dead_rm"] = {"kind": "reward_model", "model": "rm", "inputs": seq}
    doc["nodes"]["dead_tok"] = {"kind": "token_reward", "inputs": {
        "scores": "dead_rm.scores", "response_mask": "gen.response_mask"}}
    return read_graph(doc)
