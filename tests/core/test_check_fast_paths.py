"""The checker's short ways at scale, each against the long way it stands for.

`check_graph` unifies a node once per key and replays that on every later node of its
kind with the same key (`_KindPlan.recall`), makes one object of equal output shapes so
that copies meet (`ShapeResult.port_shape`), skips the cycle search when a topological
order covers every node (`check._acyclic`), skips `_check_ref` for references to real
outputs (`_produced`) and the unwired-input walk when every input a kind may need is
wired (`_Ports.needed`), and reads kinds' params through per-kind tables;
`topo_order` walks numbers instead of names. Each must give exactly what the long
way gives: the same diagnostics (codes, positions, messages, order) and the same
inferred facts, dicts in the same order. Checked on every file under graphs/, on the
benchmark's graph, on graphs built to hit the corners, and on random graphs and their
mutations.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowgraph.check as check
import flowgraph.check.batch as batch
import flowgraph.check.shapes as shapes
import flowgraph.check.structure as structure
from flowgraph.check import CheckResult, check_graph
from flowgraph.check.structure import Resolved
from flowgraph.contracts import TensorSpec
from flowgraph.frontend import load_graph
from flowgraph.ir import Graph, NodeSpec, Params, ParamValue, PortRef
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.registry import KindSpec, ParamSpec, PortSpec, Registry
from flowgraph.testing.strategies import graph_texts, mutate

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted((ROOT / "graphs").glob("**/*.yaml"))
EXAMPLES = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "graphs").glob("*.yaml"))]
CI = settings(max_examples=40, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])


# --- the long way: each short way off, each rewritten walk as it was ---------------------


def topo_order(graph: Graph, skip: set[str]) -> list[NodeSpec]:
    """Kahn's algorithm by name, as `shapes.topo_order` was before it walked numbers."""
    names = {n.name for n in graph.nodes} - skip
    indeg = dict.fromkeys(names, 0)
    succ: dict[str, list[str]] = {n: [] for n in names}
    for node in graph.nodes:
        if node.name not in names:
            continue
        for _, ref in node.inputs:
            if ref.node in names:
                indeg[node.name] += 1
                succ[ref.node].append(node.name)
    ready = deque(n.name for n in graph.nodes if n.name in names and indeg[n.name] == 0)
    order: list[str] = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for s in succ[name]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    by_name = {n.name: n for n in graph.nodes}
    return [by_name[n] for n in order]


def param_value(r: Resolved, name: str) -> ParamValue:
    p = r.spec.params.find(name)
    if p is not None:
        return p.value
    spec = r.kind.param(name) if r.kind else None
    return spec.default if spec else None


_ports = structure._PortNames.get  # the short way, under `long_way`'s wrapper


