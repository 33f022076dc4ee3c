"""Structural lint: names, kinds, ports, references, params, models, cycles, dead outputs.

Every check appends to one list and goes on; nothing stops at the first problem.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from flowgraph.builtin_models import BUILTIN_PREFIX, held_out_path
from flowgraph.data.held import is_memory
from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.document import did_you_mean
from flowgraph.ir import DataSpec, Graph, ModelSpec, NodeSpec, Params, ParamValue, PortRef
from flowgraph.objects import PyObject
from flowgraph.paths import RULE, is_hub_dataset
from flowgraph.registry import KindSpec, ParamSpec, PortSpec, Registry
from flowgraph.source import SourcePos
from flowgraph.spelling import wiring
from flowgraph.trl_names import trl_hint

Producer = NodeSpec | DataSpec


@dataclass(frozen=True, slots=True)
class Resolved:
    """A node or data source with its kind, when the kind is known."""

    spec: Producer
    kind: KindSpec | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pos(self) -> SourcePos:
        return self.spec.pos


def resolve_kinds(graph: Graph, registry: Registry, out: list[Diagnostic]) -> dict[str, Resolved]:
    """Name -> resolved producer; unknown kinds and clashing names are reported."""
    table: dict[str, Resolved] = {}
    known = registry.names()
    specs: list[Producer] = [*graph.data, *graph.nodes]
    for spec in specs:
        if spec.name in table:
            first = table[spec.name].pos
            out.append(error("FG101", f"the name `{spec.name}` is used twice", spec.pos,
                             node=spec.name, notes=(f"first used at {first}",),
                             hint="node and data-source names share one namespace; "
                                  "rename one of them"))
            continue
        kind = registry.get(spec.kind)
        if kind is None:
            out.append(error("FG102", f"unknown node kind `{spec.kind}`", spec.pos,
                             node=spec.name, hint=did_you_mean(spec.kind, known)))
        elif (kind.category == "data") != isinstance(spec, DataSpec):
            where = "under `data:`" if kind.category == "data" else "under `nodes:`"
            out.append(error("FG102", f"kind `{spec.kind}` belongs {where}", spec.pos,
                             node=spec.name, hint=f"move `{spec.name}` {where}"))
            kind = None
        table[spec.name] = Resolved(spec, kind)
    return table


def check_models(graph: Graph, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    """Model bindings: declared, allowed by the kind, trainable iff something trains them."""
    declared = {m.name: m for m in graph.models}
    trained: set[str] = set()
    for r in table.values():
        node = r.spec
        if not isinstance(node, NodeSpec) or r.kind is None:
            continue
        _check_binding(node, r.kind, declared, out)
        if r.kind.trains and node.model in declared:
            trained.add(node.model)
            if not declared[node.model].trainable:
                out.append(error("FG114", f"update node `{node.name}` trains model "
                                 f"`{node.model}`, which is not trainable", node.pos,
                                 node=node.name,
                                 hint=f"set `models.{node.model}.trainable: true`"))
    for m in graph.models:
        if m.lora is not None:
            _check_lora(m, table, out)
        if m.trainable and m.name not in trained:
            out.append(error("FG110", f"model `{m.name}` is trainable but no update node "
                             "trains it", m.pos,
                             hint="add an update node (ppo_actor_update, ppo_critic_update, "
                                  "dpo_update) with this model, or set `trainable: false`"))


def _check_lora(m: ModelSpec, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    """Adapters train on a trainable causal LM only."""
    pos = m.lora.pos if m.lora is not None else m.pos
    if not m.trainable:
        out.append(error("FG119", f"model `{m.name}` has `lora` but is frozen: adapters on a "
                         "model nothing trains stay zero", pos,
                         hint=f"set `models.{m.name}.trainable: true`, or remove its lora (the "
                              "reference of a LoRA actor is its base: it needs no adapters)"))
    scalar = [r.spec.name for r in table.values() if isinstance(r.spec, NodeSpec)
              and r.spec.model == m.name and r.kind is not None and r.kind.head == "scalar"]
    if scalar:
        out.append(error("FG119", f"model `{m.name}` has `lora` and runs with a scalar head "
                         f"(node `{scalar[0]}`): adapters train causal LMs only", pos,
                         node=scalar[0],
                         hint=f"remove models.{m.name}.lora: critics and reward models train "
                              "in full"))


def _check_binding(node: NodeSpec, kind: KindSpec, declared: Mapping[str, object],
                   out: list[Diagnostic]) -> None:
    if node.model is None and kind.model == "required":
        out.append(error("FG111", f"node `{node.name}` (kind {kind.name}) needs a model",
                         node.pos, node=node.name,
                         hint=f"add `model: <name>` naming one of: "
                              f"{', '.join(declared) or '(no models declared)'}"))
    elif node.model is not None and kind.model == "none":
        out.append(error("FG111", f"kind `{kind.name}` takes no model, but node "
                         f"`{node.name}` binds `{node.model}`", node.pos, node=node.name,
                         hint="remove the `model:` line"))
    elif node.model is not None and node.model not in declared:
        out.append(error("FG109", f"node `{node.name}` uses model `{node.model}`, which is "
                         "not declared under `models:`", node.pos, node=node.name,
                         hint=did_you_mean(node.model, tuple(declared))
                         if declared else "declare it under `models:`"))


def check_ports(table: dict[str, Resolved], batch: Mapping[str, int | None],
                out: list[Diagnostic]) -> None:
    """Input ports exist and are wired; references point at real outputs. `batch`: each
    node's rows, as unification found them (an update's optimizer steps depend on it)."""
    for r in table.values():
        if not isinstance(r.spec, NodeSpec) or r.kind is None:
            continue
        node, kind = r.spec, r.kind
        names = [p.name for p in kind.inputs]
        for port, ref in node.inputs:
            if kind.input(port) is None:
                out.append(error("FG103", f"kind `{kind.name}` has no input `{port}`", ref.pos,
                                 node=node.name, edge=f"{ref} -> {node.name}.{port}",
                                 hint=did_you_mean(port, names)))
            _check_ref(node, port, ref, table, out)
        wired = {port for port, _ in node.inputs}
        if kind.terms is not None and wired <= set(names):
            out.append(error("FG104", f"node `{node.name}` (kind {kind.name}) sums the "
                             "inputs you name, and none is wired", node.pos, node=node.name,
                             hint=f"wire a term, e.g. {wiring('acc', 'reward.scores')}"))
        unwired = [p for p in kind.inputs if p.name not in wired]
        if unwired:
            _check_unwired(node, kind, unwired, batch.get(node.name), out)


def _check_unwired(node: NodeSpec, kind: KindSpec, unwired: list[PortSpec], batch: int | None,
                   out: list[Diagnostic]) -> None:
    params = kind.param_values(node.params.to_python())
    for p in unwired:
        why = kind.needs(p, params, batch)
        if why is not None:
            when = f" (needed because {why})" if p.optional else ""
            out.append(error("FG104", f"node `{node.name}` (kind {kind.name}) has no "
                             f"input `{p.name}`{when}", node.pos, node=node.name,
                             expected=p.spec.describe(),
                             hint=f"wire it: {wiring(p.name, '<node>.<port>')}"))


def _check_ref(node: NodeSpec, port: str, ref: PortRef, table: dict[str, Resolved],
               out: list[Diagnostic]) -> None:
    edge = f"{ref} -> {node.name}.{port}"
    src = table.get(ref.node)
    if src is None:
        out.append(error("FG105", f"`{ref.node}` is not a node or data source", ref.pos,
                         node=node.name, edge=edge, hint=did_you_mean(ref.node, list(table))))
        return
    if src.kind is not None and src.kind.output(ref.port) is None:
        outs = [p.name for p in src.kind.outputs]
        out.append(error("FG106", f"`{ref.node}` (kind {src.kind.name}) has no output "
                         f"`{ref.port}`", ref.pos, node=node.name, edge=edge,
                         hint=did_you_mean(ref.port, outs) if outs else
                         f"kind {src.kind.name} has no outputs"))


# --- params ----------------------------------------------------------------------


def check_params(table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    for r in table.values():
        if r.kind is None:
            continue
        params = r.spec.params
        for p in params.items:
            spec = r.kind.param(p.name)
            why = dict(r.kind.not_taken).get(p.name)
            if spec is None and why is not None:
                out.append(error("FG112", f"kind `{r.kind.name}` has no parameter `{p.name}`: "
                                 f"{why}", p.pos, node=r.name, hint=f"remove `{p.name}`"))
                continue
            if spec is None:
                out.append(error("FG112", f"kind `{r.kind.name}` has no parameter `{p.name}`",
                                 p.pos, node=r.name,
                                 hint=trl_hint(p.name)
                                 or (did_you_mean(p.name, [s.name for s in r.kind.params])
                                     if r.kind.params else f"kind {r.kind.name} takes no params")))
                continue
            problem = param_problem(spec, p.value)
            if problem:
                out.append(error("FG112", f"parameter `{p.name}` of `{r.name}`: {problem}",
                                 p.pos, node=r.name, hint=_param_hint(spec)))
            for held in Params((p,)).objects():
                if held.obj is None:
                    out.append(error("FG113", f"parameter `{p.name}` of `{r.name}` names the "
                                     f"Python {held.what} `{held.ref}`, which cannot be "
                                     "imported here", p.pos, node=r.name,
                                     hint="`module:qualname` of an importable module (a "
                                     "`__main__` one only in the session that defines it)"))
        _check_required(r, params, out)


def _check_required(r: Resolved, params: Params, out: list[Diagnostic]) -> None:
    assert r.kind is not None
    for spec in r.kind.params:
        if spec.required and params.find(spec.name) is None:
            out.append(error("FG112", f"`{r.name}` (kind {r.kind.name}) needs parameter "
                             f"`{spec.name}`", r.pos, node=r.name, hint=_param_hint(spec)))


def _type_of(value: ParamValue) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, tuple):
        return "list"
    return "mapping"


def param_problem(spec: ParamSpec, value: ParamValue) -> str | None:
    """Why `value` does not fit `spec`, or None. A function or class fits a param that
    names a function (`ParamSpec.functions`) or takes any value."""
    if isinstance(value, PyObject):
        if spec.functions is not None or "any" in spec.types:
            return None
        return (f"expected {' or '.join(spec.types)}, got the Python {value.what} "
                f"`{value.ref}`")
    t = _type_of(value)
    allowed = set(spec.types)
    if "any" in allowed or t in allowed or (t == "int" and "float" in allowed):
        pass
    else:
        return f"expected {' or '.join(spec.types)}, got {t} {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite, got {value}"
    if spec.choices and isinstance(value, str) and value not in spec.choices:
        return f"`{value}` is not one of {', '.join(spec.choices)}"
    if spec.minimum is not None and isinstance(value, (int, float)) \
            and not isinstance(value, bool) and value < spec.minimum:
        return f"must be >= {spec.minimum:g}, got {value}"
    return None


def _param_hint(spec: ParamSpec) -> str:
    parts = [f"`{spec.name}`: {' | '.join(spec.types)}"]
    if spec.choices:
        parts.append(f"one of {', '.join(spec.choices)}")
    if spec.default is not None:
        parts.append(f"default {spec.default!r}")
    if spec.doc:
        parts.append(spec.doc)
    return "; ".join(parts)


def param_value(r: Resolved, name: str) -> ParamValue:
    """The param's value, or the kind's default."""
    p = r.spec.params.find(name)
    if p is not None:
        return p.value
    spec = r.kind.param(name) if r.kind else None
    return spec.default if spec else None


# --- cycles and dead outputs ----------------------------------------------------


def find_cycles(graph: Graph) -> list[list[tuple[str, str]]]:
    """Each elementary cycle found by DFS, as [(node, input port it enters by), ...]."""
    # A node named like a data source is reported as FG101; references to that name
    # mean the data source (it is resolved first), which no edge leads into.
    data = {d.name for d in graph.data}
    succ: dict[str, list[tuple[str, str]]] = {n.name: [] for n in graph.nodes
                                              if n.name not in data}
    for node in graph.nodes:
        if node.name not in succ:
            continue
        for port, ref in node.inputs:
            if ref.node in succ:
                succ[ref.node].append((node.name, port))
    color: dict[str, int] = dict.fromkeys(succ, 0)
    stack: list[tuple[str, str]] = []
    cycles: list[list[tuple[str, str]]] = []
    for start in succ:
        if color[start] == 0:
            _dfs(start, "", succ, color, stack, cycles)
    return cycles


def _dfs(start: str, via: str, succ: dict[str, list[tuple[str, str]]], color: dict[str, int],
         stack: list[tuple[str, str]], cycles: list[list[tuple[str, str]]]) -> None:
    # Iterative, so a 10,000-node chain does not hit the recursion limit.
    work: list[tuple[str, str, Iterator[tuple[str, str]]]] = [(start, via, iter(succ[start]))]
    color[start] = 1
    stack.append((start, via))
    while work:
        name, _, it = work[-1]
        nxt = next(it, None)
        if nxt is None:
            work.pop()
            stack.pop()
            color[name] = 2
            continue
        child, port = nxt
        if color[child] == 1:
            idx = next(i for i, (n, _) in enumerate(stack) if n == child)
            cycles.append([*stack[idx:], (child, port)])
        elif color[child] == 0:
            color[child] = 1
            stack.append((child, port))
            work.append((child, port, iter(succ[child])))


def check_cycles(graph: Graph, out: list[Diagnostic]) -> set[str]:
    """Report cycles; return the nodes on them."""
    on_cycle: set[str] = set()
    for cyc in find_cycles(graph):
        names = [n for n, _ in cyc]
        on_cycle.update(names)
        path = " -> ".join(f"{n}" for n in names)
        # Point at the edge that closes the cycle: the walk goes in file order, so that
        # edge leads back to the cycle's first node, typically from a later one (the
        # line just edited), not at the cycle's ordinary forward edges.
        first = graph.node(cyc[-1][0]) if len(cyc) > 1 else graph.node(names[0])
        ref = first.input(cyc[-1][1]) if first is not None and len(cyc) > 1 else None
        out.append(error("FG107", f"cycle: {path}", ref.pos if ref else None,
                         node=names[0], edge=f"{ref} -> {first.name}.{cyc[-1][1]}"
                         if ref and first else None,
                         hint="a graph describes one training step and must be acyclic; "
                              "state that carries over steps lives in models and the trainer"))
    return on_cycle


def check_unused(graph: Graph, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    """Warn about nodes whose outputs nobody reads (dead-node elimination drops them)."""
    used = {ref.node for node in graph.nodes for _, ref in node.inputs}
    for r in table.values():
        if r.kind is None or r.kind.sink or r.name in used or not r.kind.outputs:
            continue
        outs = ", ".join(p.name for p in r.kind.outputs)
        out.append(warning("FG108", f"no node uses the outputs of `{r.name}` ({outs})", r.pos,
                           node=r.name, hint="wire them into a node, or remove "
                           f"`{r.name}`; compile drops it (dead-node elimination)"))


def check_held_out(graph: Graph, out: list[Diagnostic]) -> None:
    """`eval_every` evaluates on every data source's held-out rows; a source without
    them means no evaluation at all (the executor skips it), so say so before the run."""
    if not graph.trainer.eval_every:
        return
    for d in graph.data:
        eval_path = d.params.to_python().get("eval_path")
        if held_out_path(d.path, eval_path if isinstance(eval_path, str) else None):
            continue
        out.append(warning(
            "FG117", f"`trainer.eval_every` is {graph.trainer.eval_every}, but data source "
            f"`{d.name}` has no held-out rows: no evaluation will run", graph.trainer.pos,
            node=d.name, hint=f"set data.{d.name}.eval_path to a held-out file, or "
            "trainer.eval_every: 0"))


def check_data_files(graph: Graph, out: list[Diagnostic]) -> None:
    """A dataset file or a local model or tokenizer folder that is not on this machine, by
    the path it resolved to: a warning, since a plan may be compiled here for a machine
    that has it; `check --data` and the run fail on it. A model path kept as written is a
    hub id (`flowgraph.paths`); every other one is absolute."""
    for m in graph.models:
        for folder in dict.fromkeys((m.path, m.tokenizer)):
            if not folder or not Path(folder).is_absolute() or Path(folder).exists():
                continue
            out.append(warning("FG123", f"model `{m.name}`: folder `{folder}` does not exist "
                               "(not a hub id: an absolute path)", m.pos, node=m.name,
                               hint=RULE))
    for d in graph.data:
        eval_path = d.params.get("eval_path")
        for path in (d.path, eval_path):
            if not isinstance(path, str) or path.startswith(BUILTIN_PREFIX) \
                    or is_memory(path) or is_hub_dataset(path) or Path(path).exists():
                continue
            out.append(warning("FG123", f"data source `{d.name}`: dataset file `{path}` does not "
                               "exist", d.pos, node=d.name, hint=RULE))
