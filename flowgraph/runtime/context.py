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

`Impl` loads an implementation from its registry path and `named_outputs` reads what it
returned; the executors and `flowgraph.testing.assert_honours_contract` call both.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowgraph.errors import FlowgraphError

if TYPE_CHECKING:
    from flowgraph.ir import NodeSpec
    from flowgraph.registry import KindSpec

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


@dataclass(frozen=True)
class Impl:
    """A kind's implementation and how to call it."""

    fn: Callable[..., Any]
    accepts: frozenset[str]
    """Keyword parameters the function declares."""

    @staticmethod
    def load(kind: KindSpec) -> Impl:
        module, _, attr = kind.impl.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise FlowgraphError(f"kind `{kind.name}`: implementation `{kind.impl}` cannot be "
                                 f"imported: {exc}") from exc
        params = inspect.signature(fn).parameters
        return Impl(fn, frozenset(params))

    def verify(self, node: NodeSpec, kind: KindSpec) -> None:
        """Every declared input and param must be accepted, before any step runs."""
        names = [p.name for p in kind.inputs] + [p.name for p in kind.params]
        missing = [n for n in names if n not in self.accepts]
        if missing:
            raise FlowgraphError(
                f"node `{node.name}` (kind {kind.name}): implementation `{kind.impl}` does not "
                f"accept {', '.join(f'`{m}`' for m in missing)} that the kind declares")


def named_outputs(kind: KindSpec, result: Any) -> dict[str, Any]:
    """An implementation's return value as output-port name -> value."""
    if isinstance(result, dict):
        return result
    if isinstance(result, tuple):
        return dict(zip([p.name for p in kind.outputs], result, strict=False))
    if len(kind.outputs) == 1:
        return {kind.outputs[0].name: result}
    raise TypeError(f"returned {type(result).__name__}; expected a dict of outputs or a tuple")
