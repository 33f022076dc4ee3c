"""One process's part of a run: the models it hosts, their optimizers and tokenizers, the
nodes' implementations and state, and the call of one node in this process.

Every target calls nodes through a `Worker`: the local target's one process, each fsdp
rank, each worker of a Ray pool and the Ray driver (for model-free nodes), and the
producer process or rollout pool of asynchronous rollouts. What differs between them is
given to the worker, not overridden: which models it hosts and how each is placed
(whole, or sharded over its group), and the data-parallel facts of a call (`dp`: this
worker's rank, the group size, the row its slice starts at, the group's collectives as
`Workers`).

`call` is the calling convention of `flowgraph.runtime.context`: inputs and params as
keyword arguments, the resources a function declares (`ctx`, `model`, `tokenizer`),
gradients only for updates. Every error a node raises comes back as "while executing
node X (kind K) at step S" with the line of the node's own code (`node_error`).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from flowgraph.compilers import update_loop
from flowgraph.compilers.build import (
    adapters_off,
    autocast,
    import_plugins,
    load_model,
    load_tokenizers,
    make_optimizer,
)
from flowgraph.compilers.checkpoint.store import latest_checkpoint
from flowgraph.compilers.export import load_from_run
from flowgraph.compilers.signals import deadline
from flowgraph.errors import (
    DEBUG_ENV,
    FlowgraphError,
    NodeError,
    NodeTimeout,
    NonFiniteError,
    at_step,
)
from flowgraph.ir import ModelSpec
from flowgraph.plan import ExecutionPlan, ModelPlacement
from flowgraph.runtime import readonly
from flowgraph.runtime.context import RESOURCE_ARGS, Impl, NodeContext, named_outputs
from flowgraph.runtime.readonly import freeze, thaw
from flowgraph.spelling import option

if TYPE_CHECKING:
    from flowgraph.compilers.signals import Preemption
    from flowgraph.runtime.prometheus import Exporter

Place = Callable[[ModelPlacement, ModelSpec, torch.nn.Module], torch.nn.Module]
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
    step_timeout_s: float = 0.0
    """A node call running this long stops the run (the local target's
    `trainer.step_timeout_s`; the fsdp and ray targets watch their workers instead)."""
    stop: Preemption | None = None
    """This process's stop requests (SIGTERM, SIGINT), which the loop honours."""
    allow_changed: tuple[str, ...] = ()
    """Settings a resumed run may change although they shaped its checkpoint
    (`--allow-changed KEY`; `flowgraph.compilers.checkpoint.resume`)."""


def _whole(placed: ModelPlacement, spec: ModelSpec, model: torch.nn.Module
           ) -> torch.nn.Module:
    return model


