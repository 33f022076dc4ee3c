"""The calling convention between an executor and a node implementation.

A kind's implementation (`KindSpec.impl`, `module:function`) is called with its wired
inputs as keyword arguments named after the input ports, its params as keyword
arguments named after the params, and — only if the function declares them — these
resources by name:

    ctx        the `NodeContext` below (update nodes, stateful nodes)
    model      the node's bound model (an nn.Module), `None` when unbound; a parameter
               named `critic` receives it too
    tokenizer  the bound model's tokenizer

It returns either a mapping from output-port name to value, or a tuple in the order
of the kind's outputs (so pure functions such as `gae` are used as they are). A sink
(update node) returns an empty mapping and reports through `ctx.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

RESOURCE_ARGS = ("ctx", "model", "critic", "tokenizer")
"""Parameter names through which an implementation receives executor resources."""


@dataclass
class NodeContext:
    """Per-call resources and sinks; the executor makes one per node per step."""

    node: str
    """The node's name in the graph."""
    kind: str
    step: int
    """0-based training step (the prologue of hoisted nodes runs at step -1)."""
    seed: int
    """The run's seed; derive per-sample randomness from (seed, step, sample index)."""
    device: str = "cpu"
    model: Any = None
    tokenizer: Any = None
    optimizer: Any = None
    """For update nodes: the torch optimizer of the bound model."""
    scheduler: Any = None
    """For update nodes: the LR scheduler, stepped once per optimizer step."""
    grad_clip: float = 0.0
    """Max global grad norm from the model's optimizer settings; 0 disables clipping."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalar metrics, verl names (`actor/pg_loss`); the executor logs them per step."""
    state: dict[str, Any] = field(default_factory=dict)
    """State that lives across steps (a KL controller's coefficient); checkpointed."""
    dims: dict[str, int] = field(default_factory=dict)
    """The graph's bound global dims (Bp, N, P, T, …), for params that default to them."""
    dp_rank: int = 0
    """This process's rank among the `dp_size` data-parallel workers running the node."""
    dp_size: int = 1
    row_offset: int = 0
    """Row of the global batch where this worker's slice starts (per-sample seeds)."""
    reduce: Callable[[Any, str], Any] | None = None
    """Set by a data-parallel executor: all-reduce a tensor in place across the node's
    workers (`op` one of "sum", "min", "max") and return it. Nodes call `all_reduce`."""

    def all_reduce(self, tensor: Any, op: str = "sum") -> Any:
        """`tensor` reduced over the data-parallel workers; itself on one worker."""
        return tensor if self.reduce is None or self.dp_size == 1 else self.reduce(tensor, op)
