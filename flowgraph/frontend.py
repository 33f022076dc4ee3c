"""The YAML front end: a located document -> `Graph`, and `Graph` -> YAML.

Structure is checked here (unknown keys with a "did you mean", wrong value types,
missing required keys), every problem collected; what the registry knows (kinds,
ports, params) is checked by the checker. A graph file looks like:

    name: ppo
    dims: {Bp: 8, N: 1, P: 32, T: 32}
    models:
      actor: {path: "builtin:tiny-lm", trainable: true, optimizer: {lr: 1.0e-5}}
    data:
      train: {kind: prompts, path: "builtin:arith"}
    nodes:
      gen:
        kind: generate
        model: actor
        inputs: {prompts: train.input_ids, prompt_mask: train.attention_mask}
        params: {max_new_tokens: 32}
    trainer: {steps: 20, seed: 0}

One module past ~450 lines, on purpose: the reader and the writer of one format, side
by side, so that a section's spelling changes in one place for both directions.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

from flowgraph.choices import LOGGERS
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.document import (
    EXP_FLOAT,
    YMap,
    YNode,
    YScalar,
    YSeq,
    apply_override,
    did_you_mean,
    parse_override,
    plain,
    read_document,
)
from flowgraph.errors import FlowgraphError, UsageError
from flowgraph.ir import (
    NAME_RE,
    DataSpec,
    DimBinding,
    Graph,
    LoraSpec,
    ModelSpec,
    NodeSpec,
    OffloadSpec,
    OptimizerSpec,
    Param,
    Params,
    ParamValue,
    Plugin,
    PoolSpec,
    PortRef,
    ResourceSpec,
    TrainerSpec,
    from_python,
)
from flowgraph.objects import rebuilt, tagged
from flowgraph.paths import folder_of, resolve_data_path, resolve_path
from flowgraph.settings import Setting, declared, written_types
from flowgraph.source import SourcePos
from flowgraph.trl_names import trl_hint

MAX_FILE_BYTES = 16 * 1024 * 1024
REF_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")

# Expected value types per key: a tuple of Python types (int is not a float here;
# `_typed` widens int to float where float is expected). The top level's and a node's
# keys are the document's own structure, declared here with their docs (the JSON
# Schema's); the sections' come from their records' declarations (`flowgraph.settings`).
_T = tuple[type, ...]
TOP_KEYS = {
    "version": Setting("Graph file format version; 1 is the only one.", written=(int,)),
    "name": Setting("Name of the graph; default: the file name without its extension.",
                    written=(str,)),
    "description": Setting("Free text about the graph.", written=(str,)),
    "dims": Setting("Global dims: a positive integer binds one, null declares it symbolic. "
                    "B = Bp*N sequences, Bp prompts, N samples per prompt, P prompt length, "
                    "T response length, V vocabulary.", written=(dict,)),
    "models": Setting("Models by name: where the weights come from, whether they are "
                      "trained, and their optimizer.", written=(dict,)),
    "data": Setting("Data sources by name: `{kind, path, <params of the kind>}`. A data "
                    "source acts as a node with no inputs and the outputs of its kind.",
                    written=(dict,)),
    "nodes": Setting("The computations by name: `{kind, model, inputs: {port: node.port}, "
                     "params}`. The graph is one training step; it must be acyclic.",
                     written=(dict,)),
    "trainer": Setting("The training loop around the graph.", written=(dict,)),
    "resources": Setting("Where the graph runs; the command line's --nproc overrides nproc.",
                         written=(dict,)),
    "plugins": Setting("Python modules to import before checking; they register custom "
                       "kinds.", written=(list,)),
}
NODE_KEYS = {
    "kind": Setting("Registry name of the node's kind (`flowgraph schema` lists them).",
                    written=(str,)),
    "model": Setting("The model this node runs: a key of `models`.", written=(str,)),
    "inputs": Setting("Input port -> `node.port`: the upstream node or data source and its "
                      "output.", written=(dict,)),
    "params": Setting("Parameters of the kind.", written=(dict,)),
    "hoisted": Setting("Compute once before the training loop (set by loop-invariant "
                       "hoisting; rarely written by hand).", written=(bool,)),
}
SECTIONS: dict[str, type] = {
    "models": ModelSpec, "optimizer": OptimizerSpec, "lora": LoraSpec,
    "offload": OffloadSpec, "trainer": TrainerSpec, "resources": ResourceSpec,
    "pools": PoolSpec}
"""The graph file's sections (and the mappings in them: `models.<m>.optimizer`,
`models.<m>.lora`, `models.<m>.offload`, `resources.pools.<p>`) with the records that
declare their settings (`flowgraph kinds trainer` describes one)."""
TOP = {key: s.written for key, s in TOP_KEYS.items()}
NODE = {key: s.written for key, s in NODE_KEYS.items()}
MODEL = written_types(ModelSpec)
LORA = written_types(LoraSpec)
OPTIMIZER = written_types(OptimizerSpec)
TRAINER = written_types(TrainerSpec)
RESOURCES = written_types(ResourceSpec)
POOL = written_types(PoolSpec)


class _Reader:
    """Turns a located document into IR records, collecting diagnostics."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.diags: list[Diagnostic] = []

    def err(self, code: str, message: str, pos: SourcePos, **kw: Any) -> None:
        self.diags.append(error(code, message, pos, **kw))

    def typed(self, node: YNode, types: _T, where: str) -> Any:
        """The plain value if its type is one of `types`, else a diagnostic and None."""
        value = plain(node)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, float) and not math.isfinite(value):
            self.err("FG004", f"`{where}` must be a finite number, got {value}", node.pos)
            return None
        if not _is_a(value, types):
            self.type_error(node, types, where)
            return None
        return value

    def type_error(self, node: YNode, types: _T, where: str) -> None:
        names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
        self.err("FG004", f"`{where}` must be {names}, got {_describe(plain(node))}", node.pos)

    def section(self, node: YNode, schema: dict[str, _T], where: str) -> dict[str, Any]:
        """Check keys and value types of a mapping against `schema`.

        Scalars come back as plain values, mappings and lists as located nodes.
        """
        if not isinstance(node, YMap):
            self.type_error(node, (dict,), where)
            return {}
        out: dict[str, Any] = {}
        for key, value in node.items:
            name = str(key.value)
            types = schema.get(name)
            if types is None:
                self.diags.append(unknown_key(name, tuple(schema), where, key.pos))
            elif types in ((dict,), (list,)):
                if isinstance(value, YMap if types == (dict,) else YSeq):
                    out[name] = value
                else:
                    self.type_error(value, types, f"{where}.{name}")
            else:
                typed = self.typed(value, types, f"{where}.{name}")
                if typed is not None or (plain(value) is None and type(None) in types):
                    out[name] = typed
        return out

    def checked(self, node: YNode, record: type, where: str) -> dict[str, Any]:
        """`section` against the settings `record` declares, each value checked against
        their choices and bounds: one that fails is reported at its line and left out (the
        record's default stands in)."""
        values = self.section(node, written_types(record), where)
        for f, s in declared(record):
            value = values.get(f.name)
            given = f.name in values and not isinstance(value, (YMap, YSeq))
            problem = s.problem(value) if given else None
            if problem is None or not isinstance(node, YMap):
                continue
            written = node.get(f.name)
            self.err("FG004", f"`{where}.{f.name}` {problem}", (written or node).pos,
                     hint=s.hint or _choice_hint(str(value), s.choices))
            del values[f.name]
        return values

    def named_entries(self, node: YNode | None, where: str) -> list[tuple[YScalar, YNode]]:
        if node is None:
            return []
        if not isinstance(node, YMap):
            self.err("FG004", f"`{where}` must be a mapping of names", node.pos)
            return []
        out = []
        for key, value in node.items:
            if not NAME_RE.match(str(key.value)):
                self.err("FG004", f"`{key.value}` is not a valid name in {where}", key.pos,
                         hint="use letters, digits and `_`, starting with a letter")
                continue
            out.append((key, value))
        return out

    def params(self, node: YNode | None, where: str) -> Params:
        if node is None:
            return Params()
        if not isinstance(node, YMap):
            self.err("FG004", f"`{where}` must be a mapping", node.pos)
            return Params()
        return Params(tuple(Param(str(k.value), _freeze(v), v.pos) for k, v in node.items))


