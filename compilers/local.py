"""The reference executor: one process, CPU or one GPU, node by node in plan order.

An interpreter in the style of torch.fx's: `run()` loops over steps, `run_step()` over
the plan's stages, `run_node()` calls one kind's implementation through the calling
convention of `flowgraph.runtime.context`. Every error a node raises comes back as
"while executing node X (kind K) at step S". Strict mode checks every tensor on every
edge against its contract on the first step this process runs (every step with
`--strict`); outputs that must be finite (rewards, advantages, losses) are checked on
every step, so a NaN stops the run with the node and step named (or skips the batch
with `trainer.on_nonfinite=skip`), keeping the last good checkpoint.

The plan is the program: the executor reads each node's implementation, pool and
data-parallel flag, each edge's dispatch, the stage order and the prologue from it,
and resolves kinds from the registry only to call them (`plan.verify_kinds`). The
prologue (hoisted, loop-invariant nodes, e.g. DPO's reference log-probs) runs before
the loop over every row of the training data, and of the held-out data when the run
evaluates; its outputs are kept by the row's `uid` (in memory, per process: a resumed
run computes them again) and read at every step.

`fsdp.py` and `ray.py` subclass this and override placement and dispatch only.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sysconfig
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from flowgraph.compilers import RunOptions
from flowgraph.compilers.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_partial,
    save_checkpoint,
)
from flowgraph.errors import DEBUG_ENV, FlowgraphError, NodeError, NonFiniteError, at_step
from flowgraph.ir import DataSpec, Graph, ModelSpec
from flowgraph.plan import ExecutionPlan, ModelPlacement, verify_kinds
from flowgraph.registry import KindSpec, Registry
from flowgraph.runtime.context import RESOURCE_ARGS, Impl, NodeContext, named_outputs
from flowgraph.runtime.metrics import MetricsLog, serving
from flowgraph.runtime.strict import RuntimeContracts

if TYPE_CHECKING:
    from flowgraph.runtime.prometheus import Exporter

PROLOGUE = -1
"""The step number nodes see while the prologue runs."""


# --- implementations ----------------------------------------------------------------


_LIBRARIES = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                       "platlib"))


def _user_frame(exc: BaseException) -> traceback.FrameSummary:
    """The innermost frame of the node's own code: below the executor's call, outside
    the standard library and installed packages (torch, transformers...); the innermost
    frame of all when every frame is a library's (a node installed as a package)."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0]: the executor's call
    own = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    return (own or frames or traceback.extract_tb(exc.__traceback__))[-1]


# --- models, optimizers, data ---------------------------------------------------------


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def plan_kinds(plan: ExecutionPlan) -> dict[str, KindSpec]:
    """Each node's and data source's kind, from the registry after the graph's plugins
    are imported; the plan is held to them (`verify_kinds`)."""
    registry = Registry.default()
    registry.load_plugins([p.module for p in plan.graph.plugins])
    kinds = {}
    for n in plan.nodes:
        kind = registry.get(n.kind)
        if kind is None:
            raise FlowgraphError(f"node `{n.name}`: kind `{n.kind}` is not registered (a "
                                 "plugin the graph lists under `plugins:` declares it?)")
        kinds[n.name] = kind
    verify_kinds(plan, kinds)
    return kinds


def lr_lambda(warmup: int, total: int, schedule: str) -> Callable[[int], float]:
    """The LR factor of training step i (the scheduler steps once per update node call).

    verl 0.9.1's `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup`
    (held to them in tests/compilers/test_local.py): i/w while i < w, then 1, or the
    half cosine over the remaining steps; `linear` decays to 0 as transformers'
    `get_linear_schedule_with_warmup` does.
    """
    def factor(i: int) -> float:
        if i < warmup:
            return i / max(1, warmup)
        if schedule == "constant":
            return 1.0
        frac = (i - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - frac)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * frac)))

    return factor


@dataclass
class Resources:
    """Everything loaded once per run."""

    models: dict[str, Any] = field(default_factory=dict)
    tokenizers: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    """Data source -> flowgraph.nodes.data.Splits."""


# --- the executor ---------------------------------------------------------------------


@dataclass
class ExecOptions:
    """What one executor process needs besides the plan."""

    run_dir: Path
    device: str = "cpu"
    strict: bool = False
    resume: bool = False
    out: TextIO | None = None
    tensorboard: bool = True
    exporter: Exporter | None = None
    """Feeds the Prometheus endpoint with every step row (`--metrics-port`)."""


