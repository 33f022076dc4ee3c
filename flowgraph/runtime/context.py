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
of the kind's outputs (so pure functions such as `gae` are used as they are). An
update kind (a sink) returns an `Update`, its batch and its loss, which the executor's
update loop trains on (`flowgraph.runtime.update`); the loop reports through
`ctx.metrics`.

Nodes are pure: no collective, no sharded tensor, no engine of their own. What they
need of the processes that run them they ask `NodeContext` for: `ctx.workers` (is a
flag true on every data-parallel worker, a sum of metrics over them),
`ctx.optimizer_step()` (gradients summed over the workers, their global norm, clipping,
the step) and `ctx.rollout_engine(backend)` (the vLLM engine). The executors' worker
layer implements them (`flowgraph.compilers.targets.process_groups.DataParallel`,
`flowgraph.compilers.worker.rollout_engine`); `Workers` below is the one-process case.

`Impl` loads an implementation from its registry path and `named_outputs` reads what it
returned; the executors and `flowgraph.testing.assert_honours_contract` call both.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from flowgraph.errors import FlowgraphError, NonFiniteError
from flowgraph.runtime.update import LOOP_PARAMS

RESOURCE_ARGS = ("ctx", "model", "critic", "tokenizer")
"""Parameter names through which an implementation receives executor resources."""

EXECUTOR_PARAMS = ("timeout_s",)
"""Params every kind takes that the executor reads around the node's call (a call's time
limit), passed to the implementation only where it declares them. Their specs (type,
default, doc) are `flowgraph.kindspec.NODE_PARAMS`, which names these (a test holds the
two to one list): the calling convention sits below the kinds' records, which import the
update loop's params from this package."""


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
    tokenizers: Mapping[str, Any] = field(default_factory=dict)
    """Every model's tokenizer, by model name: a node that reads another model's tokens
    (a judge decodes the policy's responses) asks for that model's."""
    run_dir: str | None = None
    """The run's folder, where a node keeps what lasts across resumes (a judge's cache of
    replies); None outside a run."""
    optimizer: Any = None
    """For update nodes: the torch optimizer of the bound model (the update loop's)."""
    scheduler: Any = None
    """For update nodes: the LR scheduler, which the update loop steps once per call."""
    grad_clip: float = 0.0
    """Max global grad norm from the model's optimizer settings; 0 disables clipping."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalar metrics, verl names (`actor/pg_loss`); the executor logs them per step."""
    state: dict[str, Any] = field(default_factory=dict)
    """State that lives across steps (a KL controller's coefficient); checkpointed."""
    dims: dict[str, int] = field(default_factory=dict)
    """The graph's bound global dims (Bp, N, P, T, …), for params that default to them."""
    row_offset: int = 0
    """Row of the global batch where this worker's slice starts (per-sample seeds)."""
    workers: Workers = field(default_factory=lambda: Workers())
    """The data-parallel workers running this call, as services (one process unless
    the executor says otherwise)."""
    strict: bool = False
    """Strict mode (`trainer.strict`, `--strict`): a node checks itself on every call
    where it would otherwise on its first (an agent rollout's rows against its samples)."""
    engines: Callable[[str], Any] | None = None
    """Set by an executor: the rollout engine of a backend; nodes call `rollout_engine`."""
    version: int | None = None
    """The policy version of the weights the node's model holds: the updates applied to
    them (an asynchronous rollout's may be behind `step`); None: `step`'s."""
    refresh: Callable[[], int] | None = None
    """Set by an executor running partial rollouts (`trainer.partial_rollouts`): takes the
    newest published weights into the models when newer than those held, and returns
    their version; nodes call `newest_weights`."""

    def optimizer_step(self) -> float:
        """One step of `optimizer` on the gradients the workers' backward passes left,
        summed over the workers; returns their global L2 norm before clipping to
        `grad_clip` (when > 0), and zeroes them. A non-finite norm takes no step: it
        raises `NonFiniteError` naming the node and step, the gradients cleared."""
        norm = self.workers.clip_grad_norm(self.model, self.grad_clip)
        if not math.isfinite(norm):
            self.model.zero_grad(set_to_none=True)
            raise NonFiniteError(self.node, self.step, "gradient norm")
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return norm

    def policy_version(self) -> int:
        """The version of the weights the node's model holds (`version`)."""
        return self.step if self.version is None else self.version

    def newest_weights(self) -> int:
        """Between two turns of a rollout: the newest weights the executor has published
        into the models (partial rollouts; otherwise nothing changes), and their version."""
        if self.refresh is not None:
            self.version = self.refresh()
        return self.policy_version()

    def rollout_engine(self, backend: str) -> Any:
        """The executor's engine for `backend` (e.g. "vllm"): `.rollout(model, tokenizer,
        prompts, prompt_mask, seeds, spec, gpu_memory_utilization)`."""
        if self.engines is None:
            raise FlowgraphError(
                f"node `{self.node}`: backend `{backend}` needs a rollout engine, which the "
                "executor provides (calling the node yourself: pass NodeContext(engines="
                "flowgraph.compilers.worker.rollout_engine))")
        return self.engines(backend)


