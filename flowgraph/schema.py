"""`flowgraph schema`: a JSON Schema for graph files, generated from the registry.

`graph_schema()` builds it from what the front end and the checker use — the key
tables of `flowgraph.frontend` (top level, models, optimizer, nodes, trainer,
resources, pools) and every kind in the registry (ports, params with their types,
choices, minimums, defaults and docs) — so it cannot drift from them. It follows
draft 2020-12 but uses only keywords that mean the same in draft-07 (no siblings
next to `$ref`, no `prefixItems`), because editors such as VS Code's YAML extension
validate with draft-07 rules.

Hooking it up in an editor:

    flowgraph schema -o flowgraph.schema.json

then either put a modeline on the first line of each graph file (VS Code with the
Red Hat YAML extension, and any editor using yaml-language-server: Neovim, Helix,
Zed, Emacs lsp-mode)

    # yaml-language-server: $schema=../flowgraph.schema.json

(a path relative to the graph file, or a URL), or map files to it once in
`.vscode/settings.json`:

    {"yaml.schemas": {"./flowgraph.schema.json": ["graphs/**/*.yaml"]}}

JetBrains IDEs: Settings > Languages & Frameworks > Schemas and DTDs > JSON Schema
Mappings. The editor then completes keys, kinds, ports and param names, shows each
one's description on hover, and flags unknown keys and params, misspelt ports and
wrong value types while you type. Regenerate the file after adding plugin kinds
(`--plugin my_pkg.rewards` includes them).

What a schema cannot check — dims along edges, batch arithmetic, references to
nodes that exist — is `flowgraph check`'s job. Kinds that are not built in (from
`plugins:` modules or installed entry points) are accepted with a generic node shape
when the file lists `plugins:`; without it, an unknown kind is an error.
"""

from __future__ import annotations

import json
from dataclasses import MISSING
from importlib.metadata import entry_points
from typing import Any

from flowgraph.dims import CANONICAL_DIMS
from flowgraph.frontend import NODE, REF_RE, TOP
from flowgraph.ir import (
    NAME_RE,
    LoraSpec,
    ModelSpec,
    OptimizerSpec,
    PoolSpec,
    ResourceSpec,
    TrainerSpec,
    to_python,
)
from flowgraph.registry import ENTRY_POINT_GROUP, KindSpec, ParamSpec, PortSpec, Registry
from flowgraph.settings import Setting, declared, written_types

__all__ = ["graph_schema", "schema_json"]

Schema = dict[str, Any]

DRAFT = "https://json-schema.org/draft/2020-12/schema"
NAME = NAME_RE.pattern
MODULE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               dict: "object", list: "array", type(None): "null"}
_PARAM_TYPES = {"float": "number", "int": "integer", "bool": "boolean", "str": "string",
                "list": "array", "mapping": "object", "null": "null"}

# Help text per key of the top level and of a node, shown by editors on hover (the
# sections' come from their records' declarations); a test checks that every key has one.
DOCS: dict[str, str] = {
    "top.version": "Graph file format version; 1 is the only one.",
    "top.name": "Name of the graph; default: the file name without its extension.",
    "top.description": "Free text about the graph.",
    "top.dims": "Global dims: a positive integer binds one, null declares it symbolic. "
                "B = Bp*N sequences, Bp prompts, N samples per prompt, P prompt length, "
                "T response length, V vocabulary.",
    "top.models": "Models by name: where the weights come from, whether they are trained, "
                  "and their optimizer.",
    "top.data": "Data sources by name: `{kind, path, <params of the kind>}`. A data source "
                "acts as a node with no inputs and the outputs of its kind.",
    "top.nodes": "The computations by name: `{kind, model, inputs: {port: node.port}, "
                 "params}`. The graph is one training step; it must be acyclic.",
    "top.trainer": "The training loop around the graph.",
    "top.resources": "Where the graph runs; the command line's --nproc overrides nproc.",
    "top.plugins": "Python modules to import before checking; they register custom kinds.",
    "nodes.kind": "Registry name of the node's kind (`flowgraph schema` lists them).",
    "nodes.model": "The model this node runs: a key of `models`.",
    "nodes.inputs": "Input port -> `node.port`: the upstream node or data source and its "
                    "output.",
    "nodes.params": "Parameters of the kind.",
    "nodes.hoisted": "Compute once before the training loop (set by loop-invariant "
                     "hoisting; rarely written by hand).",
}
DIM_DOCS = {
    "B": "Sequences per step; always Bp*N (give B alone to mean N = 1).",
    "Bp": "Prompts per step.",
    "N": "Samples per prompt (group size of GRPO, RLOO).",
    "P": "Prompt length in tokens.",
    "T": "Response length in tokens.",
    "V": "Vocabulary size.",
}

