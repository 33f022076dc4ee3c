"""One process's part of a run: the models it hosts, their optimizers and tokenizers, the
nodes' implementations and state, and the call of one node in this process.

Every target calls nodes through a `Worker`: the local target's one process, each fsdp
rank, each worker of a Ray pool and the Ray driver (for model-free nodes), and the
producer process of asynchronous rollouts. What differs between them is given to the
worker, not overridden: which models it hosts and how each is placed (whole, or sharded
over its group), and the data-parallel facts of a call (`dp`: this worker's rank, the
group size, the row its slice starts at, the group's collectives as `Workers`).

`call` is the calling convention of `flowgraph.runtime.context`: inputs and params as
keyword arguments, the resources a function declares (`ctx`, `model`, `tokenizer`),
gradients only for updates. Every error a node raises comes back as "while executing
node X (kind K) at step S" with the line of the node's own code (`node_error`).
"""

from __future__ import annotations

import os
import sysconfig
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from flowgraph.compilers import update_loop
from flowgraph.compilers.build import (
    adapters_off,
    import_plugins,
    load_model,
    load_tokenizers,
    make_optimizer,
)
from flowgraph.errors import DEBUG_ENV, FlowgraphError, NodeError, NonFiniteError, at_step
from flowgraph.plan import ExecutionPlan, ModelPlacement
from flowgraph.runtime.context import RESOURCE_ARGS, Impl, NodeContext, named_outputs

if TYPE_CHECKING:
    from flowgraph.runtime.prometheus import Exporter

Place = Callable[[ModelPlacement, torch.nn.Module], torch.nn.Module]
"""How a target places a loaded model: as it is, or sharded over the worker's group."""


@dataclass
class ExecOptions:
    """What one process of a run needs besides the plan."""

    run_dir: Path
    device: str = "cpu"
    strict: bool = False
    resume: bool = False
    out: TextIO | None = None
    tensorboard: bool = True
    exporter: Exporter | None = None
    """Feeds the Prometheus endpoint with every step row (`--metrics-port`)."""
    allow_changed: tuple[str, ...] = ()
    """Settings a resumed run may change although they shaped its checkpoint
    (`--allow-changed KEY`; `flowgraph.compilers.resume`)."""


def _whole(placed: ModelPlacement, model: torch.nn.Module) -> torch.nn.Module:
    return model