class Workers:
    """What a node may ask of the data-parallel workers that run it: here one process.

    A distributed executor passes its own
    (`flowgraph.compilers.targets.process_groups.DataParallel`), where each service is a
    collective: every worker calls it at the same point.
    """

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every worker."""
        return flag

    def sum(self, values: Mapping[str, float]) -> dict[str, float]:
        """Each value summed over the workers."""
        return dict(values)

    def max(self, value: int) -> int:
        """The largest `value` of the workers (the micro-batch count every worker of a
        sharded model must run, as each forward is a collective)."""
        return value

    def inference(self, model: Any) -> AbstractContextManager[Any]:
        """The mode to run `model` in when nothing needs its gradients:
        `torch.inference_mode` (no view or version tracking). A distributed executor
        gives `torch.no_grad` for a sharded model, whose FSDP hooks need both."""
        import torch

        return torch.inference_mode()

    def clip_grad_norm(self, model: Any, max_norm: float) -> float:
        """The L2 norm of `model`'s gradients, summed over the workers; scaled down to
        `max_norm` first when that is > 0 and the norm exceeds it (torch's
        `clip_grad_norm_`)."""
        import torch

        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.nn.utils.get_total_norm([p.grad for p in params]))


@dataclass(frozen=True)
class Impl:
    """A kind's implementation and how to call it."""

    fn: Callable[..., Any]
    accepts: frozenset[str]
    """Keyword parameters the function declares."""
    any_keyword: bool = False
    """It takes `**kwargs` too (`weighted_sum`'s terms, one per wired input)."""

    @staticmethod
    def at(path: str, owner: str) -> Impl:
        """The implementation at registry path `path` (`module:function`); `owner` names
        whose it is in the error ("kind `gae`", "node `adv`")."""
        try:
            fn = Impl.load_function(path)
        except FlowgraphError as exc:
            raise FlowgraphError(f"{owner}: {exc}") from exc
        return Impl.of(fn)

    @staticmethod
    def of(fn: Callable[..., Any]) -> Impl:
        """How to call `fn` (a plan's own implementation: `ExecutionPlan.implementation`)."""
        params = inspect.signature(fn).parameters
        return Impl(fn, frozenset(params), any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()))

    @staticmethod
    def load_function(path: str) -> Callable[..., Any]:
        """The function a registry path (`module:function`) names."""
        module, _, attr = path.partition(":")
        try:
            fn = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
        except (ImportError, AttributeError) as exc:
            raise FlowgraphError(f"implementation `{path}` cannot be imported: {exc}") from exc
        return fn  # type: ignore[return-value]

    def verify_names(self, node: str, kind: str, path: str, inputs: Iterable[str],
                     params: Iterable[str], trains: bool) -> None:
        """Every input and param the node is called with must be accepted, before any
        step runs; an update kind's mini-batch params are the update loop's
        (`runtime.update.LOOP_PARAMS`), not its implementation's."""
        names = [*inputs, *(p for p in params if not (trains and p in LOOP_PARAMS)
                            and p not in EXECUTOR_PARAMS)]
        missing = [] if self.any_keyword else [n for n in names if n not in self.accepts]
        if missing:
            raise FlowgraphError(
                f"node `{node}` (kind {kind}): implementation `{path}` does not "
                f"accept {', '.join(f'`{m}`' for m in missing)} that the kind declares")


def named_outputs(outputs: Sequence[str], result: Any) -> dict[str, Any]:
    """An implementation's return value as output-port name -> value; `outputs`: the
    kind's output names, in order."""
    if isinstance(result, dict):
        return result
    if isinstance(result, tuple):
        return dict(zip(outputs, result, strict=False))
    if len(outputs) == 1:
        return {outputs[0]: result}
    raise TypeError(f"returned {type(result).__name__}; expected a dict of outputs or a tuple")
