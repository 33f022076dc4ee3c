"""Filter nodes (kind category `filter`, DAPO's dynamic sampling): where one can work.

A filter's outputs have their own batch dim, `g*n`: g groups (its `groups` param, else
Bp) of n samples. That is the batch after the refill loop, fixed, so every contract and
every batch-size rule downstream (mini-batches, data-parallel splits) is checked
against it like any other batch. What the dims cannot say is checked here (FG304):

* one filter per graph: the step has one refill loop;
* its `index` comes from a rollout (`generate`): groups are what it keeps;
* that rollout samples n per prompt, the n of the filter's output dim (N);
* g groups fit in one generation batch (bounded by its input: g <= b / n);
* no node outside the loop (the nodes the filter does not read run once, after it)
  reads a tensor of one try (the rollout's, the reward's, a data source's): only the
  filter's outputs are the whole batch;
* an optional output read downstream has its input wired.

Notation: b sequences of one generation batch, g groups kept, n samples per group.
"""

from __future__ import annotations

from flowgraph.checker.shapes import ShapeResult, group_size
from flowgraph.checker.structure import Resolved
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.ir import Graph, NodeSpec
from flowgraph.plan.verify import upstream_of
from flowgraph.spelling import wiring


def check_filters(graph: Graph, table: dict[str, Resolved], shapes: ShapeResult,
                  out: list[Diagnostic]) -> None:
    filters = [n for n in graph.nodes
               if (r := table.get(n.name)) is not None and r.kind is not None
               and r.kind.category == "filter"]
    for extra in filters[1:]:
        out.append(error("FG304", f"`{extra.name}` is a second filter node (the first is "
                         f"`{filters[0].name}`); a step has one refill loop", extra.pos,
                         node=extra.name, hint="filter once, with one predicate"))
    for node in filters[:1]:
        _check_groups(node, table, shapes, out)
        _check_readers(graph, node, out)
        _check_optional(graph, node, out)


def _check_groups(node: NodeSpec, table: dict[str, Resolved], shapes: ShapeResult,
                  out: list[Diagnostic]) -> None:
    env = shapes.env
    ref = node.input("index")
    n = group_size(node, table, env)
    if n is None:
        out.append(error("FG304", f"filter `{node.name}`: its `index` ({ref or 'unwired'}) "
                         "is not a rollout's group index, so there are no groups to keep",
                         ref.pos if ref else node.pos, node=node.name,
                         hint="wire index from the `generate` node that sampled the "
                              f"responses: {wiring('index', 'gen.index')}"))
        return
    own = env.value(env.locals_.get(f"{node.name}.n"))
    if own is not None and own != n:
        out.append(error("FG304", f"filter `{node.name}`: the rollout samples {n} per prompt, "
                         f"but the filter's batch is made of groups of N = {own}",
                         node.pos, node=node.name, expected=f"n = {own}", actual=f"n = {n}",
                         hint="sample N per prompt (leave the generate's `n` unset)"))
        return
    g = env.value(env.locals_.get(f"{node.name}.g"))
    batch = shapes.batch.get(node.name)
    if g is None or batch is None or g * n <= batch:
        return
    p = node.params.find("groups")
    out.append(error("FG304", f"filter `{node.name}`: {g} groups of {n} ({g * n} sequences) "
                     f"do not fit in one generation batch of {batch}; the filtered batch is "
                     "bounded by its input", p.pos if p else node.pos, node=node.name,
                     expected=f"groups <= {batch // n}", actual=f"groups = {g}",
                     hint=f"set groups to at most {batch // n}, or raise Bp"))


def _check_readers(graph: Graph, node: NodeSpec, out: list[Diagnostic]) -> None:
    """A node outside the loop (not a producer the filter reads) reads, of the loop's
    producers, the filter only."""
    reads = {n.name: tuple(ref.node for _, ref in n.inputs) for n in graph.nodes}
    before = upstream_of(reads, node.name) | {d.name for d in graph.data}
    for reader in graph.nodes:
        if reader.name in before or reader.name == node.name:
            continue
        for port, ref in reader.inputs:
            if ref.node in before:
                out.append(error(
                    "FG304", f"`{reader.name}.{port}` reads `{ref}`, one try's tensor: "
                    f"`{reader.name}` runs after the refill loop of filter `{node.name}`, "
                    "whose batch is the kept groups of every try",
                    ref.pos, node=reader.name, hint=f"read `{node.name}.{ref.port}` if the "
                    "filter passes it through, else compute it after the filter"))


def _check_optional(graph: Graph, node: NodeSpec, out: list[Diagnostic]) -> None:
    read = {ref.port for ref, _, _ in graph.edges() if ref.node == node.name}
    for port in sorted(read - {p for p, _ in node.inputs}):
        out.append(error("FG304", f"`{node.name}.{port}` is read downstream, but the filter's "
                         f"input `{port}` is not wired, so it has nothing to pass through",
                         node.pos, node=node.name, hint=f"wire {wiring(port, f'gen.{port}')}"))
