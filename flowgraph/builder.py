"""The Python front end: build the same `Graph` IR in code.

    g = GraphBuilder("grpo")
    g.dims(Bp=4, N=4, P=16, T=8)
    g.model("actor", "builtin:tiny-lm", trainable=True, optimizer={"lr": 5e-4})
    train = g.data("train", "prompts", "builtin:arith")
    gen = g.node("gen", "generate", model="actor",
                 prompts=train.input_ids, prompt_mask=train.attention_mask)
    ...
    graph = g.build()

Each element records the Python file and line that created it, so diagnostics point
at the user's code just as they point at a YAML line. A graph built here has no file:
its relative data, model and tokenizer paths are relative to the working directory when
`model` or `data` is called, and are stored absolute (`flowgraph.paths`); plugins are
looked for next to the Python file that lists them (in a notebook, stdin or `python -c`:
in the working directory).

A keyword or key no record declares (`g.trainer(logging_steps=5)`, `optimizer={"lrr": 1}`)
raises `GraphError` with the graph file's FG003 at the caller's line, naming the setting a
TRL name stands for (`flowgraph.trl_names`); `lora=` also takes peft's `LoraConfig`
(`flowgraph.lora`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowgraph.data.held import hold
from flowgraph.diagnostics import error
from flowgraph.errors import FlowgraphError, GraphError, IRError
from flowgraph.frontend import unknown_key
from flowgraph.ir import (
    DataSpec,
    DimBinding,
    Graph,
    LoraSpec,
    ModelSpec,
    NodeSpec,
    OptimizerSpec,
    Params,
    Plugin,
    PoolSpec,
    PortRef,
    ResourceSpec,
    TrainerSpec,
)
from flowgraph.lora import lora_spec
from flowgraph.paths import resolve_data_path, resolve_path
from flowgraph.settings import declared
from flowgraph.source import SourcePos


def _caller() -> SourcePos:
    """The user's line: the first frame outside this module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return SourcePos("<python>", 0, 0)
    return SourcePos(frame.f_code.co_filename, frame.f_lineno, 1)


@dataclass(frozen=True, slots=True)
class Handle:
    """A node or data source; attribute access names one of its outputs."""

    name: str

    def __getattr__(self, port: str) -> PortRef:
        if port.startswith("__"):
            raise AttributeError(port)
        return PortRef(self.name, port, _caller())