class Worker:
    """The models of `hosted` and every node's implementation, in this process."""

    def __init__(self, plan: ExecutionPlan, opts: ExecOptions,
                 hosted: tuple[ModelPlacement, ...], *, place: Place = _whole,
                 trained: frozenset[str] | None = None) -> None:
        self.plan, self.opts = plan, opts
        self.hosted, self.place = hosted, place
        self.trained = (trained if trained is not None else frozenset(
            n.model for n in plan.nodes if n.trains and n.model is not None))
        """The models this worker makes optimizers for (the updates' models)."""
        self.placed = {n.name: n for n in plan.nodes}
        """Each node's plan: its implementation, params and kind facts."""
        self.nodes = [n.name for n in plan.nodes if n.category != "data"]
        """The nodes (not the data sources), each with an implementation to call."""
        self.consumed = {i.ref for n in plan.nodes for i in n.inputs}
        self.impls: dict[str, Impl] = {}
        self.models: dict[str, Any] = {}
        self.tokenizers: dict[str, Any] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self.owners = {p.name: p.base_of or p.name for p in hosted}
        """Hosted model -> the model whose weights it runs (a LoRA model's base: that model)."""
        self.adapters_off: set[str] = set()
        """Models placed as a LoRA model's base: nodes run that model, adapters off."""
        self.node_state: dict[str, dict[str, Any]] = {n: {} for n in self.nodes}
        self.dims = {d.name: d.value for d in plan.dims}
        self.version: int | None = None
        """The policy version the models hold while a producer runs an asynchronous
        rollout (`ProducerNodes.produce`); None: the step's."""
        self.refresh: Callable[[], int] | None = None
        """Partial rollouts: what takes the newest published weights into the models (a
        producer process's, a rollout pool's; `NodeContext.refresh`)."""

    def prepare(self) -> None:
        """What fails cheaply, before any model loads: model paths, implementations
        (each accepting what the plan calls it with), tokenizers."""
        from flowgraph.nodes.models import check_model_path

        for m in self.plan.models:
            check_model_path(m.path)
        import_plugins(self.plan)
        for name in self.nodes:
            n = self.placed[name]
            held = self.plan.implementation(name)  # a kind of the compiling session
            self.impls[name] = Impl.of(held) if held is not None else \
                Impl.at(n.impl, f"node `{name}`")
            self.impls[name].verify_names(name, n.kind, n.impl, [i.port for i in n.inputs],
                                          [p.name for p in n.params], n.trains)
        self.tokenizers = load_tokenizers(self.plan.models)

    def load_models(self) -> None:
        """The hosted models, placed, and the optimizers of those an update trains."""
        seed = self.plan.trainer.seed
        for placed in self.hosted:
            spec = self.plan.model(placed.name)
            if placed.base_of is not None:
                continue
            built = load_model(spec, placed, self.opts.device, seed)
            if spec.init_from is not None and not self._resumes():
                self._init_from(spec, built)
            model = self.place(placed, spec, built)
            self.models[spec.name] = model
            if spec.trainable and spec.name in self.trained:
                self.optimizers[spec.name], self.schedulers[spec.name] = \
                    make_optimizer(spec, model, self.plan.trainer.steps)
        for placed in self.hosted:  # a LoRA model's base: that model, its adapters off
            if placed.base_of is not None:
                self.models[placed.name] = self.models[placed.base_of]
                self.adapters_off.add(placed.name)

    def _resumes(self) -> bool:
        """This run goes on from a checkpoint of its own (which holds its models)."""
        return self.opts.resume and latest_checkpoint(self.opts.run_dir) is not None

    def _init_from(self, spec: ModelSpec, model: torch.nn.Module) -> None:
        """`spec.init_from`'s weights into `model` (whole, before it is sharded), said once."""
        assert spec.init_from is not None
        source = spec.init_from_model or spec.name
        step = load_from_run(Path(spec.init_from), source, model)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"model `{spec.name}` starts from model `{source}` of run "
                  f"`{spec.init_from}` (checkpoint step {step}; init_from), with a fresh "
                  "optimizer", file=self.opts.out or sys.stdout, flush=True)

    def saved_models(self) -> dict[str, torch.nn.Module]:
        """The models a checkpoint holds: the trained ones. A frozen model (a reference, a
        reward model) is rebuilt from its source when a run resumes, never saved again."""
        return {n: m for n, m in self.models.items() if n in self.optimizers}

    def context(self, name: str, step: int, **dp: Any) -> NodeContext:
        """The node's context; `dp` sets the data-parallel fields (row_offset, workers)
        where a target splits the batch."""
        node = self.placed[name]
        model, trains = node.model or "", node.trains
        spec = self.plan.model(model) if node.model else None
        return NodeContext(
            node=name, kind=node.kind, step=step, seed=self.plan.trainer.seed,
            device=self.opts.device, model=self.models.get(model),
            tokenizer=self.tokenizers.get(model), tokenizers=self.tokenizers,
            run_dir=str(self.opts.run_dir),
            optimizer=self.optimizers.get(model) if trains else None,
            scheduler=self.schedulers.get(model) if trains else None,
            grad_clip=spec.optimizer.grad_clip if spec and spec.optimizer else 0.0,
            state=self.node_state[name], dims=dict(self.dims),
            strict=self.opts.strict or self.plan.trainer.strict,
            engines=partial(rollout_engine, verify_every=self.plan.trainer.verify_sync_every),
            version=self.version, refresh=self.refresh, **dp)

    def call(self, name: str, inputs: dict[str, Any], step: int, params: dict[str, Any],
             metrics: dict[str, float], **dp: Any) -> tuple[dict[str, Any], float]:
        """Call one node's implementation on `inputs` (port -> value); (outputs, seconds
        spent inside it). `dp`: see `context`; an update's `dp_rank` / `dp_size` are this
        worker's share of every mini-batch in the update loop, which trains the
        `Update` the implementation returns."""
        placed, impl = self.placed[name], self.impls[name]
        kw: dict[str, Any] = {k: freeze(v) for k, v in on_device(inputs, self.opts.device).items()}
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
        versions = _versions(inputs)
        t0 = time.perf_counter()
        # Only updates build autograd graphs; everything else is inference, and a
        # log-prob carrying the actor's graph into the update would be backpropagated
        # through twice.
        with torch.set_grad_enabled(placed.trains), self._base(name, ctx), \
                self._deadline(name, params):
            result = self._guarded(name, step, partial(impl.fn, **kw))
            if placed.trains:
                self._guarded(name, step, partial(update_loop.train, ctx, result, params,
                                                  rank=rank, size=size))
                result = {}
        self._unwritten(name, step, inputs, versions)
        metrics.update(ctx.metrics)
        outputs = named_outputs([o.port for o in placed.outputs], result)
        return {k: thaw(v) for k, v in outputs.items()}, time.perf_counter() - t0

    def evaluate_update(self, name: str, inputs: dict[str, Any], step: int,
                        params: dict[str, Any], metrics: dict[str, float]) -> None:
        """An update's metrics on held-out `inputs` (its loss's `held_out`), no step."""
        impl = self.impls[name]
        ctx = self.context(name, step)
        kw = {**on_device(inputs, self.opts.device),
              **{k: v for k, v in params.items() if k in impl.accepts}}
        with torch.no_grad(), self._base(name, ctx):
            update = self._guarded(name, step, partial(impl.fn, **kw))
            self._guarded(name, step, partial(update_loop.evaluate, ctx, update))
        metrics.update(ctx.metrics)

    @contextmanager
    def _base(self, name: str, ctx: NodeContext) -> Iterator[None]:
        """The node's model as it runs: a LoRA model's base with its adapters off, and in
        its compute dtype (`autocast`: bf16 over fp32 masters)."""
        node = self.placed[name]
        base = (adapters_off(ctx.model) if node.model in self.adapters_off
                and ctx.model is not None else nullcontext())
        owner = self.owners.get(node.model or "")
        with base, autocast(self.plan.model(owner) if owner else None, self.opts.device):
            yield

    def _deadline(self, name: str, params: dict[str, Any]) -> Any:
        """The node's `timeout_s`, or else this process's step timeout (the local target's
        `trainer.step_timeout_s`), around its call."""
        own = float(params.get("timeout_s") or 0.0)
        limit, setting = ((own, f"nodes.{name}.params.timeout_s") if own
                          else (self.opts.step_timeout_s, "trainer.step_timeout_s"))
        return deadline(limit, f"the node ran past {setting} = {limit:g} s and was stopped "
                               "here")

    def _guarded(self, name: str, step: int, fn: Callable[[], Any]) -> Any:
        """`fn()`, anything it raises (an exit or an interrupt of a plugin's too) as the
        node's error."""
        try:
            return fn()
        except (NonFiniteError, NodeError):
            raise
        except (Exception, SystemExit, KeyboardInterrupt, NodeTimeout) as exc:
            raise node_error(self, name, step, exc) from exc

    def _unwritten(self, name: str, step: int, inputs: dict[str, Any],
                   versions: dict[str, int]) -> None:
        """A node's inputs are read-only to it: a tensor it wrote into in place (its
        version counter moved) would be what every later node reads."""
        written = [port for port, v in versions.items() if inputs[port]._version != v]
        if written:
            node = self.placed[name]
            raise NodeError(
                f"while executing node `{name}` (kind {node.kind}, {node.where}) "
                f"{at_step(step)}: it wrote into its input(s) "
                f"{', '.join(f'`{p}`' for p in written)} in place (an in-place op such as "
                "`.zero_()`, `+=` or `x[i] = ...`); a node's inputs are read-only, as other "
                "nodes read the same tensors: compute on a copy (`x.clone()`) or out of place")