def graph_schema(registry: Registry | None = None) -> Schema:
    """The JSON Schema (draft 2020-12) of a graph file.

    `registry` defaults to the built-in kinds plus those already declared; names of
    installed entry-point kinds are accepted too, with a generic node shape.
    """
    registry = registry or Registry.default()
    kinds = [registry.kinds[name] for name in registry.names()]
    nodes = [k for k in kinds if k.category != "data"]
    data = [k for k in kinds if k.category == "data"]
    extra = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} - set(registry.kinds))
    defs: Schema = {f"node.{k.name}": _node_kind(k) for k in nodes}
    defs |= {f"data.{k.name}": _data_kind(k) for k in data}
    defs |= {"node.plugin": _plugin_node(), "data.plugin": _plugin_data()}
    special = {
        "version": {"type": "integer", "const": 1, "default": 1},
        "dims": _dims(),
        "models": _named(_model()),
        "data": _named(_entry(data, "data")),
        "nodes": _named(_entry(nodes, "node")),
        "trainer": _record(TrainerSpec),
        "resources": _resources(),
        "plugins": {"type": "array", "items": {"type": "string", "pattern": MODULE}},
    }
    return {
        "$schema": DRAFT,
        "title": "flowgraph graph file",
        "description": "A dataflow graph for RL post-training: models, data, nodes wired "
                       "`port: node.port`, dims, trainer and resources. Generated by "
                       "`flowgraph schema`; `flowgraph check` checks what a schema cannot.",
        "type": "object",
        "properties": _properties(TOP, "top", special),
        "required": ["nodes"],
        "additionalProperties": False,
        # Without `plugins:`, every kind must be one this registry (or an installed
        # entry point) knows; the per-entry `anyOf` alone would accept any name.
        "if": {"required": ["plugins"], "properties": {"plugins": {"minItems": 1}}},
        "else": {"properties": {
            "nodes": _kind_names([k.name for k in nodes] + extra),
            "data": _kind_names([k.name for k in data] + extra),
        }},
        "$defs": defs,
    }


def schema_json(registry: Registry | None = None) -> str:
    """The schema as stable, indented JSON text."""
    return json.dumps(graph_schema(registry), indent=2, ensure_ascii=False) + "\n"


# --- the front end's sections ----------------------------------------------------------


def _typed(types: tuple[type, ...]) -> Schema:
    names = [_JSON_TYPES[t] for t in types]
    return {"type": names[0] if len(names) == 1 else names}


def _properties(table: dict[str, tuple[type, ...]], where: str, special: dict[str, Schema]
                ) -> Schema:
    """One schema per key of the top level or a node, with its doc."""
    return {key: {**(special.get(key) or _typed(types)), "description": DOCS[f"{where}.{key}"]}
            for key, types in table.items()}