def unknown_key(name: str, known: Sequence[str], where: str, pos: SourcePos) -> Diagnostic:
    """FG003 for a key of `where` (`trainer`, `models.actor.lora`) that is none of
    `known`: a graph file's and the Python builder's. Its hint names the flowgraph setting
    a TRL name stands for (`flowgraph.trl_names`), else the closest known key."""
    return error("FG003", f"unknown key `{name}` in {where}", pos,
                 hint=trl_hint(name) or did_you_mean(name, tuple(known)))


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               dict: "a mapping", list: "a list", type(None): "null"}


def _is_a(value: object, types: _T) -> bool:
    """isinstance, except that a bool is not an int and an int is a float."""
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _choice_hint(value: str, choices: tuple[str, ...]) -> str | None:
    if not choices:
        return None
    close = difflib.get_close_matches(value, choices, n=1)
    return f"did you mean `{close[0]}`?" if close else f"use one of {', '.join(choices)}"


def _describe(value: object) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    text = repr(value)
    return f"{_TYPE_NAMES.get(type(value), type(value).__name__)} {text[:40]}"


def _freeze(node: YNode) -> ParamValue:
    if isinstance(node, YScalar):
        return node.value
    if isinstance(node, YSeq):
        return tuple(_freeze(i) for i in node.items)
    ref = tagged(plain(node))
    if ref is not None:  # `{$python: module:qualname}`: a function or class, by reference
        return rebuilt(ref)
    return Params(tuple(Param(str(k.value), _freeze(v), v.pos) for k, v in node.items))