class GraphBuilder:
    """Collects models, data, nodes and settings, then `build()`s a `Graph`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._nodes: list[NodeSpec] = []
        self._models: list[ModelSpec] = []
        self._data: list[DataSpec] = []
        self._dims: list[DimBinding] = []
        self._plugins: list[Plugin] = []
        self._trainer = TrainerSpec()
        self._resources = ResourceSpec()

    def dims(self, **values: int | None) -> GraphBuilder:
        pos = _caller()
        self._dims += [DimBinding(k, v, pos) for k, v in values.items()]
        return self

    def model(self, name: str, path: str, *, trainable: bool = False,
              optimizer: dict[str, Any] | OptimizerSpec | None = None,
              config: dict[str, Any] | None = None,
              lora: dict[str, Any] | LoraSpec | Any = None, **kw: Any) -> str:
        """Declare a model; `lora` trains adapters: a dict ({r, alpha, dropout,
        target_modules}, or peft's names: lora_alpha, lora_dropout) or a peft `LoraConfig`.
        An unknown keyword, optimizer or lora key raises `GraphError` (FG003) at this line."""
        pos = _caller()
        where = f"models.{name}"
        _known(ModelSpec, kw, where, pos)
        opt = optimizer
        if isinstance(optimizer, dict):
            opt = OptimizerSpec(**_known(OptimizerSpec, optimizer, f"{where}.optimizer", pos),
                                pos=pos)
        if opt is not None and not isinstance(opt, OptimizerSpec):
            raise GraphError((error(
                "FG004", f"`{where}.optimizer` must be a mapping or an OptimizerSpec, got "
                f"{type(opt).__name__}", pos, hint="e.g. optimizer={'lr': 1e-5}"),))
        if isinstance(kw.get("tokenizer"), str):
            kw["tokenizer"] = resolve_path(kw["tokenizer"], Path.cwd(), hub=True)
        if isinstance(kw.get("init_from"), str | Path):
            kw["init_from"] = resolve_path(str(kw["init_from"]), Path.cwd())
        self._models.append(ModelSpec(name, resolve_path(path, Path.cwd(), hub=True),
                                      trainable=trainable, optimizer=opt,
                                      config=Params.of(config or {}, pos),
                                      lora=lora_spec(lora, f"{where}.lora", pos), pos=pos,
                                      **kw))
        return name

    def data(self, name: str, kind: str, path: Any, **params: Any) -> Handle:
        """Declare a data source: `path` (and `eval_path`) a file, a hub id, or a pyarrow
        Table, pandas DataFrame, `datasets.Dataset` or `DatasetDict` (its `test` split the
        held-out rows), copied now (`flowgraph.data.held`)."""
        pos = _caller()
        what_for = f"data source `{name}` ({pos})"
        try:
            path, held_out = _data_path(path, what_for)
            given = params.get("eval_path")
            if given is not None:
                held_out = _data_path(given, f"{what_for}, eval_path")[0]
        except FlowgraphError as exc:
            raise IRError(str(exc)) from None
        if held_out is not None:
            params["eval_path"] = held_out
        self._data.append(DataSpec(name, kind, path, Params.of(params, pos), pos))
        return Handle(name)

    def node(self, name: str, kind: str, *, model: str | None = None,
             params: dict[str, Any] | None = None, **inputs: PortRef | str) -> Handle:
        """Add a node; keyword arguments wire input ports to upstream outputs."""
        pos = _caller()
        wired = tuple((port, _ref(src, pos)) for port, src in inputs.items())
        self._nodes.append(NodeSpec(name, kind, wired, model, Params.of(params or {}, pos),
                                    pos=pos))
        return Handle(name)

    def trainer(self, **kw: Any) -> GraphBuilder:
        """Trainer settings (`flowgraph kinds trainer`); an unknown one raises `GraphError`
        (FG003, naming the setting a TRL name such as `logging_steps` stands for)."""
        pos = _caller()
        self._trainer = replace(self._trainer, **_known(TrainerSpec, kw, "trainer", pos),
                                pos=pos)
        return self

    def resources(self, **kw: Any) -> GraphBuilder:
        """`resources:` of a graph file: `pools` maps a pool's name to its settings, as
        there (`pools={"actor": {"size": 2, "models": ["actor"], "cpus": 4}}`)."""
        pos = _caller()
        known = dict(_known(ResourceSpec, kw, "resources", pos))
        if "pools" in known:
            known["pools"] = _pools(known["pools"], pos)
        self._resources = replace(self._resources, **known, pos=pos)
        return self

    def plugin(self, module: str) -> GraphBuilder:
        self._plugins.append(Plugin(module, _caller()))
        return self

    def build(self) -> Graph:
        return Graph(
            name=self._name, nodes=tuple(self._nodes), models=tuple(self._models),
            data=tuple(self._data), dims=tuple(self._dims), trainer=self._trainer,
            resources=self._resources, plugins=tuple(self._plugins), source="<python>",
        )


def _pools(pools: Any, pos: SourcePos) -> tuple[PoolSpec, ...]:
    """`resources(pools=...)`: pool name -> its settings (a mapping, or a `PoolSpec`)."""
    if not isinstance(pools, Mapping):
        raise GraphError((error("FG004", "`resources.pools` must map each pool's name to "
                                "its settings", pos,
                                hint='e.g. pools={"actor": {"size": 2, "models": '
                                     '["actor"]}}'),))
    out = []
    for name, spec in pools.items():
        if isinstance(spec, PoolSpec):
            out.append(replace(spec, name=str(name)))
            continue
        where = f"resources.pools.{name}"
        if not isinstance(spec, Mapping):
            raise GraphError((error("FG004", f"`{where}` must be a mapping of settings "
                                    f"(size, models, cpus, ...), not {type(spec).__name__}",
                                    pos),))
        values = dict(_known(PoolSpec, {k: v for k, v in spec.items() if k != "name"},
                             where, pos))
        for key in ("custom_resources", "label_selector"):  # written as mappings
            if isinstance(values.get(key), Mapping):
                values[key] = tuple(values[key].items())
        out.append(PoolSpec(str(name), **{"size": 1, **values}, pos=pos))
    return tuple(out)


def _known(record: type, values: Mapping[str, Any], where: str, pos: SourcePos
           ) -> Mapping[str, Any]:
    """`values` when each key is a setting `record` declares (lists as tuples); else
    `GraphError` with the graph file's FG003 for each other key, at the user's line."""
    known = [f.name for f, _ in declared(record)]
    unknown = [key for key in values if key not in known]
    if unknown:
        raise GraphError(tuple(unknown_key(key, known, where, pos) for key in unknown))
    # a list where the record keeps a tuple (`loggers=["console", "wandb"]`, `betas`)
    return {key: tuple(v) if isinstance(v, list) else v for key, v in values.items()}


def _data_path(path: Any, what_for: str) -> tuple[str, str | None]:
    """(the path a graph holds, the held-out rows' path or None) of a dataset given as a
    path or as a Python object (`flowgraph.data.held.hold`)."""
    if isinstance(path, (str, Path)):
        return resolve_data_path(str(path), Path.cwd()), None
    return hold(path, what_for)


def _ref(src: PortRef | str, pos: SourcePos) -> PortRef:
    if isinstance(src, PortRef):
        return src
    node, dot, port = str(src).partition(".")
    if not dot or not node or not port:
        raise IRError(f"input {src!r} must be a node output (`gen.responses`) or `handle.port`")
    return PortRef(node, port, pos)