def _record(record: type, special: dict[str, Schema] | None = None) -> Schema:
    """A closed mapping of the settings `record` declares: each one's type, choices,
    bounds, default and doc (`flowgraph.settings`); `special` gives the shape of values
    that are not scalars."""
    written = written_types(record)
    props: Schema = {}
    for f, s in declared(record):
        schema = dict((special or {}).get(f.name) or _setting_type(written[f.name], s))
        schema["description"] = s.doc
        default = _default(f.default)
        if default is not MISSING and (default is not None or type(None) in written[f.name]):
            schema["default"] = default
        bounds = (("minimum", s.minimum), ("exclusiveMinimum", s.above),
                  ("exclusiveMaximum", s.below))
        schema |= {key: bound for key, bound in bounds if bound is not None}
        props[f.name] = schema
    return {"type": "object", "properties": props, "additionalProperties": False}


def _setting_type(types: tuple[type, ...], s: Setting) -> Schema:
    if not s.choices:
        return _typed(types)
    enum = {"type": "string", "enum": list(s.choices)}
    return {"type": "array", "items": enum} if types == (list,) else enum


def _default(value: object) -> object:
    """A field's default as JSON (tuples as lists); MISSING where it has none to show (a
    required setting, an empty record tuple, a record)."""
    if isinstance(value, tuple):
        return list(value) if value else MISSING
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return MISSING


def _named(entry: Schema) -> Schema:
    """A mapping from names to entries."""
    return {"type": "object", "patternProperties": {NAME: entry},
            "additionalProperties": False}