# --- sections ----------------------------------------------------------------------


def _read_models(r: _Reader, node: YNode | None) -> tuple[ModelSpec, ...]:
    out = []
    for key, value in r.named_entries(node, "models"):
        where = f"models.{key.value}"
        f = r.checked(value, ModelSpec, where)
        if "path" not in f:
            if isinstance(value, YMap) and value.get("path") is None:
                r.err("FG007", f"model `{key.value}` has no `path`", key.pos,
                      hint="a local directory, a hub id, or builtin:tiny-lm")
            continue
        f["path"] = _resolved(value, "path", f["path"], hub=True)
        if f.get("tokenizer") is not None:
            f["tokenizer"] = _resolved(value, "tokenizer", f["tokenizer"], hub=True)
        if f.get("init_from") is not None:
            f["init_from"] = _resolved(value, "init_from", f["init_from"], hub=False)
        f["optimizer"] = _read_optimizer(r, f.get("optimizer"), f"{where}.optimizer")
        f["config"] = r.params(f.get("config"), f"{where}.config")
        f["lora"] = _read_lora(r, f.get("lora"), f"{where}.lora")
        if f.get("offload") is not None:
            f["offload"] = OffloadSpec(**r.checked(f["offload"], OffloadSpec, f"{where}.offload"),
                                       pos=f["offload"].pos)
        out.append(ModelSpec(name=str(key.value), **f, pos=key.pos))
    return tuple(out)


def _read_lora(r: _Reader, node: YNode | None, where: str) -> LoraSpec | None:
    if node is None:
        return None
    f = r.checked(node, LoraSpec, where)
    targets = f.pop("target_modules", ["all-linear"])
    targets = [targets] if isinstance(targets, str) else targets
    if not targets or not all(isinstance(t, str) and t for t in targets):
        r.err("FG004", f"{where}.target_modules must name modules (a list of names, or "
              "`all-linear`)", node.pos, hint="e.g. target_modules: [q_proj, v_proj]")
        targets = ["all-linear"]
    return LoraSpec(**f, target_modules=tuple(targets), pos=node.pos)


def _read_optimizer(r: _Reader, node: YNode | None, where: str) -> OptimizerSpec | None:
    if node is None:
        return None
    f = r.checked(node, OptimizerSpec, where)
    if "betas" in f:
        betas = plain(f["betas"])
        ok = isinstance(betas, list) and len(betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)
        if ok:
            f["betas"] = (float(betas[0]), float(betas[1]))  # type: ignore[index]
        else:
            r.err("FG004", f"`{where}.betas` must be two numbers", f["betas"].pos)
            del f["betas"]
    return OptimizerSpec(**f, pos=node.pos)