@contextmanager
def long_way() -> Iterator[None]:
    """Check without any short way: no replays, no shared shapes, no `_fits`, a cycle
    search on every graph, `_check_ref` on every reference, the unwired-input walk on
    every node, the walks that were rewritten as they were."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shapes._KindPlan, "recall", lambda self, key: None)
        mp.setattr(shapes.ShapeResult, "port_shape",
                   lambda self, dims, spec: shapes.PortShape(dims, spec.shape.variadic, spec))
        mp.setattr(shapes, "_fits", lambda *args: None)
        mp.setattr(check, "_acyclic", lambda *args: False)
        mp.setattr(structure, "_produced", lambda *args: set())
        mp.setattr(structure._PortNames, "get",
                   lambda self, kind: dataclasses.replace(_ports(self, kind), needed=-1))
        mp.setattr(KindSpec, "param",
                   lambda self, name: next((p for p in self.params if p.name == name), None))
        for module in (structure, shapes, batch):
            mp.setattr(module, "param_value", param_value)
        for module in (check, shapes):
            mp.setattr(module, "topo_order", topo_order)
        yield


def told(result: CheckResult) -> tuple[object, ...]:
    """Everything a check tells, dicts with their order."""
    s, env = result.shapes, result.shapes.env
    return (result.diagnostics, s.edges, [*s.outputs.items()], [*s.batch.items()],
            [*env.values.items()], [*env.locals_.items()], [*env.why.items()])


def both_ways(graph: Graph, registry: Registry | None = None) -> tuple[object, ...]:
    short = told(check_graph(graph, registry))
    with long_way():
        long = told(check_graph(graph, registry))
    assert short == long
    return short


def both_ways_text(text: str) -> None:
    graph, _ = load_graph("f.yaml", text=text)
    if graph is not None:
        both_ways(graph)


@contextmanager
def counting(calls: Counter[str]) -> Iterator[None]:
    """Count replays (by kind) and skipped cycle searches (as `acyclic`)."""
    recall, acyclic = shapes._KindPlan.recall, check._acyclic

    def counted_recall(self: shapes._KindPlan, key: tuple[object, ...]) -> Any:
        found = recall(self, key)
        calls[self.kind.name] += found is not None
        return found

    def counted_acyclic(*args: Any) -> bool:
        calls["acyclic"] += acyclic(*args)
        return acyclic(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shapes._KindPlan, "recall", counted_recall)
        mp.setattr(check, "_acyclic", counted_acyclic)
        yield


# --- graph files, the benchmark, random graphs -------------------------------------------


@pytest.mark.parametrize("path", GRAPHS, ids=[str(p.relative_to(ROOT)) for p in GRAPHS])
def test_every_graph_file_checks_the_same_both_ways(path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Two broken graphs use plugin kinds from tests/plugins (see test_graphs_dir.py).
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    both_ways_text(path.read_text(encoding="utf-8"))


def _synthetic(monkeypatch: pytest.MonkeyPatch, nodes: int) -> str:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_check import synthetic_graph

    return str(synthetic_graph(nodes))


def test_the_benchmark_graph_is_replayed_and_checks_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    graph, _ = load_graph("f.yaml", text=_synthetic(monkeypatch, 710))
    assert graph is not None
    calls: Counter[str] = Counter()
    with counting(calls):
        result = check_graph(graph)
    assert result.diagnostics == ()
    # 101 blocks of 7 nodes: every node but the first of each kind (and the second KL
    # penalty, the first to read a KL penalty's output) is a replay; no cycle search.
    assert +calls == {"logprob": 201, "values": 100, "kl_penalty": 99, "gae": 100,
                      "ppo_actor_update": 100, "ppo_critic_update": 100, "acyclic": 1}
    assert both_ways(graph) == told(result)


@CI
@given(graph_texts())
def test_random_graphs_check_the_same_both_ways(text: str) -> None:
    both_ways_text(text)


@settings(CI, max_examples=80)
@given(st.one_of(graph_texts(), st.sampled_from(EXAMPLES)).flatmap(mutate))
def test_mutated_graphs_check_the_same_both_ways(m: Any) -> None:
    both_ways_text(m.text)


def test_mutations_of_the_benchmark_graph_check_the_same_both_ways(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Broken copies among replayed ones: the break is unified in full, where it is.
    text = _synthetic(monkeypatch, 80)

    @settings(CI, max_examples=30)
    @given(mutate(text))
    def check_one(m: Any) -> None:
        both_ways_text(m.text)

    check_one()


# --- corners the random graphs seldom reach ----------------------------------------------

HEAD = """\
version: 1
name: corners
dims: {Bp: 4, N: 2, P: 8, T: 6}
models:
  actor: {path: "builtin:tiny-lm", trainable: true}
data:
  train: {kind: prompts, path: "builtin:arith"}