class Worker:
    """The models of `hosted` and every node's implementation, in this process."""

    def __init__(self, plan: ExecutionPlan, opts: ExecOptions,
                 hosted: tuple[ModelPlacement, ...], *, place: Place = _whole,
                 trained: frozenset[str] | None = None) -> None:
        self.plan, self.graph, self.opts = plan, plan.graph, opts
        self.hosted, self.place = hosted, place
        self.trained = (trained if trained is not None else frozenset(
            n.model for n in plan.nodes if n.trains and n.model is not None))
        """The models this worker makes optimizers for (the updates' models)."""
        self.nodes = {n.name: n for n in plan.graph.nodes}
        self.placed = {n.name: n for n in plan.nodes}
        """Each node's plan: its implementation, params and kind facts."""
        self.consumed = {(ref.node, ref.port) for ref, _, _ in plan.graph.edges()}
        self.impls: dict[str, Impl] = {}
        self.models: dict[str, Any] = {}
        self.tokenizers: dict[str, Any] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self.adapters_off: set[str] = set()
        """Models placed as a LoRA model's base: nodes run that model, adapters off."""
        self.node_state: dict[str, dict[str, Any]] = {n: {} for n in self.nodes}
        self.dims = {d.name: d.value for d in plan.dims}

    def prepare(self) -> None:
        """What fails cheaply, before any model loads: model paths, implementations
        (each accepting what the plan calls it with), tokenizers."""
        from flowgraph.nodes.models import check_model_path

        for m in self.graph.models:
            check_model_path(m.path)
        import_plugins(self.plan)
        for name in self.nodes:
            n = self.placed[name]
            self.impls[name] = Impl.at(n.impl, f"node `{name}`")
            self.impls[name].verify_names(name, n.kind, n.impl, [i.port for i in n.inputs],
                                          [p.name for p in n.params], n.trains)
        self.tokenizers = load_tokenizers(self.graph)

    def load_models(self) -> None:
        """The hosted models, placed, and the optimizers of those an update trains."""
        seed = self.graph.trainer.seed
        for placed in self.hosted:
            spec = self.graph.model(placed.name)
            assert spec is not None  # the plan's verifier holds pools to the graph's models
            if placed.base_of is not None:
                continue
            model = self.place(placed, load_model(spec, placed, self.opts.device, seed))
            self.models[spec.name] = model
            if spec.trainable and spec.name in self.trained:
                self.optimizers[spec.name], self.schedulers[spec.name] = \
                    make_optimizer(spec, model, self.graph.trainer.steps)
        for placed in self.hosted:  # a LoRA model's base: that model, its adapters off
            if placed.base_of is not None:
                self.models[placed.name] = self.models[placed.base_of]
                self.adapters_off.add(placed.name)

    def saved_models(self) -> dict[str, torch.nn.Module]:
        """The models a checkpoint holds: the trained ones. A frozen model (a reference, a
        reward model) is rebuilt from its source when a run resumes, never saved again."""
        return {n: m for n, m in self.models.items() if n in self.optimizers}

    def context(self, name: str, step: int, **dp: Any) -> NodeContext:
        """The node's context; `dp` sets the data-parallel fields (row_offset, workers)
        where a target splits the batch."""
        node, trains = self.nodes[name], self.placed[name].trains
        model = node.model or ""
        spec = self.graph.model(model) if node.model else None
        return NodeContext(
            node=name, kind=node.kind, step=step, seed=self.graph.trainer.seed,
            device=self.opts.device, model=self.models.get(model),
            tokenizer=self.tokenizers.get(model),
            optimizer=self.optimizers.get(model) if trains else None,
            scheduler=self.schedulers.get(model) if trains else None,
            grad_clip=spec.optimizer.grad_clip if spec and spec.optimizer else 0.0,
            state=self.node_state[name], dims=dict(self.dims),
            engines=partial(rollout_engine, verify_every=self.graph.trainer.verify_sync_every),
            **dp)

    def dispatch(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
                 metrics: dict[str, float], *, evaluation: bool = False
                 ) -> tuple[dict[str, Any], float]:
        """`Interpreter`'s dispatch in one process: the node, or at evaluation an
        update's held-out metrics, here on the whole batch."""
        if evaluation:
            self.evaluate_update(name, inputs, step, params, metrics)
            return {}, 0.0
        return self.call(name, inputs, step, params, metrics)

    def call(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
             metrics: dict[str, float], **dp: Any) -> tuple[dict[str, Any], float]:
        """Call one node's implementation on `inputs` (port -> value); (outputs, seconds
        spent inside it). `dp`: see `context`; an update's `dp_rank` / `dp_size` are this
        worker's share of every mini-batch in the update loop, which trains the
        `Update` the implementation returns."""
        placed, impl = self.placed[name], self.impls[name]
        kw: dict[str, Any] = dict(inputs)
        kw.update({k: v for k, v in params.items() if k in impl.accepts})
        for o in placed.outputs:
            if o.optional and (name, o.port) in self.consumed and f"with_{o.port}" in impl.accepts:
                kw[f"with_{o.port}"] = True
        rank, size = dp.pop("dp_rank", 0), dp.pop("dp_size", 1)
        ctx = self.context(name, step, **dp)
        for arg in RESOURCE_ARGS:
            if arg in impl.accepts:
                kw[arg] = (ctx if arg == "ctx" else ctx.tokenizer if arg == "tokenizer"
                           else ctx.model)
        t0 = time.perf_counter()
        # Only updates build autograd graphs; everything else is inference, and a
        # log-prob carrying the actor's graph into the update would be backpropagated
        # through twice.
        with torch.set_grad_enabled(placed.trains), self._base(name, ctx):
            result = self._guarded(name, step, partial(impl.fn, **kw))
            if placed.trains:
                self._guarded(name, step, partial(update_loop.train, ctx, result, params,
                                                  rank=rank, size=size))
                result = {}
        metrics.update(ctx.metrics)
        return named_outputs([o.port for o in placed.outputs], result), time.perf_counter() - t0

    def evaluate_update(self, name: str, inputs: dict[str, Any], step: int,
                        params: dict[str, Any], metrics: dict[str, float]) -> None:
        """An update's metrics on held-out `inputs` (its loss's `held_out`), no step."""
        impl = self.impls[name]
        ctx = self.context(name, step)
        kw = {**inputs, **{k: v for k, v in params.items() if k in impl.accepts}}
        with torch.no_grad(), self._base(name, ctx):
            update = self._guarded(name, step, partial(impl.fn, **kw))
            self._guarded(name, step, partial(update_loop.evaluate, ctx, update))
        metrics.update(ctx.metrics)

    def _base(self, name: str, ctx: NodeContext) -> Any:
        node = self.nodes[name]
        return (adapters_off(ctx.model) if node.model in self.adapters_off
                and ctx.model is not None else nullcontext())

    def _guarded(self, name: str, step: int, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (NonFiniteError, NodeError):
            raise
        except Exception as exc:
            raise node_error(self, name, step, exc) from exc


def rollout_engine(backend: str, verify_every: int = 0) -> Any:
    """`NodeContext.engines`: the worker layer's rollout engine of a backend
    (`verify_every`: `trainer.verify_sync_every`)."""
    if backend != "vllm":
        raise FlowgraphError(f"no rollout engine for backend `{backend}` (there is `vllm`)")
    from flowgraph.compilers import vllm_engine  # vLLM is optional and slow to import

    return vllm_engine.VllmRollout(verify_every)


# --- errors ----------------------------------------------------------------------------


_LIBRARIES = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                       "platlib"))


