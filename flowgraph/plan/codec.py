"""The plan as JSON: `plan_to_json` / `plan_from_json` (every plan read is verified), the
run's own copy beside its Python objects (`write_run_plan` / `read_run_plan`), and the
graph's document experiment trackers record (`plan_document`).

Records are written field by field; the run's settings (`RunSpec`) as the sections of a
graph file (`flowgraph.frontend`, whose reader checks them again). A plan of the format
before (version 6, which held the whole graph beside its node records) is converted as it
is read, with a note; its updates get the loop params declared since (`start_step`) at
their defaults. A version 7 plan without them runs with their defaults too
(`MiniBatching.of`).
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from flowgraph.document import MAX_DEPTH, YMap, YNode, YScalar, YSeq
from flowgraph.errors import FlowgraphError, PlanError, PlanFileError
from flowgraph.frontend import graph_from_document, graph_to_document
from flowgraph.ir import Graph
from flowgraph.objects import PyObject, rebuilt
from flowgraph.plan.records import PLAN_VERSION, ExecutionPlan, NodePlan, RunSpec, require
from flowgraph.plan.verify import repeated_edges, verify
from flowgraph.registry import KindSpec, Registry, with_loss_implementations
from flowgraph.runtime.update import LOOP_PARAMS
from flowgraph.source import SourcePos

MAX_PLAN_BYTES = 64 << 20
"""A plan file larger than this is refused before it is parsed (the plan of a 10,000-node
graph is a few MiB)."""
MAX_PLAN_DEPTH = MAX_DEPTH + 16
"""Nesting a plan file may have: a graph file's (`flowgraph.document.MAX_DEPTH`) and the
plan's own levels around it."""
RUN_SECTIONS = ("name", "models", "data", "trainer", "resources", "plugins")
"""The graph file's sections a `RunSpec` holds, in the file's order."""
CONVERTED_VERSION = 6
"""The format version before this one, which `plan_from_json` converts."""


def plan_to_json(plan: ExecutionPlan) -> str:
    return json.dumps(_encode(plan), indent=2) + "\n"


def plan_from_json(text: str) -> ExecutionPlan:
    """The plan a file's text holds, verified; what cannot be read as one is
    `PlanFileError`, and a plan that breaks its invariants `PlanError`."""
    if len(text) > MAX_PLAN_BYTES:
        raise PlanFileError(f"the plan is larger than {MAX_PLAN_BYTES >> 20} MiB")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"the plan is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the parser's own recursion, long before the limit
        raise PlanFileError(f"the plan is nested more than {MAX_PLAN_DEPTH} levels "
                            "deep") from exc
    if _depth(data) > MAX_PLAN_DEPTH:
        raise PlanFileError(f"the plan is nested more than {MAX_PLAN_DEPTH} levels deep")
    source = data.get("source") if isinstance(data, dict) else None
    version = data.get("version") if isinstance(data, dict) else None
    if version == CONVERTED_VERSION and isinstance(data, dict):
        data = _from_version_6(data)
        print(f"flowgraph: note: the plan is format version {CONVERTED_VERSION}, read as "
              f"version {PLAN_VERSION} (compile the graph again to write it so)",
              file=sys.stderr)
    elif version != PLAN_VERSION:
        raise PlanFileError(f"the plan is format version {version}; this flowgraph reads "
                            f"version {PLAN_VERSION}: compile the graph again "
                            "(`flowgraph compile GRAPH -o plan.json`)")
    edges = data.get("edges")
    if isinstance(edges, list):  # before decoding them: thousands of copies decode slowly
        require(repeated_edges([(e.get("src"), e.get("dst")) for e in edges
                                if isinstance(e, dict)]), "execution plan")
    data.pop("score", None)  # plans written while they stored it: derived from the nodes now
    plan = _decode(ExecutionPlan, data, "plan", source if isinstance(source, str) else "<plan>")
    assert isinstance(plan, ExecutionPlan)
    return verify(plan)


