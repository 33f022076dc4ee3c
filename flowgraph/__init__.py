"""flowgraph: a declarative dataflow-graph compiler for RL post-training of LLMs.

Importing flowgraph (and running `flowgraph check`) never imports torch.
"""

from flowgraph.builder import GraphBuilder
from flowgraph.check import CheckResult, check_graph
from flowgraph.contracts import TensorSpec
from flowgraph.diagnostics import Diagnostic
from flowgraph.errors import FlowgraphError, GraphError
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
from flowgraph.registry import KindSpec, ParamSpec, PortSpec, Registry, node_kind, register_kind

__version__ = "0.1.0"

__all__ = [
    "CheckResult",
    "DataSpec",
    "Diagnostic",
    "DimBinding",
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
    "TensorSpec",
    "TrainerSpec",
    "check_graph",
    "graph_from_yaml",
    "graph_to_yaml",
    "load_graph",
    "node_kind",
    "register_kind",
]