def user_frame(exc: BaseException) -> traceback.FrameSummary:
    """The innermost frame of the node's own code: below the executor's call, outside
    the standard library and installed packages (torch, transformers...); the innermost
    frame of all when every frame is a library's (a node installed as a package)."""
    while exc.__cause__ is not None:  # re-raised with context (a reward fn's row): the
        exc = exc.__cause__          # frame is the original error's
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0]: the executor's call
    own = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    return (own or frames or traceback.extract_tb(exc.__traceback__))[-1]


def node_error(worker: Worker, name: str, step: int, exc: Exception) -> NodeError:
    """What a node raised, as one message: the node, its kind and graph line, the step,
    the error, and the line of the node's own code that raised it (a plugin's file,
    not flowgraph's or torch's). The full traceback goes to `run_dir/traceback.txt`,
    and into the message under `flowgraph run --debug`."""
    node = worker.nodes[name]
    full = "".join(traceback.format_exception(exc))
    where = worker.opts.run_dir / "traceback.txt"
    try:
        where.write_text(full)
        saved = f"\n(the full traceback: {where}; `flowgraph run --debug` prints it)"
    except OSError:
        saved = ""
    frame = user_frame(exc)
    model = f"model {node.model}, " if node.model else ""
    text = (f"while executing node `{name}` (kind {node.kind}, {model}{node.pos}) "
            f"{at_step(step)}: "
            f"{type(exc).__name__}: {exc}\n  at {frame.filename}:{frame.lineno} in "
            f"{frame.name}: {(frame.line or '').strip()}")
    return NodeError(text + (f"\n{full}" if os.environ.get(DEBUG_ENV) else saved))


# --- the process -------------------------------------------------------------------------


def quiet_hf() -> None:
    """Hugging Face's per-load progress bars would drown the one line per step."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def pick_device(requested: str) -> str:
    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda:0"
    if requested == "cuda":
        raise FlowgraphError("resources.device is `cuda` but torch sees no CUDA device")
    return "cpu"