def _from_version_6(data: dict[str, Any]) -> dict[str, Any]:
    """A version 6 plan's data as this version's: of its `graph`, the run's sections
    become `run`, and the params the graph sets each node's record's `given`; the nodes,
    dims and wiring the graph held twice are the node records' already. A policy loss
    the node records name becomes its implementation, as the compiler now writes it."""
    graph = data.get("graph")
    if not isinstance(graph, dict):
        raise PlanError("`plan.graph` of a version 6 plan must be a mapping")
    specs = graph["nodes"] if isinstance(graph.get("nodes"), dict) else {}
    nodes = data["nodes"] if isinstance(data.get("nodes"), list) else []
    registry = Registry.default()
    registry.load_plugins(graph.get("plugins") or (), data.get("plugin_paths") or ())
    for node in (n for n in nodes if isinstance(n, dict)):
        spec = specs.get(node.get("name"))
        params = spec.get("params") if isinstance(spec, dict) else None
        if isinstance(params, dict):
            node["given"] = [{"name": k, "value": json.dumps(v, sort_keys=True)}
                             for k, v in params.items()]
        kind = registry.get(str(node.get("kind")))
        for key in ("params", "eval_params"):
            if kind is not None and _param_records(node.get(key)):
                node[key] = _with_losses(kind, _with_loop_defaults(kind, node[key]))
    run = {k: graph[k] for k in RUN_SECTIONS if k in graph}
    rest = {k: v for k, v in data.items() if k != "graph"}
    return {"run": run, **rest, "version": PLAN_VERSION}


def _with_loop_defaults(kind: KindSpec, params: list[dict[str, str]]) -> list[dict[str, str]]:
    """An update's params with the update loop's params declared since (`start_step`) at
    their defaults, in the kind's order, as the compiler writes them now."""
    if not kind.trains:
        return params
    given = {p["name"]: p for p in params}
    loop = {p.name: {"name": p.name, "value": json.dumps(p.default, sort_keys=True)}
            for p in kind.params if p.name in LOOP_PARAMS}
    return [given.get(p.name) or loop[p.name] for p in kind.params
            if p.name in given or p.name in loop]


def _param_records(value: object) -> bool:
    """`value` is a list of `ParamPlan`s as JSON (else the decoder says what it is)."""
    if not isinstance(value, list) or not all(
            isinstance(p, dict) and isinstance(p.get("name"), str)
            and isinstance(p.get("value"), str) for p in value):
        return False
    try:
        for p in value:
            json.loads(p["value"])
    except json.JSONDecodeError:
        return False
    return True


def _with_losses(kind: KindSpec, params: list[dict[str, str]]) -> list[dict[str, str]]:
    """A node record's params (`ParamPlan`s as JSON) with the policy losses they name as
    their implementations (`with_loss_implementations`)."""
    values = with_loss_implementations(kind, {p["name"]: json.loads(p["value"])
                                              for p in params})
    return [{"name": k, "value": json.dumps(v, sort_keys=True)} for k, v in values.items()]


def write_run_plan(plan: ExecutionPlan, path: Path) -> None:
    """The plan for the run's own processes (fsdp ranks): its JSON at `path` and, when it
    holds Python objects, those pickled beside it (`<path>.objects`), where only this run
    writes; `read_run_plan` reads both."""
    path.write_text(plan_to_json(plan))
    held = plan.pickled_objects()
    objects = path.with_name(path.name + ".objects")
    if held is None:
        objects.unlink(missing_ok=True)
    else:
        objects.write_bytes(held)


def read_run_plan(path: Path) -> ExecutionPlan:
    """What `write_run_plan` wrote at `path`, its Python objects in place."""
    objects = path.with_name(path.name + ".objects")
    plan = plan_from_json(path.read_text())
    return plan.with_pickled(objects.read_bytes() if objects.is_file() else None)



def plan_document(plan: ExecutionPlan) -> dict[str, object]:
    """The graph the plan runs as a graph file's document (what experiment trackers record
    as config): the run's sections, the dims as bound, the nodes as wired, with the
    params the graph sets."""
    run = _run_document(plan.run)
    doc: dict[str, object] = {"version": 1, "name": plan.name}
    if plan.dims:
        doc["dims"] = {d.name: d.value for d in plan.dims}
    doc |= {k: run[k] for k in ("models", "data") if k in run}
    sources = plan.data_sources()
    doc["nodes"] = {n.name: _node_document(n) for n in plan.nodes if n.name not in sources}
    return doc | {k: run[k] for k in ("trainer", "resources", "plugins") if k in run}


def _node_document(node: NodePlan) -> dict[str, object]:
    out: dict[str, object] = {"kind": node.kind}
    if node.model is not None:
        out["model"] = node.model
    if node.inputs:
        out["inputs"] = {i.port: i.src for i in node.inputs}
    if node.given:
        out["params"] = {p.name: json.loads(p.value) for p in node.given}
    if node.hoisted:
        out["hoisted"] = True
    return out