def _versions(inputs: dict[str, Any]) -> dict[str, int]:
    """Each input tensor's version counter (inference tensors, which keep none, cannot
    be written outside inference mode anyway)."""
    return {port: v._version for port, v in inputs.items()
            if isinstance(v, torch.Tensor) and not v.is_inference()}


def rollout_engine(backend: str, verify_every: int = 0) -> Any:
    """`NodeContext.engines`: the worker layer's rollout engine of a backend
    (`verify_every`: `trainer.verify_sync_every`)."""
    if backend != "vllm":
        raise FlowgraphError(f"no rollout engine for backend `{backend}` (there is `vllm`)")
    from flowgraph.compilers.vllm import (
        engine as vllm_engine,  # vLLM is optional and slow to import
    )

    return vllm_engine.VllmRollout(verify_every)


# --- errors ----------------------------------------------------------------------------


TRACEBACK = "traceback.txt"
"""In the run dir: the full traceback of the error that ended the latest attempt."""
_LIBRARIES = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                       "platlib"))


def user_frame(exc: BaseException) -> traceback.FrameSummary:
    """The innermost frame of the node's own code: below the executor's call, outside
    the standard library and installed packages (torch, transformers...); the innermost
    frame of all when every frame is a library's (a node installed as a package)."""
    # re-raised with context (a reward fn's row): the frame is the original error's; a
    # cause never raised (an episode's timeout, made and recorded) has no frame of its own
    while exc.__cause__ is not None and exc.__cause__.__traceback__ is not None:
        exc = exc.__cause__
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0]: the executor's call
    if isinstance(exc, NodeTimeout):  # the last: the alarm's handler, not the node's line
        frames = frames[:-1]
    own = [f for f in frames if not f.filename.startswith(_LIBRARIES)
           and f.filename != readonly.__file__]  # the write refused: the line is the caller's
    return (own or frames or traceback.extract_tb(exc.__traceback__))[-1]