nodes:
"""
SEQ = ("prompts: {g}.prompts, prompt_mask: {g}.prompt_mask, responses: {g}.responses, "
       "response_mask: {g}.response_mask")


def _gen(name: str, params: str = "") -> str:
    return (f"  {name}:\n    kind: generate\n    model: actor\n    inputs: "
            "{prompts: train.input_ids, prompt_mask: train.attention_mask}\n"
            + (f"    params: {{{params}}}\n" if params else ""))


def _lp(name: str, gen: str, inputs: str | None = None) -> str:
    return (f"  {name}:\n    kind: logprob\n    model: actor\n"
            f"    inputs: {{{inputs or SEQ.format(g=gen)}}}\n")


def _update(gen: str, lp: str) -> str:
    return (f"  up_{lp}:\n    kind: ppo_actor_update\n    model: actor\n    inputs: "
            f"{{{SEQ.format(g=gen)}, old_log_prob: {lp}.log_prob, advantages: adv.advantages}}\n")


ADV = ("  adv:\n    kind: grpo\n    inputs: {scores: rw.scores, index: g1.index, "
       "response_mask: g1.response_mask}\n"
       "  rw:\n    kind: reward\n    inputs: {responses: g1.responses, "
       "response_mask: g1.response_mask, ground_truth: g1.ground_truth}\n")

CORNERS = {
    # Rollouts whose local `n` is bound by a param (the key holds it), by an equal
    # param, by another, and by the kind's default, twice; log-probs of each.
    "n from params": HEAD + _gen("g1", "n: 3") + _gen("g2", "n: 3") + _gen("g3", "n: 5")
    + _gen("g4") + _gen("g5") + ADV + "".join(_lp(f"lp{i}", f"g{i}") for i in range(1, 6))
    + "".join(_update(f"g{i}", f"lp{i}") for i in range(1, 6)),
    # The same inputs written in other orders.
    "input order": HEAD + _gen("g1") + ADV + _lp("a", "g1") + _lp(
        "b", "g1", "response_mask: g1.response_mask, responses: g1.responses, "
                   "prompt_mask: g1.prompt_mask, prompts: g1.prompts")
    + _lp("c", "g1") + _update("g1", "a") + _update("g1", "b") + _update("g1", "c"),
    # Copies whose inputs break the same way: never replayed, each reported where it is.
    "the same break, twice": HEAD + _gen("g1") + ADV + _lp(
        "a", "g1", SEQ.format(g="g1").replace("prompts: g1.prompts", "prompts: train.input_ids"))
    + _lp("b", "g1", SEQ.format(g="g1").replace("prompts: g1.prompts",
                                                "prompts: train.input_ids"))
    + _update("g1", "a") + _update("g1", "b"),
    # Copies reading outputs that do not exist, and a producer that does not.
    "unknown producers": HEAD + _gen("g1") + ADV
    + _lp("a", "g1", SEQ.format(g="g1").replace("g1.responses", "g1.response"))
    + _lp("b", "g1", SEQ.format(g="g1").replace("g1.responses", "g1.response"))
    + _lp("c", "g1", SEQ.format(g="g1").replace("g1.responses", "nowhere.responses"))
    + _lp("d", "g1", SEQ.format(g="g1").replace("g1.responses", "nowhere.responses"))
    + _update("g1", "a") + _update("g1", "c")
    + (_gen("g2") + _gen("g3")).replace("train.input_ids", "train.input_id"),
    # Copies of one node but for two inputs' names: the key tells them apart.
    "ports swapped": HEAD + _gen("g1") + ADV + _lp("a", "g1") + _lp(
        "b", "g1", "prompts: g1.prompts, prompt_mask: g1.prompt_mask, "
                   "response_mask: g1.responses, responses: g1.response_mask")
    + _update("g1", "a") + _update("g1", "b"),
    # An optional input a param makes necessary, unwired, and one it does not.
    "inputs a param requires": HEAD + _gen("g1") + ADV
    + "  r2:\n    kind: reward\n    inputs: {responses: g1.responses, "
      "response_mask: g1.response_mask}\n"
    + "  r3:\n    kind: reward\n    inputs: {responses: g1.responses, "
      "response_mask: g1.response_mask}\n    params: {fn: format}\n"
    + _lp("a", "g1") + _update("g1", "a"),
    # A cycle: the search runs, its nodes are left out of the unification.
    "a cycle among copies": HEAD + _gen("g1") + ADV + _lp("a", "g1")
    + _lp("b", "g1", SEQ.format(g="g1").replace("g1.responses", "c.responses"))
    + _lp("c", "g1", SEQ.format(g="g1").replace("g1.responses", "b.responses"))
    + _update("g1", "a"),
    # A node named like the data source, and a name used twice.
    "names used twice": HEAD + _gen("g1") + ADV + _lp("a", "g1") + _lp("a", "g1")
    + _lp("train", "g1") + _update("g1", "a"),
}


@pytest.mark.parametrize("name", sorted(CORNERS))
def test_corner_graphs_check_the_same_both_ways(name: str) -> None:
    graph, diags = load_graph("f.yaml", text=CORNERS[name])
    assert graph is not None, diags
    both_ways(graph)


def test_a_node_listed_twice_is_unified_twice_the_same_both_ways() -> None:
    # One NodeSpec object twice in `Graph.nodes` (FG101): unified a second time with
    # its locals already bound, which the key must tell from a fresh copy.
    graph, _ = load_graph("f.yaml", text=CORNERS["input order"])
    assert graph is not None
    a = next(n for n in graph.nodes if n.name == "a")
    twice = dataclasses.replace(graph, nodes=(*graph.nodes, a))
    both_ways(twice)
    assert "FG101" in {d.code for d in check_graph(twice).diagnostics}


def test_outputs_that_name_their_node_are_not_replayed() -> None:
    # `c` is never bound: each node's output says `<node>.c`, so no node is a copy.
    kind = KindSpec("widen", "custom", "adds an axis of its own size",
                    inputs=(PortSpec("x", TensorSpec("b T")),),
                    outputs=(PortSpec("y", TensorSpec("b T c")),))
    registry = Registry({**BUILTIN_KINDS, "widen": kind})
    text = CORNERS["input order"] + "".join(
        f"  w{i}:\n    kind: widen\n    inputs: {{x: a.log_prob}}\n" for i in range(3))
    graph, _ = load_graph("f.yaml", text=text)
    assert graph is not None
    both_ways(graph, registry)
    outputs = check_graph(graph, registry).shapes.outputs
    assert [str(outputs[(f"w{i}", "y")].dims[2]) for i in range(3)] == ["w0.c", "w1.c",
                                                                         "w2.c"]


def test_edges_solved_for_a_local_are_not_replayed() -> None:
    # `_bind` solves `b+1` for b: such an edge is unified in full on every copy.
    kind = KindSpec("shifted", "custom", "gives one sequence fewer than it takes",
                    inputs=(PortSpec("x", TensorSpec("b+1 T")),),
                    outputs=(PortSpec("y", TensorSpec("b T")),))
    registry = Registry({**BUILTIN_KINDS, "shifted": kind})
    text = CORNERS["input order"] + "".join(
        f"  s{i}:\n    kind: shifted\n    inputs: {{x: a.log_prob}}\n" for i in range(3))
    graph, _ = load_graph("f.yaml", text=text)
    assert graph is not None
    calls: Counter[str] = Counter()
    with counting(calls):
        both_ways(graph, registry)
    assert calls["shifted"] == 0
    assert calls["logprob"] > 0  # (the copies of `a` are)
    outputs = check_graph(graph, registry).shapes.outputs
    assert {str(outputs[(f"s{i}", "y")].dims[0]) for i in range(3)} == {"Bp*N-1"}


# --- the rewritten walks, on their own ---------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "c", "d", "e", "train"])


@st.composite
def tangles(draw: st.DrawFn) -> tuple[Graph, set[str]]:
    """Nodes with repeated names, references to no node, self-loops and cycles, and a
    set of names to skip."""
    nodes = []
    for i in range(draw(st.integers(0, 8))):
        refs = draw(st.lists(_NAMES, max_size=4))
        nodes.append(NodeSpec(draw(_NAMES), "logprob",
                              tuple((f"p{j}", PortRef(r, "out")) for j, r in enumerate(refs)),
                              params=Params(), model=f"m{i}"))
    return Graph("tangle", tuple(nodes)), set(draw(st.lists(_NAMES, max_size=3)))


@settings(CI, max_examples=300)
@given(tangles())
def test_topo_order_walks_as_the_walk_by_name_did(case: tuple[Graph, set[str]]) -> None:
    graph, skip = case
    assert [id(n) for n in shapes.topo_order(graph, skip)] == [
        id(n) for n in topo_order(graph, skip)]


def test_kind_params_are_found_as_by_next() -> None:
    for kind in BUILTIN_KINDS.values():
        for name in [p.name for p in kind.params] + ["nope", ""]:
            found: ParamSpec | None = next((p for p in kind.params if p.name == name), None)
            assert kind.param(name) is found


def test_the_clean_examples_skip_the_cycle_search() -> None:
    for text in EXAMPLES:
        graph, _ = load_graph("f.yaml", text=text)
        assert graph is not None
        calls: Counter[str] = Counter()
        with counting(calls):
            check_graph(graph)
        assert calls["acyclic"] == 1