def _run_document(run: RunSpec) -> dict[str, object]:
    """The run's settings as a graph file writes its sections."""
    doc = graph_to_document(Graph(run.name, models=run.models, data=run.data,
                                  trainer=run.trainer, resources=run.resources,
                                  plugins=run.plugins))
    return {k: doc[k] for k in RUN_SECTIONS if k in doc}


def _run_spec(data: object, where: str, source: str) -> RunSpec:
    """The run's sections read back by the graph file's reader (which checks them)."""
    if not isinstance(data, dict):
        raise PlanError(f"`{where}` must be a mapping, got {type(data).__name__}")
    pos = SourcePos(source, 0, 0)
    document = {"version": 1, **data, "nodes": {}}
    graph, diags = graph_from_document(_ynode(document, pos, where), source)
    errors = [d.one_line() for d in diags if d.is_error]
    if graph is None or errors:
        raise PlanError(f"`{where}` is not valid: " + "; ".join(errors))
    return RunSpec(graph.name, graph.trainer, graph.resources, graph.models, graph.data,
                   graph.plugins)


def _encode(value: object) -> object:
    if isinstance(value, RunSpec):
        return _run_document(value)
    if isinstance(value, PyObject):  # the reference, never the object (see `objects`)
        return {"ref": value.ref, "what": value.what, "defined_at": value.where,
                "shipped": value.shipped}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _depth(data: object) -> int:
    """How deeply JSON data nests its lists and objects (counted without recursing)."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(data, 1)]
    while todo:
        value, depth = todo.pop()
        deepest = max(deepest, depth)
        items = value.values() if isinstance(value, dict) else value
        todo += [(v, depth + 1) for v in items if isinstance(v, (dict, list))]
    return deepest if isinstance(data, (dict, list)) else 0


def _decode(tp: Any, data: object, where: str, source: str) -> object:
    """Rebuild a typed value from JSON data, guided by the dataclasses' type hints;
    `source` is the graph file, for the positions of the run's settings read back."""
    if tp is RunSpec:
        return _run_spec(data, where, source)
    if tp is PyObject:
        return _python_object(data, where)
    if is_dataclass(tp):
        return _record(tp, data, where, source)
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple:
        items = _expect(data, list, where)
        return tuple(_decode(args[0], v, f"{where}[{i}]", source) for i, v in enumerate(items))
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), data, where, source)
    return _expect(data, tp, where)


def _expect(data: object, tp: type, where: str) -> Any:
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)  # `1` where a number is meant
    # bool is an int in Python; a plan field typed int must not read `true`.
    if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
        raise PlanError(f"`{where}` must be {tp.__name__}, got {type(data).__name__} {data!r:.40}")
    return data


def _record(cls: Any, data: object, where: str, source: str) -> object:
    obj = _expect(data, dict, where)
    hints = get_type_hints(cls)
    unknown = sorted(set(obj) - {f.name for f in fields(cls)})
    if unknown:
        raise PlanError(f"`{where}` has unknown field(s) {unknown}")
    values = {k: _decode(hints[k], v, f"{where}.{k}", source) for k, v in obj.items()}
    try:
        return cls(**values)
    except TypeError as exc:  # a missing field
        raise PlanError(f"`{where}`: {exc}") from exc


def _python_object(data: object, where: str) -> PyObject:
    """An entry of a plan's `objects`, imported by reference where that works (a plan
    whose objects this process cannot rebuild does not run: `ExecutionPlan.unresolved`)."""
    obj = _expect(data, dict, where)
    ref, what, at = obj.get("ref"), obj.get("what", "function"), obj.get("defined_at", "")
    if not isinstance(ref, str) or not isinstance(what, str) or not isinstance(at, str):
        raise PlanError(f"`{where}` must hold `ref`, `what` and `defined_at` as strings")
    try:
        return rebuilt(ref, what, at)
    except FlowgraphError as exc:
        raise PlanError(f"`{where}`: {exc}") from exc


def _ynode(value: object, pos: SourcePos, where: str) -> YNode:
    """Plain JSON data as the located document tree the YAML front end reads."""
    if isinstance(value, dict):
        return YMap(tuple((YScalar(str(k), pos), _ynode(v, pos, where)) for k, v in value.items()),
                    pos)
    if isinstance(value, list):
        return YSeq(tuple(_ynode(v, pos, where) for v in value), pos)
    if value is None or isinstance(value, (str, int, float, bool)):
        return YScalar(value, pos)
    raise PlanError(f"`{where}` holds {type(value).__name__}, not plain data")

