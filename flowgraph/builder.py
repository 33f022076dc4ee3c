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
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowgraph.errors import IRError
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
    PortRef,
    ResourceSpec,
    TrainerSpec,
)
from flowgraph.paths import resolve_path
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
              lora: dict[str, Any] | LoraSpec | None = None, **kw: Any) -> str:
        """Declare a model; `lora` ({r, alpha, dropout, target_modules}) trains adapters."""
        pos = _caller()
        if isinstance(lora, dict):
            targets = lora.get("target_modules", ("all-linear",))
            lora = LoraSpec(**{**lora, "target_modules": (
                (targets,) if isinstance(targets, str) else tuple(targets))}, pos=pos)
        opt = optimizer
        if isinstance(optimizer, dict):
            betas = optimizer.get("betas")
            fixed = {**optimizer, **({"betas": tuple(betas)} if betas is not None else {})}
            opt = OptimizerSpec(**fixed, pos=pos)
        assert opt is None or isinstance(opt, OptimizerSpec)
        if isinstance(kw.get("tokenizer"), str):
            kw["tokenizer"] = resolve_path(kw["tokenizer"], Path.cwd(), hub=True)
        self._models.append(ModelSpec(name, resolve_path(path, Path.cwd(), hub=True),
                                      trainable=trainable, optimizer=opt,
                                      config=Params.of(config or {}, pos), lora=lora, pos=pos,
                                      **kw))
        return name

    def data(self, name: str, kind: str, path: str, **params: Any) -> Handle:
        pos = _caller()
        if isinstance(params.get("eval_path"), str):
            params["eval_path"] = resolve_path(params["eval_path"], Path.cwd())
        self._data.append(DataSpec(name, kind, resolve_path(path, Path.cwd()),
                                   Params.of(params, pos), pos))
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
        self._trainer = replace(self._trainer, **kw, pos=_caller())
        return self

    def resources(self, **kw: Any) -> GraphBuilder:
        self._resources = replace(self._resources, **kw, pos=_caller())
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


def _ref(src: PortRef | str, pos: SourcePos) -> PortRef:
    if isinstance(src, PortRef):
        return src
    node, dot, port = str(src).partition(".")
    if not dot or not node or not port:
        raise IRError(f"input {src!r} must be a node output (`gen.responses`) or `handle.port`")
    return PortRef(node, port, pos)