class LocalExecutor:
    """Runs an `ExecutionPlan` in this process."""

    def __init__(self, plan: ExecutionPlan, options: ExecOptions) -> None:
        self.plan, self.graph, self.opts = plan, plan.graph, options
        self.kinds = plan_kinds(plan)
        self.dims = {d.name: d.value for d in plan.dims}
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.prologue = [n for s in plan.stages if s.once for n in s.nodes]
        """Nodes run before the loop, over the whole dataset, in this order."""
        self.order = [n for s in plan.stages if not s.once for n in s.nodes if n in self.nodes]
        """Nodes run at every step, stage by stage."""
        self.edges = {(e.src, e.dst): e for e in plan.edges}
        self.consumed = {(ref.node, ref.port) for ref, _, _ in self.graph.edges()}
        self.contracts = RuntimeContracts.of(plan)
        self.impls: dict[str, Impl] = {}
        self.res = Resources()
        self.node_state: dict[str, dict[str, Any]] = {n: {} for n in self.nodes}
        self.kept: dict[str, dict[tuple[str, int], dict[str, Any]]] = {
            n: {} for n in self.prologue}
        """Prologue node -> (split, uid) -> that row's outputs."""
        self.prologue_done: set[str] = set()
        self.start_step = 0

    # -- setup ------------------------------------------------------------------------

    def setup(self) -> None:
        """Cheap and likely failures first: model paths, implementations, tokenizers and
        datasets (a missing column) — then the model weights and optimizers."""
        from flowgraph.nodes.models import check_model_path, load_tokenizer

        for m in self.graph.models:
            check_model_path(m.path)
        for name, node in self.nodes.items():
            impl = Impl.load(self.kinds[name])
            impl.verify(node, self.kinds[name])
            self.impls[name] = impl
        for m in self.graph.models:
            self.res.tokenizers[m.name] = load_tokenizer(m.tokenizer or m.path)
        self._load_data()
        self._load_models()

    def _load_models(self) -> None:
        from transformers import PreTrainedModel

        from flowgraph.nodes.models import load_model
        from flowgraph.nodes.values import ValueModel

        for placed in self.hosted_models():
            m = self.graph.model(placed.name)
            assert m is not None  # the plan's verifier holds pools to the graph's models
            kw: dict[str, Any] = {"dtype": _dtype(m.dtype), "trainable": m.trainable,
                                  "attn_implementation": m.attn_implementation}
            model: torch.nn.Module = (ValueModel.from_pretrained(m.path, **kw)
                                      if placed.head == "scalar" else load_model(m.path, **kw))
            if m.gradient_checkpointing and isinstance(model, PreTrainedModel):
                model.gradient_checkpointing_enable()
            model = self.res.models[m.name] = self.place_model(placed,
                                                               model.to(self.opts.device))
            if m.trainable:
                self._make_optimizer(m, model)

    def hosted_models(self) -> tuple[ModelPlacement, ...]:
        """The models this process loads, as the plan places them: every pool's (the
        local and fsdp targets have one); a Ray worker, its pool's."""
        return tuple(m for p in self.plan.pools for m in p.models)

    def place_model(self, placed: ModelPlacement, model: torch.nn.Module) -> torch.nn.Module:
        """Where a distributed executor shards or replicates a model (before its
        optimizer is made), as `placed.sharding` says; here, the model as it is."""
        return model

    def _make_optimizer(self, m: ModelSpec, model: torch.nn.Module) -> None:
        from flowgraph.ir import OptimizerSpec

        spec = m.optimizer or OptimizerSpec()
        params = [p for p in model.parameters() if p.requires_grad]
        opt: torch.optim.Optimizer
        if spec.name == "sgd":
            opt = torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
        else:
            cls = torch.optim.AdamW if spec.name == "adamw" else torch.optim.Adam
            opt = cls(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                      weight_decay=spec.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(spec.warmup_steps, self.graph.trainer.steps, spec.schedule))
        self.res.optimizers[m.name], self.res.schedulers[m.name] = opt, sched

    def _data_tokenizer(self, d: DataSpec) -> Any:
        for node in self.graph.nodes:
            if node.model and any(ref.node == d.name for _, ref in node.inputs):
                return self.res.tokenizers[node.model]
        if not self.graph.models:
            raise FlowgraphError(f"data source `{d.name}` needs a tokenizer: declare a model")
        return self.res.tokenizers[self.graph.models[0].name]

    def _load_data(self) -> None:
        for d in self.graph.data:
            impl = Impl.load(self.kinds[d.name])
            params = {k: v for k, v in d.params.to_python().items() if k in impl.accepts}
            if "max_prompt_length" in impl.accepts:
                params.setdefault("max_prompt_length", self.dims.get("P"))
            if "max_response_length" in impl.accepts:
                params.setdefault("max_response_length", self.dims.get("T"))
            if "ground_truth_for" in impl.accepts:
                params["ground_truth_for"] = self.graph.readers(d.name, "ground_truth")
            self.res.data[d.name] = impl.fn(d.path, tokenizer=self._data_tokenizer(d),
                                            seed=self.graph.trainer.seed, **params)

    # -- running ------------------------------------------------------------------------

    def ctx(self, name: str, step: int, **dp: Any) -> NodeContext:
        """The node's context; `dp` sets the data-parallel fields (dp_rank, dp_size,
        row_offset, reduce) where a distributed executor splits the batch."""
        node = self.nodes[name]
        spec = self.graph.model(node.model) if node.model else None
        optimizer = self.res.optimizers.get(node.model or "")
        return NodeContext(
            node=name, kind=node.kind, step=step, seed=self.graph.trainer.seed,
            device=self.opts.device, model=self.res.models.get(node.model or ""),
            tokenizer=self.res.tokenizers.get(node.model or ""),
            optimizer=optimizer if self.kinds[name].trains else None,
            scheduler=self.res.schedulers.get(node.model or "") if self.kinds[name].trains
            else None,
            grad_clip=spec.optimizer.grad_clip if spec and spec.optimizer else 0.0,
            state=self.node_state[name], dims=dict(self.dims), **dp)

    def call(self, name: str, env: dict[tuple[str, str], Any], step: int,
             params: dict[str, Any], metrics: dict[str, float], **dp: Any
             ) -> tuple[dict[str, Any], float]:
        """Call one node's implementation; (outputs, seconds spent inside it). This is
        the dispatch point distributed executors override (see `ctx` for `dp`)."""
        node, kind, impl = self.nodes[name], self.kinds[name], self.impls[name]
        kw: dict[str, Any] = {port: env[(ref.node, ref.port)] for port, ref in node.inputs}
        kw.update({k: v for k, v in params.items() if k in impl.accepts})
        for p in kind.outputs:
            if p.optional and (name, p.name) in self.consumed and f"with_{p.name}" in impl.accepts:
                kw[f"with_{p.name}"] = True
        ctx = self.ctx(name, step, **dp)
        for arg in RESOURCE_ARGS:
            if arg in impl.accepts:
                kw[arg] = (ctx if arg == "ctx" else ctx.tokenizer if arg == "tokenizer"
                           else ctx.model)
        t0 = time.perf_counter()
        try:
            # Only updates build autograd graphs; everything else is inference, and a
            # log-prob carrying the actor's graph into the update would be backpropagated
            # through twice.
            with torch.set_grad_enabled(kind.trains):
                result = impl.fn(**kw)
        except (NonFiniteError, NodeError):
            raise
        except Exception as exc:
            raise self.node_error(name, step, exc) from exc
        seconds = time.perf_counter() - t0
        metrics.update(ctx.metrics)
        return named_outputs(kind, result), seconds

    def sliced(self, name: str) -> tuple[list[str], int]:
        """A data-parallel node's input ports that the plan cuts into per-worker slices
        (edges dispatched `split` or `reshard`), and the rows per unit of the cut: N
        where an edge is group-aligned, else 1. The others arrive whole."""
        ports, aligned = [], False
        for port, ref in self.nodes[name].inputs:
            edge = self.edges[(str(ref), f"{name}.{port}")]
            if edge.dispatch in ("split", "reshard"):
                ports.append(port)
                aligned |= edge.group_aligned
        return ports, self.dims.get("N", 1) if aligned else 1

    def node_error(self, name: str, step: int, exc: Exception) -> NodeError:
        """What a node raised, as one message: the node, its kind and graph line, the step,
        the error, and the line of the node's own code that raised it (a plugin's file,
        not flowgraph's or torch's). The full traceback goes to `run_dir/traceback.txt`,
        and into the message under `flowgraph run --debug`."""
        node, kind = self.nodes[name], self.kinds[name]
        full = "".join(traceback.format_exception(exc))
        where = self.opts.run_dir / "traceback.txt"
        try:
            where.write_text(full)
            saved = f"\n(the full traceback: {where}; `flowgraph run --debug` prints it)"
        except OSError:
            saved = ""
        frame = _user_frame(exc)
        text = (f"while executing node `{name}` (kind {kind.name}, {node.pos}) {at_step(step)}: "
                f"{type(exc).__name__}: {exc}\n  at {frame.filename}:{frame.lineno} in "
                f"{frame.name}: {(frame.line or '').strip()}")
        return NodeError(text + (f"\n{full}" if os.environ.get(DEBUG_ENV) else saved))

    def params_of(self, name: str, *, evaluation: bool = False) -> dict[str, Any]:
        node, kind = self.nodes[name], self.kinds[name]
        values = kind.param_values(node.params.to_python())
        if evaluation and kind.category == "rollout":
            # Held-out prompts are answered greedily, so N samples would be N copies.
            values.update({k: v for k, v in (("do_sample", False), ("n", 1))
                           if kind.param(k) is not None})
        return values

    def run_node(self, name: str, env: dict[tuple[str, str], Any], step: int, *,
                 strict: bool, metrics: dict[str, float], split: str = "train") -> float:
        """Run one node on `env` and store its outputs there; seconds spent in it. A
        prologue node's outputs for the batch's rows are read from what the prologue
        kept (no time)."""
        if name in self.kept and step != PROLOGUE:
            self._store(name, self.kinds[name], self._kept_rows(name, env, split), env, step,
                        strict)
            return 0.0
        node, kind = self.nodes[name], self.kinds[name]
        if strict:
            for port, ref in node.inputs:
                spec = kind.input(port)
                assert spec is not None
                self.contracts.check_edge(ref, name, port, spec.spec, env[(ref.node, ref.port)],
                                          step)
        params = self.params_of(name, evaluation=split != "train")
        outputs, seconds = self.call(name, env, step, params, metrics)
        self._store(name, kind, outputs, env, step, strict)
        return seconds

    def _store(self, name: str, kind: KindSpec, outputs: dict[str, Any],
               env: dict[tuple[str, str], Any], step: int, strict: bool) -> None:
        for p in kind.outputs:
            if p.name not in outputs:
                if p.optional or (name, p.name) not in self.consumed:
                    continue
                raise NodeError(f"while executing node `{name}` (kind {kind.name}) "
                                f"{at_step(step)}: it returned no output `{p.name}`")
            value = outputs[p.name]
            if strict:
                self.contracts.check_output(name, p.name, p.spec, value, step,
                                            self.nodes[name].pos)
            # Every float output, declared `finite` or not: a NaN reward from a user's
            # plugin must stop the run as surely as one from a built-in node.
            if isinstance(value, torch.Tensor) and value.is_floating_point() \
                    and not bool(torch.isfinite(value).all()):
                raise NonFiniteError(name, step, f"output `{p.name}`")
            env[(name, p.name)] = value

    # -- the prologue --------------------------------------------------------------------

    def run_prologue(self, split: str = "train") -> float:
        """The plan's `once` stage over every row of `split` (once per split and
        process): each data source's rows in file order, in batches of Bp, through the
        prologue nodes that read it, in the listed order; their outputs are kept by
        (split, uid). Seconds spent."""
        if not self.prologue or split in self.prologue_done:
            return 0.0
        t0 = time.perf_counter()
        strict_every = self.graph.trainer.strict or self.opts.strict
        for d in self.graph.data:
            names = [n for n in self.prologue if self._hoist_source(n) == d.name]
            splits = self.res.data[d.name]
            dataset = splits.train if split == "train" else splits.eval
            if not names or dataset is None:
                continue
            for i, batch in enumerate(dataset.batches(self.dims["Bp"])):
                env = {(d.name, port): value for port, value in batch.items()}
                uids = batch["uid"].tolist()
                for name in names:
                    metrics: dict[str, float] = {}
                    with torch.no_grad():
                        self.run_node(name, env, PROLOGUE, strict=strict_every or i == 0,
                                      metrics=metrics, split=split)
                    kept = self.kept.setdefault(name, {})
                    for j, uid in enumerate(uids):
                        kept[(split, uid)] = {p.name: env[(name, p.name)][j]
                                              for p in self.kinds[name].outputs
                                              if (name, p.name) in env}
        self.prologue_done.add(split)
        return time.perf_counter() - t0

    def _kept_rows(self, name: str, env: dict[tuple[str, str], Any], split: str
                   ) -> dict[str, Any]:
        """A prologue node's outputs for the rows of this batch."""
        uids = env[(self._hoist_source(name), "uid")].tolist()
        kept = self.kept[name]
        missing = [u for u in uids if (split, u) not in kept]
        if missing:
            raise FlowgraphError(f"prologue node `{name}` has no outputs for rows {missing[:5]} "
                                 f"of the {split} data: the prologue ran over other data")
        first = kept[(split, uids[0])]
        return {port: torch.stack([kept[(split, u)][port] for u in uids])
                if isinstance(first[port], torch.Tensor) else [kept[(split, u)][port]
                                                               for u in uids]
                for port in first}

    def _hoist_source(self, name: str) -> str:
        """The one data source whose rows a prologue node's inputs come from."""
        sources = self._sources(name)
        if len(sources) != 1:
            raise FlowgraphError(f"prologue node `{name}` reads {len(sources)} data sources "
                                 f"({', '.join(sorted(sources)) or 'none'}); a node computed "
                                 "once per row reads the rows of exactly one")
        return next(iter(sources))

    def _sources(self, name: str) -> set[str]:
        out: set[str] = set()
        for _, ref in self.nodes[name].inputs:
            out |= {ref.node} if self.graph.data_source(ref.node) else self._sources(ref.node)
        return out

    def next_batches(self, env: dict[tuple[str, str], Any], split: str = "train"
                     ) -> dict[str, float]:
        """Draw every data source's batch (the data nodes' work); seconds per source."""
        seconds = {}
        for d in self.graph.data:
            t0 = time.perf_counter()
            splits = self.res.data[d.name]
            dataset = splits.train if split == "train" else splits.eval
            batch = dataset.next_batch(self.dims["Bp"])
            for port, value in batch.items():
                env[(d.name, port)] = value
            seconds[d.name] = time.perf_counter() - t0
        return seconds

    def run_step(self, step: int, *, strict: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        env: dict[tuple[str, str], Any] = {}
        metrics: dict[str, float] = {}
        loading = self.next_batches(env)
        metrics.update({f"timing_s/{name}": s for name, s in loading.items()})
        inside = sum(loading.values())
        for name in self.prologue:
            self.run_node(name, env, step, strict=strict, metrics=metrics)
        for name in self.order:
            seconds = self.run_node(name, env, step, strict=strict, metrics=metrics)
            metrics[f"timing_s/{name}"] = seconds
            inside += seconds
        metrics.update(step_metrics(self.graph, self.kinds, env))
        wall = time.perf_counter() - t0
        metrics["timing_s/step"] = wall
        metrics["perf/orchestration_frac"] = max(wall - inside, 0.0) / wall if wall else 0.0
        tokens = metrics.get("perf/tokens", 0.0)
        if tokens:
            metrics["perf/throughput"] = tokens / wall
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out prompts, each answered once, greedily; every node but the updates;
        `val/...` metrics: the step metrics, the log-ratio to the reference, and text
        metrics of the responses (diversity, exact-match accuracy:
        `flowgraph.runtime.evaluation`)."""
        out: dict[str, float] = {}
        if not all(self.res.data[d.name].eval is not None for d in self.graph.data):
            return out
        evals = [self.res.data[d.name].eval for d in self.graph.data]
        for ev in evals:
            ev.load_state_dict({"epoch": 0, "position": 0})
        rows = min(len(ev) for ev in evals)
        batches = max(rows // self.dims["Bp"], 1)
        self.run_prologue("eval")
        sums: dict[str, float] = {}
        held_out = HeldOut()
        with torch.no_grad():
            for _ in range(batches):
                env: dict[tuple[str, str], Any] = {}
                self.next_batches(env, split="eval")
                scratch: dict[str, float] = {}
                for name in self.prologue + self.order:
                    if not self.kinds[name].trains:
                        self.run_node(name, env, step, strict=False, metrics=scratch,
                                      split="eval")
                    else:
                        self._update_eval(name, env, step, scratch)
                scratch.update(step_metrics(self.graph, self.kinds, env))
                scratch.update(log_ratio_to_reference(self.graph, env))
                held_out.add(self.graph, self.kinds, env, self.res.tokenizers)
                for k, v in scratch.items():
                    sums[k] = sums.get(k, 0.0) + v / batches
        for k, v in sums.items():
            if not k.startswith("perf/"):
                out["val/" + k.removeprefix("critic/")] = v
        out.update({f"val/{k}": v for k, v in held_out.metrics().items()})
        return out

    def _update_eval(self, name: str, env: dict[tuple[str, str], Any], step: int,
                     metrics: dict[str, float]) -> None:
        """An update kind may offer `<impl>_eval`: its metrics on held-out data, no step."""
        kind = self.kinds[name]
        module, _, attr = kind.impl.partition(":")
        fn = getattr(importlib.import_module(module), f"{attr}_eval", None)
        if fn is None:
            return
        node = self.nodes[name]
        kw = {port: env[(ref.node, ref.port)] for port, ref in node.inputs}
        ctx = self.ctx(name, step)
        fn(ctx, **kw, **self.params_of(name))
        metrics.update(ctx.metrics)

    # -- the loop -------------------------------------------------------------------------

    def saved_models(self) -> dict[str, torch.nn.Module]:
        """The models a checkpoint holds: the trained ones. A frozen model (a reference, a
        reward model) is rebuilt from its source when a run resumes, never saved again."""
        return {n: m for n, m in self.res.models.items() if n in self.res.optimizers}

    def checkpoint_modules(self) -> dict[str, Any]:
        mods: dict[str, Any] = {}
        for name, model in self.saved_models().items():
            mods[f"model.{name}"] = model
        for name, opt in self.res.optimizers.items():
            mods[f"optim.{name}"] = opt
            mods[f"sched.{name}"] = self.res.schedulers[name]
        return mods

    def run_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint holds besides weights and optimizers (JSON-able)."""
        return {
            "step": step,
            "cursors": {d: s.train.state_dict() for d, s in self.res.data.items()},
            "node_state": self.node_state,
            "plan": self.plan.graph.name,
        }

    def save(self, step: int) -> None:
        save_checkpoint(self.opts.run_dir, step, modules=self.checkpoint_modules(),
                        state=self.run_state(step), keep=self.graph.trainer.max_checkpoints)

    def restore(self) -> int:
        """Load the latest checkpoint; return the next step to run (0 when none).
        A checkpoint of the fsdp or ray target (DCP shards) loads here too."""
        found = latest_checkpoint(self.opts.run_dir)
        if found is None:
            return 0
        self.load_weights(found[1])
        return self.restore_state(found[1])

    def load_weights(self, folder: Path) -> None:
        """This process's models, optimizers and schedulers from the checkpoint in
        `folder`: whole files (local target) or DCP shards (fsdp, ray), into whole
        models or sharded ones (fsdp, ray)."""
        from flowgraph.compilers import _dist

        dcp = _dist.has_dcp(folder)
        if not dcp and not any(map(_dist.is_sharded, self.res.models.values())):
            load_checkpoint(folder, modules=self.checkpoint_modules())
            return
        load = _dist.dcp_load if dcp else _dist.load_whole
        load(folder, self.saved_models(), self.res.optimizers)
        for name, sched in self.res.schedulers.items():
            sched.load_state_dict(torch.load(folder / f"sched.{name}.pt", weights_only=False))

    def restore_state(self, folder: Path) -> int:
        """Cursors and node state of the checkpoint in `folder`; the next step."""
        state = json.loads((folder / "state.json").read_text())
        for d, cursor in state["cursors"].items():
            self.res.data[d].train.load_state_dict(cursor)
        for name, node_state in state["node_state"].items():
            self.node_state.setdefault(name, {}).update(node_state)
        return int(state["step"]) + 1

    def prepare_run_dir(self) -> None:
        run_dir = self.opts.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_partial(run_dir)
        (run_dir / "plan.json").write_text(self.plan.to_json())

    def open_log(self, worker: str = "local") -> MetricsLog:
        return MetricsLog(self.opts.run_dir, tensorboard=self.opts.tensorboard,
                          out=self.opts.out, total_steps=self.graph.trainer.steps,
                          exporter=self.opts.exporter, worker=worker)

    def run(self) -> list[dict[str, float]]:
        """The training loop; returns the metric rows this process produced."""
        trainer = self.graph.trainer
        self.prepare_run_dir()
        self.start_step = self.restore() if self.opts.resume else 0
        log = self.open_log()
        log.truncate_after(self.start_step - 1)
        rows = []
        try:
            self.before_loop()
            for step in range(self.start_step, trainer.steps):
                rows.append(self.train_step(step, log)[0])
        finally:
            log.close()
        return rows

    def before_loop(self) -> None:
        """The prologue over the training rows, and the held-out rows when the run
        evaluates; its time goes in the first row (`timing_s/prologue`)."""
        self.prologue_seconds = self.run_prologue("train")
        if self.graph.trainer.eval_every:
            self.prologue_seconds += self.run_prologue("eval")

    def train_step(self, step: int, log: MetricsLog) -> tuple[dict[str, float], bool]:
        """One turn of the loop: the step, the evaluation when due, the row logged, a
        checkpoint when due; (the row, whether a checkpoint was written)."""
        trainer = self.graph.trainer
        metrics = self._guarded_step(step)
        if trainer.eval_every and (step + 1) % trainer.eval_every == 0:
            metrics.update(self.evaluate(step))
        if step == self.start_step:  # the prologue, what the data load dropped: first row
            if self.prologue:
                metrics["timing_s/prologue"] = self.prologue_seconds
            metrics.update({f"data/{name}/filtered_overlong": float(s.train.filtered_overlong)
                            for name, s in self.res.data.items()
                            if getattr(s.train, "filtered_overlong", 0)})
        log.write(step, metrics)
        every = trainer.checkpoint_every
        due = bool(every and (step + 1) % every == 0) or step == trainer.steps - 1
        if due:
            self.save(step)
        return metrics, due

    def _guarded_step(self, step: int) -> dict[str, float]:
        strict = self.graph.trainer.strict or self.opts.strict or step == self.start_step
        try:
            return self.run_step(step, strict=strict)
        except NonFiniteError as exc:
            if self.graph.trainer.on_nonfinite != "skip":
                raise
            print(f"step {step}: skipped the batch: {exc}", file=self.opts.out)
            return {"skipped": 1.0}


# --- metrics from a step's values --------------------------------------------------------


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    return float((x.float() * m).sum() / m.sum().clamp_min(1.0))


def step_metrics(graph: Graph, kinds: dict[str, KindSpec],
                 env: dict[tuple[str, str], Any]) -> dict[str, float]:
    """verl's batch metrics: score, rewards, advantages, returns, values, lengths, tokens."""
    out: dict[str, float] = {}
    for node in graph.nodes:
        kind = kinds[node.name]
        mask_ref = node.input("response_mask")
        mask = env.get((mask_ref.node, mask_ref.port)) if mask_ref else None
        if kind.category == "rollout" and (node.name, "response_mask") in env:
            resp = env[(node.name, "response_mask")].float()
            out.setdefault("response_length/mean", float(resp.sum(-1).mean()))
            prompt = env[(node.name, "prompt_mask")].float()
            out["perf/tokens"] = out.get("perf/tokens", 0.0) + float(resp.sum() + prompt.sum())
            out["perf/response_tokens"] = out.get("perf/response_tokens", 0.0) + float(resp.sum())
        elif kind.category == "reward" and (node.name, "scores") in env:
            out.setdefault("critic/score/mean", float(env[(node.name, "scores")].mean()))
        elif (node.name, "token_level_rewards") in env and mask is not None:  # kl_penalty
            rewards = env[(node.name, "token_level_rewards")]
            out["critic/rewards/mean"] = float((rewards * mask).sum(-1).mean())
        elif kind.category == "advantage" and mask is not None:
            out["critic/advantages/mean"] = _masked_mean(env[(node.name, "advantages")], mask)
            out["critic/returns/mean"] = _masked_mean(env[(node.name, "returns")], mask)
        elif kind.head == "scalar" and (node.name, "values") in env and mask is not None:
            out["critic/values/mean"] = _masked_mean(env[(node.name, "values")], mask)
    if "critic/score/mean" in out:
        out.setdefault("critic/rewards/mean", out["critic/score/mean"])
    return out


# --- held-out metrics (evaluate) ----------------------------------------------------------


def log_ratio_to_reference(graph: Graph, env: dict[tuple[str, str], Any]
                           ) -> dict[str, float]:
    """`log_ratio_to_ref`: the mean over valid response tokens of log π(y_t) − log π_ref(y_t).
    On responses sampled from π this is the k1 estimate of KL(π ‖ π_ref); on the greedy
    held-out responses it is not (it can be negative), hence its name. Read from the first node that
    takes both an actor log-prob (`log_prob` or `old_log_prob`) and `ref_log_prob` (PPO's
    `kl_penalty`, GRPO's actor update); nothing when the graph has no reference."""
    for node in graph.nodes:
        ref, mask = node.input("ref_log_prob"), node.input("response_mask")
        actor = node.input("log_prob") or node.input("old_log_prob")
        if ref is None or mask is None or actor is None:
            continue
        pi, pi_ref = env.get((actor.node, actor.port)), env.get((ref.node, ref.port))
        if pi is not None and pi_ref is not None:
            return {"log_ratio_to_ref": _masked_mean(pi - pi_ref, env[(mask.node, mask.port)])}
    return {}


@dataclass
class HeldOut:
    """Greedy responses to the held-out prompts, gathered over the evaluation batches."""

    tokens: list[list[int]] = field(default_factory=list)
    """Valid tokens of each response of the first `generate` node, special tokens dropped."""
    judged: list[tuple[str, str]] = field(default_factory=list)
    """(decoded response, ground truth) of the first `reward` node with fn `exact_match`."""

    def add(self, graph: Graph, kinds: dict[str, KindSpec], env: dict[tuple[str, str], Any],
            tokenizers: dict[str, Any]) -> None:
        gen = next((n for n in graph.nodes if kinds[n.name].category == "rollout"), None)
        if gen is not None:
            special = set(getattr(tokenizers.get(gen.model or ""), "all_special_ids", ()) or ())
            rows = _valid_rows(env[(gen.name, "responses")], env[(gen.name, "response_mask")])
            self.tokens += [[t for t in row if t not in special] for row in rows]
        for node in graph.nodes:
            kind, truth = kinds[node.name], node.input("ground_truth")
            ids, mask = node.input("responses"), node.input("response_mask")
            if kind.category != "reward" or truth is None or ids is None or mask is None \
                    or node.model is None:
                continue
            if kind.param_values(node.params.to_python()).get("fn") != "exact_match":
                continue
            tok = tokenizers[node.model]
            texts = [tok.decode(row, skip_special_tokens=True) for row in
                     _valid_rows(env[(ids.node, ids.port)], env[(mask.node, mask.port)])]
            self.judged += zip(texts, [str(g) for g in env[(truth.node, truth.port)]],
                               strict=True)
            return

    def metrics(self) -> dict[str, float]:
        """`diversity/...`, `accuracy` (exact match), for the responses gathered."""
        from flowgraph.runtime.evaluation import diversity_metrics, exact_match_accuracy

        out = {}
        if self.tokens:
            out = {f"diversity/{k}": v for k, v in diversity_metrics(self.tokens).items()}
        if self.judged:
            texts, truths = zip(*self.judged, strict=True)
            out["accuracy"] = exact_match_accuracy(texts, truths)
        return out


def _valid_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's tokens where the mask is set: (B, T) -> B lists."""
    return [row[m].tolist() for row, m in zip(ids, mask.bool(), strict=True)]


# --- entry point ---------------------------------------------------------------------------


def _quiet_hf() -> None:
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


def prepare_run(plan: ExecutionPlan, *, resume: bool, check_only: bool = False) -> Path:
    """The run dir, created and known writable before any model loads; refuses one that
    holds a run unless resuming. Quiets Hugging Face."""
    run_dir = Path(plan.graph.trainer.run_dir)
    if not check_only:
        _quiet_hf()
        _writable(run_dir)
    resume = resume or plan.graph.trainer.resume
    if not resume and not check_only and (latest_checkpoint(run_dir)
                                          or (run_dir / "metrics.jsonl").exists()):
        raise FlowgraphError(
            f"`{run_dir}` already holds a run; continue it with --resume, or give another "
            "directory: trainer.run_dir=runs/new")
    return run_dir


def _writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise FlowgraphError(
            f"cannot write the run dir `{run_dir}` (trainer.run_dir): "
            f"{exc.strerror or exc}{f' (`{exc.filename}`)' if exc.filename else ''}; give a "
            "folder you can write to, e.g. trainer.run_dir=runs/my-run") from exc


def run_plan(plan: ExecutionPlan, opts: RunOptions) -> None:
    """Set up and run a local plan (`flowgraph.compilers.run`); refuses to overwrite an
    existing run without `opts.resume`. Prometheus metrics on `opts.metrics_port` (else
    `trainer.metrics_port`; 0 picks a free port) from before the models load until the
    run ends, and `opts.metrics_hold` seconds longer so a scraper sees the final values."""
    trainer = plan.graph.trainer
    run_dir = prepare_run(plan, resume=opts.resume)
    torch.manual_seed(trainer.seed)
    device = pick_device(plan.graph.resources.device)
    with serving(plan.graph, opts.metrics_port, opts.metrics_host, hold=opts.metrics_hold,
                 out=opts.out) as exporter:
        executor = LocalExecutor(plan, ExecOptions(
            run_dir, device, opts.strict, opts.resume or trainer.resume, opts.out,
            opts.tensorboard, exporter))
        executor.setup()
        executor.run()