def _model() -> Schema:
    optimizer = _record(OptimizerSpec, {"betas": {"type": "array", "items": {"type": "number"},
                                                  "minItems": 2, "maxItems": 2}})
    config = {"type": "object", "additionalProperties": True}
    lora = _record(LoraSpec, {"target_modules": {"oneOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}}]}})
    model = _record(ModelSpec, {"optimizer": optimizer, "config": config, "lora": lora})
    return {**model, "required": ["path"]}


def _resources() -> Schema:
    pool = _record(PoolSpec, {"models": {"type": "array",
                                         "items": {"type": "string", "pattern": NAME}}})
    return _record(ResourceSpec, {"pools": _named({**pool, "required": ["size", "models"]})})


def _dims() -> Schema:
    value = {"type": ["integer", "null"], "minimum": 1}
    return {"type": "object",
            "properties": {d: {**value, "description": DIM_DOCS.get(d, "A canonical dim.")}
                           for d in CANONICAL_DIMS},
            "patternProperties": {NAME: value}, "additionalProperties": False}


# --- kinds ---------------------------------------------------------------------------


def _entry(kinds: list[KindSpec], role: str) -> Schema:
    """One `nodes` or `data` entry: the schema of its kind, chosen by `kind`."""
    choices: list[Schema] = [{"const": k.name, "description": k.doc} for k in kinds]
    choices.append({"type": "string", "pattern": NAME,
                    "description": "a kind declared by a plugin module or an installed "
                                   "package"})
    known = [k.name for k in kinds]
    branches: list[Schema] = [
        {"if": {"properties": {"kind": {"const": name}}, "required": ["kind"]},
         "then": {"$ref": f"#/$defs/{role}.{name}"}} for name in known]
    branches.append({"if": {"properties": {"kind": {"enum": known}}, "required": ["kind"]},
                     "else": {"$ref": f"#/$defs/{role}.plugin"}})
    required = ["kind"] if role == "node" else ["kind", "path"]
    return {"type": "object", "properties": {"kind": {"anyOf": choices}},
            "required": required, "allOf": branches}


def _kind_names(names: list[str]) -> Schema:
    return {"additionalProperties": {"properties": {"kind": {"enum": sorted(names)}}}}


def _kind_doc(k: KindSpec) -> str:
    lines = [k.doc, f"Category: {k.category}. Model: {k.model}."]
    if k.trains:
        lines.append("An update node: trains its model, which must be trainable.")
    if k.grouped:
        lines.append("Needs whole sample groups: its batch is split only group-aligned.")
    if k.outputs:
        outs = ", ".join(f"{p.name} {p.spec.describe()}" for p in k.outputs)
        lines.append(f"Outputs: {outs}.")
    return "\n".join(lines)


def _port(p: PortSpec) -> Schema:
    what = "Optional input" if p.optional else "Input"
    doc = f" ({p.doc})" if p.doc else ""
    return {"type": "string", "pattern": REF_RE.pattern,
            "description": f"{what} {p.spec.describe()}{doc}. Wire it as `node.port`, "
                           "e.g. `gen.responses`."}


def _param(p: ParamSpec) -> Schema:
    schema: Schema = {}
    types = [_PARAM_TYPES[t] for t in p.types if t != "any"]
    if types and "any" not in p.types:
        schema["type"] = types[0] if len(types) == 1 else types
    if p.choices:
        schema["enum"] = [*p.choices, *([None] if "null" in p.types else [])]
    if p.minimum is not None:
        schema["minimum"] = int(p.minimum) if float(p.minimum).is_integer() else p.minimum
    if not p.required:
        schema["default"] = to_python(p.default)
    parts = [p.doc.rstrip(".") + "."] if p.doc else []
    if p.dim is not None:
        parts.append(f"Binds the dim `{p.dim}`.")
    parts.append("Required." if p.required else f"Default: {json.dumps(schema['default'])}.")
    schema["description"] = " ".join(parts)
    return schema


def _params(k: KindSpec) -> Schema:
    schema: Schema = {"type": "object", "description": f"Parameters of `{k.name}`.",
                      "properties": {p.name: _param(p) for p in k.params},
                      "additionalProperties": False}
    required = [p.name for p in k.params if p.required]
    return {**schema, "required": required} if required else schema


def _node_kind(k: KindSpec) -> Schema:
    special: Schema = {
        "kind": {"const": k.name},
        "model": {"type": "string", "pattern": NAME},
        "inputs": {"type": "object", "properties": {p.name: _port(p) for p in k.inputs},
                   "additionalProperties": _port(k.terms) if k.terms else False},
        "params": _params(k),
    }
    wired = [p.name for p in k.inputs if not p.optional]
    if wired:
        special["inputs"]["required"] = wired
    props = _properties(NODE, "nodes", special)
    if k.model == "none":
        del props["model"]
    required = ["kind", *(["model"] if k.model == "required" else []),
                *(["inputs"] if wired else []),
                *(["params"] if any(p.required for p in k.params) else [])]
    return {"type": "object", "title": f"{k.name} ({k.category})", "description": _kind_doc(k),
            "properties": props, "required": required, "additionalProperties": False}


def _data_kind(k: KindSpec) -> Schema:
    props: Schema = {
        "kind": {"const": k.name, "description": "The data source's kind."},
        "path": {"type": "string", "description": "Parquet or JSONL file, or "
                                                  "`builtin:<task>` for the embedded toy tasks."},
    }
    props |= {p.name: _param(p) for p in k.params}
    required = ["kind", "path", *(p.name for p in k.params if p.required)]
    return {"type": "object", "title": f"{k.name} (data)", "description": _kind_doc(k),
            "properties": props, "required": required, "additionalProperties": False}


def _plugin_node() -> Schema:
    special: Schema = {
        "kind": {"type": "string", "pattern": NAME},
        "model": {"type": "string", "pattern": NAME},
        "inputs": {"type": "object",
                   "patternProperties": {NAME: {"type": "string", "pattern": REF_RE.pattern}},
                   "additionalProperties": False},
        "params": {"type": "object"},
    }
    return {"type": "object", "title": "a node of a custom kind",
            "properties": _properties(NODE, "nodes", special),
            "required": ["kind"], "additionalProperties": False}


def _plugin_data() -> Schema:
    return {"type": "object", "title": "a data source of a custom kind",
            "properties": {"kind": {"type": "string", "pattern": NAME},
                           "path": {"type": "string"}},
            "required": ["kind", "path"]}