def node_error(worker: Worker, name: str, step: int, exc: BaseException) -> NodeError:
    """What a node raised, as one message: the node, its kind and graph line, the step,
    the error, and the line of the node's own code that raised it (a plugin's file,
    not flowgraph's or torch's). The full traceback goes to `run_dir/traceback.txt`,
    and into the message under `flowgraph run --debug`."""
    node = worker.placed[name]
    full = "".join(traceback.format_exception(exc))
    where = worker.opts.run_dir / TRACEBACK
    try:
        where.write_text(full)
        saved = f"\n(the full traceback: {where}; {option('debug')} prints it)"
    except OSError:
        saved = ""
    frame = user_frame(exc)
    model = f"model {node.model}, " if node.model else ""
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        what = (f"{type(exc).__name__}({exc}) raised by the node's code; a node may not end "
                "the process (sys.exit, exit()) or stand for Ctrl-C: raise an exception")
    text = (f"while executing node `{name}` (kind {node.kind}, {model}{node.where}) "
            f"{at_step(step)}: "
            f"{what}\n  at {frame.filename}:{frame.lineno} in "
            f"{frame.name}: {(frame.line or '').strip()}")
    return NodeError(text + (f"\n{full}" if os.environ.get(DEBUG_ENV) else saved))


# --- the process -------------------------------------------------------------------------


def quiet_hf() -> None:
    """Hugging Face's per-load progress bars would drown the one line per step."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def on_device(inputs: dict[str, Any], device: str) -> dict[str, Any]:
    """A node's inputs with their tensors on the worker's `device`: a data source's come
    from the CPU, a model's node computes where its model is."""
    kind = torch.device(device).type
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != kind else v
            for k, v in inputs.items()}


def pick_device(requested: str) -> str:
    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda:0"
    if requested == "cuda":
        raise FlowgraphError("resources.device is `cuda` but torch sees no CUDA device")
    return "cpu"