def _read_data(r: _Reader, node: YNode | None) -> tuple[DataSpec, ...]:
    out = []
    for key, value in r.named_entries(node, "data"):
        if not isinstance(value, YMap):
            r.err("FG004", f"`data.{key.value}` must be a mapping", value.pos)
            continue
        kind, path = value.get("kind"), value.get("path")
        missing = [k for k, v in (("kind", kind), ("path", path)) if v is None]
        if missing:
            r.err("FG007", f"data source `{key.value}` has no `{'` or `'.join(missing)}`",
                  key.pos, hint="e.g. {kind: prompts, path: data/train.parquet}")
            continue
        assert kind is not None and path is not None
        kind_v = r.typed(kind, (str,), f"data.{key.value}.kind")
        path_v = r.typed(path, (str,), f"data.{key.value}.path")
        if kind_v is None or path_v is None:
            continue
        rest = YMap(tuple((k, v) for k, v in value.items if k.value not in ("kind", "path")),
                    value.pos)
        params = _held_out_resolved(r.params(rest, f"data.{key.value}"))
        out.append(DataSpec(str(key.value), kind_v,
                            resolve_data_path(path_v, folder_of(path.pos)),
                            params, key.pos))
    return tuple(out)


def _held_out_resolved(params: Params) -> Params:
    """A data source's params with its held-out file, `eval_path`, resolved as its `path`."""
    given = params.find("eval_path")
    if given is None or not isinstance(given.value, str):
        return params
    held_out = replace(given, value=resolve_data_path(given.value, folder_of(given.pos)))
    return Params(tuple(held_out if p is given else p for p in params.items))


def _resolved(entry: YNode, key: str, path: str, hub: bool) -> str:
    """`path`, written as `key` of `entry`, resolved by `flowgraph.paths`' rule."""
    written = entry.get(key) if isinstance(entry, YMap) else None
    return resolve_path(path, folder_of((written or entry).pos), hub=hub)


def _read_nodes(r: _Reader, node: YNode | None) -> tuple[NodeSpec, ...]:
    out = []
    for key, value in r.named_entries(node, "nodes"):
        where = f"nodes.{key.value}"
        f = r.section(value, NODE, where)
        if "kind" not in f:
            if isinstance(value, YMap) and value.get("kind") is None:
                r.err("FG007", f"node `{key.value}` has no `kind`", key.pos,
                      hint="name a kind from the registry, e.g. `kind: gae` "
                           "(`flowgraph schema` lists them)")
            continue
        out.append(NodeSpec(
            name=str(key.value), kind=f["kind"], model=f.get("model"),
            inputs=_read_inputs(r, f.get("inputs"), where),
            params=r.params(f.get("params"), f"{where}.params"),
            hoisted=f.get("hoisted", False), pos=key.pos))
    return tuple(out)


def _read_inputs(r: _Reader, node: YNode | None, where: str) -> tuple[tuple[str, PortRef], ...]:
    if node is None:
        return ()
    assert isinstance(node, YMap)
    out = []
    for key, value in node.items:
        port = str(key.value)
        text = plain(value)
        m = REF_RE.match(text) if isinstance(text, str) else None
        if not NAME_RE.match(port) or m is None:
            r.err("FG115", f"input `{where}.inputs.{port}` must be `node.port`, got "
                  f"{_describe(text)}", value.pos,
                  hint="write the upstream node's name and its output port, e.g. "
                       "`gen.responses`")
            continue
        out.append((port, PortRef(m.group(1), m.group(2), value.pos)))
    return tuple(out)


def _read_dims(r: _Reader, node: YNode | None) -> tuple[DimBinding, ...]:
    out = []
    for key, value in r.named_entries(node, "dims"):
        v = plain(value)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            r.err("FG206", f"dim `{key.value}` must be a positive integer or null "
                  f"(symbolic), got {_describe(v)}", value.pos)
            continue
        out.append(DimBinding(str(key.value), v, key.pos))
    return tuple(out)


def _read_trainer(r: _Reader, node: YNode | None) -> TrainerSpec:
    if node is None:
        return TrainerSpec()
    f = r.checked(node, TrainerSpec, "trainer")
    if "loggers" in f:
        f["loggers"] = _read_loggers(r, f["loggers"])
    return TrainerSpec(**f, pos=node.pos)


