"""flowgraph: a declarative dataflow-graph compiler for RL post-training of LLMs.

Importing flowgraph (and running `flowgraph check`) never imports torch. Public names
are loaded on first use (PEP 562), so the CLI pays only for what a command needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Env": "flowgraph.agent.env",
    "tool": "flowgraph.agent.tools",
    "check": "flowgraph.api",
    "compile": "flowgraph.api",
    "debug": "flowgraph.api",
    "export": "flowgraph.api",
    "run": "flowgraph.api",
    "load_plan": "flowgraph.api",
    "CompileError": "flowgraph.errors",
    "ExecutionPlan": "flowgraph.plan",
    "GraphBuilder": "flowgraph.builder",
    "CheckResult": "flowgraph.checker",
    "check_graph": "flowgraph.checker",
    "TensorSpec": "flowgraph.contracts",
    "Diagnostic": "flowgraph.diagnostics",
    "FlowgraphError": "flowgraph.errors",
    "GraphError": "flowgraph.errors",
    "Stopped": "flowgraph.errors",
    "graph_from_yaml": "flowgraph.frontend",
    "graph_to_yaml": "flowgraph.frontend",
    "load_graph": "flowgraph.frontend",
    "DataSpec": "flowgraph.ir",
    "DimBinding": "flowgraph.ir",
    "Graph": "flowgraph.ir",
    "ModelSpec": "flowgraph.ir",
    "NodeSpec": "flowgraph.ir",
    "OptimizerSpec": "flowgraph.ir",
    "Params": "flowgraph.ir",
    "PortRef": "flowgraph.ir",
    "ResourceSpec": "flowgraph.ir",
    "TrainerSpec": "flowgraph.ir",
    "KindSpec": "flowgraph.registry",
    "ParamSpec": "flowgraph.registry",
    "PortSpec": "flowgraph.registry",
    "Registry": "flowgraph.registry",
    "node_kind": "flowgraph.registry",
    "register_kind": "flowgraph.registry",
}

__all__ = [
    "CheckResult",
    "CompileError",
    "DataSpec",
    "Diagnostic",
    "DimBinding",
    "Env",
    "ExecutionPlan",
    "FlowgraphError",
    "Graph",
    "GraphBuilder",
    "GraphError",
    "KindSpec",
    "ModelSpec",
    "NodeSpec",
    "OptimizerSpec",
    "ParamSpec",
    "Params",
    "PortRef",
    "PortSpec",
    "Registry",
    "ResourceSpec",
    "Stopped",
    "TensorSpec",
    "TrainerSpec",
    "check",
    "check_graph",
    "compile",
    "debug",
    "export",
    "graph_from_yaml",
    "graph_to_yaml",
    "load_graph",
    "load_plan",
    "node_kind",
    "register_kind",
    "run",
    "tool",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flowgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from flowgraph.agent.env import Env
    from flowgraph.agent.tools import tool
    from flowgraph.api import check, compile, debug, export, load_plan, run
    from flowgraph.builder import GraphBuilder
    from flowgraph.checker import CheckResult, check_graph
    from flowgraph.contracts import TensorSpec
    from flowgraph.diagnostics import Diagnostic
    from flowgraph.errors import CompileError, FlowgraphError, GraphError, Stopped
    from flowgraph.frontend import graph_from_yaml, graph_to_yaml, load_graph
    from flowgraph.ir import (
        DataSpec,
        DimBinding,
        Graph,
        ModelSpec,
        NodeSpec,
        OptimizerSpec,
        Params,
        PortRef,
        ResourceSpec,
        TrainerSpec,
    )
    from flowgraph.plan import ExecutionPlan
    from flowgraph.registry import (
        KindSpec,
        ParamSpec,
        PortSpec,
        Registry,
        node_kind,
        register_kind,
    )