def _read_loggers(r: _Reader, node: YSeq) -> tuple[str, ...]:
    """The known names of `trainer.loggers`; each other item is an error at its line."""
    out = []
    for item in node.items:
        name = plain(item)
        if name in LOGGERS:
            out.append(name)
            continue
        close = difflib.get_close_matches(str(name), LOGGERS, n=1)
        r.err("FG004", f"`trainer.loggers` lists `{name}`, which is not a logger", item.pos,
              hint=(f"did you mean `{close[0]}`? " if close else "")
              + f"the loggers are {', '.join(LOGGERS)}")
    return tuple(out)


def _read_resources(r: _Reader, node: YNode | None) -> ResourceSpec:
    if node is None:
        return ResourceSpec()
    f = r.checked(node, ResourceSpec, "resources")
    pools = []
    for key, value in r.named_entries(f.pop("pools", None), "resources.pools"):
        where = f"resources.pools.{key.value}"
        p = r.checked(value, PoolSpec, where)
        models = plain(p.pop("models")) if "models" in p else []
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            r.err("FG004", f"`{where}.models` must be a list of model names", value.pos)
            continue
        custom = _read_amounts(r, p.pop("custom_resources", None), f"{where}.custom_resources")
        labels = _read_selector(r, p.pop("label_selector", None), f"{where}.label_selector")
        pools.append(PoolSpec(str(key.value), **{"size": 1, **p}, models=tuple(models),
                              custom_resources=custom, label_selector=labels, pos=key.pos))
    return ResourceSpec(**f, pools=tuple(pools), pos=node.pos)


RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray accounts itself: a pool asks for CPUs and GPUs with `cpus` and `gpus`."""
_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
LABEL_SELECTOR_RE = re.compile(rf"!?(in)?\({_LABEL}(, ?{_LABEL})*\)|!?{_LABEL}")
"""A value of a Ray label selector (Ray 2.60's `ray._private.label_utils`): a label value,
`!value`, `in(a, b)` or `!in(a, b)`."""
LABEL_KEY_RE = re.compile(rf"(([a-zA-Z0-9.-]+)/)?{_LABEL}")
"""A node label's name: an optional DNS-like prefix and `/`, then a label (`ray.io/node-id`)."""


def _read_amounts(r: _Reader, node: YNode | None, where: str) -> tuple[tuple[str, float], ...]:
    """`custom_resources`: resource name -> a number >= 0; each other entry an error at its
    line (Ray's own CPU and GPU are asked for with `cpus` and `gpus`)."""
    if not isinstance(node, YMap):
        return ()
    out = []
    for key, value in node.items:
        name, amount = str(key.value), plain(value)
        if name in RAY_OWN_RESOURCES:
            r.err("FG004", f"`{where}` names `{name}`, a resource Ray accounts itself", key.pos,
                  hint="ask for CPUs and GPUs with the pool's `cpus` and `gpus`" if name in
                  ("CPU", "GPU") else f"leave `{name}` out; Ray gives each worker what its "
                  "node has")
        elif not _is_a(amount, (float,)) or not 0 < float(amount) < math.inf:  # type: ignore[arg-type]
            r.err("FG004", f"`{where}.{name}` must be a number > 0, got "
                  f"{_describe(amount)}", value.pos,
                  hint="the amount of the resource each worker takes, e.g. `1` or `0.5`")
        else:
            out.append((name, float(amount)))  # type: ignore[arg-type]
    return tuple(out)


def _read_selector(r: _Reader, node: YNode | None, where: str) -> tuple[tuple[str, str], ...]:
    """`label_selector`: node label -> Ray's selector value; each other entry an error at
    its line."""
    if not isinstance(node, YMap):
        return ()
    out = []
    for key, value in node.items:
        name, selector = str(key.value), plain(value)
        if not LABEL_KEY_RE.fullmatch(name):
            r.err("FG004", f"`{where}` names `{name}`, which is not a node label's name",
                  key.pos, hint="a label is letters, digits, `-`, `_` and `.`, after an "
                  "optional prefix and `/` (`ray.io/node-id`)")
        elif not isinstance(selector, str) or not LABEL_SELECTOR_RE.fullmatch(selector):
            r.err("FG004", f"`{where}.{name}` is {_describe(selector)}, not a Ray label "
                  "selector", value.pos,
                  hint="write a label value (`a100`), `!value`, `in(a, b)` or `!in(a, b)`")
        else:
            out.append((name, selector))
    return tuple(out)


def _read_plugins(r: _Reader, node: YNode | None) -> tuple[Plugin, ...]:
    if node is None:
        return ()
    out = []
    assert isinstance(node, YSeq)
    for item in node.items:
        name = r.typed(item, (str,), "plugins[]")
        if name is not None:
            out.append(Plugin(name, item.pos))
    return tuple(out)


def graph_from_document(doc: YNode, file: str) -> tuple[Graph | None, list[Diagnostic]]:
    """Build the IR from a located document."""
    r = _Reader(file)
    top = r.section(doc, TOP, "the graph file")
    if not isinstance(doc, YMap):
        return None, r.diags
    if "nodes" not in top and doc.get("nodes") is None:
        r.err("FG007", "the graph has no `nodes:` section", doc.pos,
              hint="see graphs/ppo.yaml for a complete example")
    version = top.get("version", 1)
    if version != 1:
        r.err("FG004", f"graph file version {version} is not supported (this is version 1)",
              doc.pos)
    graph = Graph(
        name=top.get("name", Path(file).stem),
        nodes=_read_nodes(r, top.get("nodes")),
        models=_read_models(r, top.get("models")),
        data=_read_data(r, top.get("data")),
        dims=_read_dims(r, top.get("dims")),
        trainer=_read_trainer(r, top.get("trainer")),
        resources=_read_resources(r, top.get("resources")),
        plugins=_read_plugins(r, top.get("plugins")),
        source=file,
    )
    return graph, r.diags


def no_overrides_for_a_built_graph(graph: object, overrides: Sequence[str]) -> None:
    """Overrides edit a graph file's text: a graph built in Python is changed in Python."""
    if isinstance(graph, Graph) and overrides:
        raise UsageError(
            f"overrides apply to graph files ({', '.join(overrides)}): give the graph's "
            "file, or change a graph built in Python in Python (GraphBuilder's "
            "`trainer(steps=...)`, `dims(...)`, a node's `params`, then `build()` again)")


def load_graph(
    path: str | Path, overrides: Sequence[str] = (), text: str | None = None
) -> tuple[Graph | None, list[Diagnostic]]:
    """Read a graph file, apply `key=value` overrides, build the IR.

    Returns the graph (None when the file cannot be read into one) and every
    diagnostic found on the way. Never raises for bad input.
    """
    file = str(path)
    if text is None:
        loaded = _read_text(file)
        if isinstance(loaded, Diagnostic):
            return None, [loaded]
        text = loaded
    doc, diags = read_document(text, file)
    doc, override_diags = apply_overrides(doc, overrides)
    diags += override_diags
    if doc is None:
        return None, diags
    graph, more = graph_from_document(doc, file)
    return graph, diags + more


def apply_overrides(doc: YNode | None, overrides: Sequence[str]
                    ) -> tuple[YNode | None, list[Diagnostic]]:
    diags: list[Diagnostic] = []
    for i, text in enumerate(overrides):
        parsed = parse_override(text, i)
        if isinstance(parsed, Diagnostic):
            diags.append(parsed)
            continue
        result = apply_override(doc, parsed[0], parsed[1], text)
        if isinstance(result, Diagnostic):
            diags.append(result)
        else:
            doc = result
    return doc, diags


def _read_text(file: str) -> str | Diagnostic:
    pos = SourcePos(file, 0, 0)
    try:
        p = Path(file)
        if p.is_dir():
            return error("FG001", f"`{file}` is a directory, not a graph file", pos)
        if p.stat().st_size > MAX_FILE_BYTES:
            return error("FG008", f"`{file}` is larger than {MAX_FILE_BYTES >> 20} MiB", pos)
        data = p.read_bytes()
    except OSError as exc:
        return error("FG001", f"cannot read `{file}`: {exc.strerror or exc}", pos)
    except ValueError as exc:  # os.stat refuses a path with a NUL byte
        return error("FG001", f"cannot read `{file!r}`: {exc}", pos)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return error("FG001", f"`{file}` is not UTF-8 text (byte {exc.start})",
                     SourcePos(file, line, 1))


# --- IR -> YAML --------------------------------------------------------------------


def graph_to_document(graph: Graph) -> dict[str, object]:
    """Plain data that `graph_from_document` reads back into an equal graph."""
    doc: dict[str, object] = {"version": 1, "name": graph.name}
    if graph.dims:
        doc["dims"] = {d.name: d.value for d in graph.dims}
    if graph.models:
        doc["models"] = {m.name: _model_doc(m) for m in graph.models}
    if graph.data:
        doc["data"] = {d.name: {"kind": d.kind, "path": d.path, **d.params.to_python()}
                       for d in graph.data}
    doc["nodes"] = {n.name: _node_doc(n) for n in graph.nodes}
    _put_non_default(doc, "trainer", graph.trainer, TrainerSpec())
    res = _non_default(graph.resources, ResourceSpec(), skip=("pools",))
    if graph.resources.pools:
        res["pools"] = {p.name: _pool_doc(p) for p in graph.resources.pools}
    if res:
        doc["resources"] = res
    if graph.plugins:
        doc["plugins"] = [p.module for p in graph.plugins]
    return doc


def _pool_doc(pool: PoolSpec) -> dict[str, object]:
    doc: dict[str, object] = {"size": pool.size, "models": list(pool.models)}
    doc |= _non_default(pool, PoolSpec(pool.name, pool.size, pool.models),
                        skip=("name", "size", "models", "custom_resources", "label_selector"))
    if pool.custom_resources:
        doc["custom_resources"] = dict(pool.custom_resources)
    if pool.label_selector:
        doc["label_selector"] = dict(pool.label_selector)
    return doc


def _non_default(obj: Any, default: Any, skip: tuple[str, ...] = ()) -> dict[str, object]:
    out: dict[str, object] = {}
    for f in fields(obj):
        if f.name == "pos" or f.name in skip:
            continue
        value = getattr(obj, f.name)
        if value != getattr(default, f.name):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _put_non_default(doc: dict[str, object], key: str, obj: Any, default: Any) -> None:
    values = _non_default(obj, default)
    if values:
        doc[key] = values


def _model_doc(m: ModelSpec) -> dict[str, object]:
    out: dict[str, object] = {"path": m.path}
    out.update(_non_default(m, ModelSpec(m.name, m.path),
                            skip=("name", "optimizer", "config", "lora", "offload")))
    if m.optimizer is not None:
        out["optimizer"] = _non_default(m.optimizer, OptimizerSpec())
    if m.lora is not None:
        out["lora"] = {**_non_default(m.lora, LoraSpec()),
                       "target_modules": list(m.lora.target_modules)}
    if m.offload is not None:
        out["offload"] = _non_default(m.offload, OffloadSpec())
    if m.config.items:
        out["config"] = m.config.to_python()
    return out


def _node_doc(n: NodeSpec) -> dict[str, object]:
    out: dict[str, object] = {"kind": n.kind}
    if n.model is not None:
        out["model"] = n.model
    if n.inputs:
        out["inputs"] = {port: str(ref) for port, ref in n.inputs}
    if n.params.items:
        out["params"] = n.params.to_python()
    if n.hoisted:
        out["hoisted"] = True
    return out


class _Dumper(yaml.SafeDumper):
    """Quotes the strings the reader takes for numbers (`1e-5`, see `read_document`)."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "'" if EXP_FLOAT.match(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def graph_to_yaml(graph: Graph) -> str:
    return yaml.dump(graph_to_document(graph), Dumper=_Dumper, sort_keys=False,
                     default_flow_style=None, width=100)


def graph_from_yaml(text: str, file: str = "<string>") -> Graph:
    """Read YAML text; raises `FlowgraphError` listing the problems if there are any."""
    graph, diags = load_graph(file, text=text)
    errors = [d for d in diags if d.is_error]
    if graph is None or errors:
        raise FlowgraphError("\n".join(d.one_line() for d in errors) or "no graph")
    return graph


def with_params(node: NodeSpec, **values: object) -> NodeSpec:
    """A copy of `node` with some params replaced or added (used by passes and tests)."""
    kept = tuple(p for p in node.params.items if p.name not in values)
    added = tuple(Param(k, from_python(v), node.pos) for k, v in values.items())
    return replace(node, params=Params(kept + added))

