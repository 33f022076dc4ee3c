"""The reference executor: an interpreter of the plan, one process, CPU or one GPU.

In the style of torch.fx's Interpreter: `run()` loops over steps (`train_step`), after
the plan's prologue (`run_prologue`: hoisted nodes over every row, kept by uid);
`run_step()` draws the batch and walks the plan's stages; `run_node()` checks the
edges (strict mode), calls one kind's implementation through the calling convention
of `flowgraph.runtime.context` (`call`) and stores its outputs. The plan is the
program: nodes, implementations, pools, data-parallel flags, model heads, each edge's
dispatch, the stage order and the prologue are read from it; kinds are resolved from
the registry only to be called (`build.plan_kinds`). Every error a node raises comes
back as "while executing node X (kind K) at step S" with the line of the node's own
code; a NaN stops the run naming node and step (or skips the batch with
`trainer.on_nonfinite=skip`), keeping the last good checkpoint.

The hooks a distributed target overrides, and nothing else:

    placement     hosted_models()           the models this process loads (its pool's)
                  place_model(placed, m)    shard or replicate one (here: FSDP2 when the
                                            plan says full_shard and `workers` > 1)
                  load_models(), load_data() what this process builds (the Ray driver
                                            starts worker groups; its workers draw no data)
    dispatch      call(name, env, ...)      run one node: here, in this process; fsdp on
                                            this rank's slice (`cut`) then all-gather;
                                            ray on the pool's workers
    checkpoints   save(step), load_weights(folder), save_shards(folder)
    reporting     prepare_run_dir(), open_log()  (rank 0 writes), worker_reports()
    faults        recover(exc, step), completed(saved)  (ray restarts worker groups)

What the targets share lives here once: building (`build.py`: models with their
heads, optimizers and LR schedules, tokenizers, data), the data-parallel cut (`cut`)
and join (`_dist.join_outputs`), checkpoint restore (`restore`), seeding (the
constructor), the step metrics and evaluation (`metrics.py`).
"""

from __future__ import annotations

import itertools
import json
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

from flowgraph.compilers import RunOptions, update_loop
from flowgraph.compilers.build import (
    Resources,
    adapters_off,
    load_data,
    load_model,
    load_tokenizers,
    make_optimizer,
    plan_kinds,
    rollout_engine,
)
from flowgraph.compilers.checkpoint import (
    TrainedPart,
    latest_checkpoint,
    load_checkpoint,
    remove_partial,
    save_checkpoint,
)
from flowgraph.compilers.metrics import (
    HeldOut,
    log_ratio_to_reference,
    phase_seconds,
    step_metrics,
)
from flowgraph.compilers.rollouts import (
    InlineRollouts,
    ProcessRollouts,
    Rollout,
    Rollouts,
    load_buffer,
)
from flowgraph.errors import (
    DEBUG_ENV,
    FlowgraphError,
    NodeError,
    NonFiniteError,
    WorkerLost,
    at_step,
)
from flowgraph.plan import ExecutionPlan, ModelPlacement
from flowgraph.registry import KindSpec
from flowgraph.runtime.context import RESOURCE_ARGS, Impl, NodeContext, named_outputs
from flowgraph.runtime.metrics import MetricsLog, serving
from flowgraph.runtime.strict import RuntimeContracts
from flowgraph.runtime.trackers import check_trackers, open_trackers

if TYPE_CHECKING:
    from flowgraph.compilers._dist import Slices
    from flowgraph.runtime.prometheus import Exporter

PROLOGUE = -1
"""The step number nodes see while the prologue runs."""


_LIBRARIES = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                       "platlib"))


def _user_frame(exc: BaseException) -> traceback.FrameSummary:
    """The innermost frame of the node's own code: below the executor's call, outside
    the standard library and installed packages (torch, transformers...); the innermost
    frame of all when every frame is a library's (a node installed as a package)."""
    while exc.__cause__ is not None:  # re-raised with context (a reward fn's row): the
        exc = exc.__cause__          # frame is the original error's
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0]: the executor's call
    own = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    return (own or frames or traceback.extract_tb(exc.__traceback__))[-1]


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

    overlap_rollouts = True
    """An asynchronous plan's producer runs in a process of its own, overlapping the
    update (`ProcessRollouts`); False: in this loop (`InlineRollouts`)."""

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
        self.fused_into = {f: n.name for n in plan.nodes for f in n.fused}
        """A node fused into another's forward (pass `fusion`) -> that node, which runs it."""
        self.contracts = RuntimeContracts.of(plan)
        self.impls: dict[str, Impl] = {}
        self.res = Resources()
        self.node_state: dict[str, dict[str, Any]] = {n: {} for n in self.nodes}
        self.kept: dict[str, dict[tuple[str, int], dict[str, Any]]] = {
            n: {} for n in self.prologue}
        """Prologue node -> (split, uid) -> that row's outputs."""
        self.prologue_done: set[str] = set()
        self.generations: list[dict[str, Any]] = []
        """The last evaluation's responses (`HeldOut.table`), logged as `validation`."""
        self.start_step = 0
        self.adapters_off: set[str] = set()
        """Models placed as a LoRA model's base: nodes run that model, adapters off."""
        self.workers, self.rank = 1, 0
        """The processes this one's models are sharded over (fsdp: the world; a Ray
        worker: its pool's size), and this one's rank among them."""
        cut = plan.asynchronous
        self.producer = [n for n in self.order if cut is not None and n in cut.producer]
        """An asynchronous plan's producer nodes, in the order they run (none: synchronous)."""
        self.consumer = [n for n in self.order if n not in self.producer]
        """The step nodes run on the batch a rollout brings (all of them: synchronous)."""
        self.rollouts: Rollouts | None = None
        """The buffer of an asynchronous plan, from `run()` on."""
        torch.manual_seed(self.graph.trainer.seed)  # before any model or head is made

    # -- setup ------------------------------------------------------------------------

    def setup(self) -> None:
        """Cheap and likely failures first: model paths, implementations, tokenizers and
        datasets (a missing column) — then the model weights and optimizers."""
        from flowgraph.nodes.models import check_model_path

        for m in self.graph.models:
            check_model_path(m.path)
        for name, node in self.nodes.items():
            self.impls[name] = Impl.load(self.kinds[name])
            self.impls[name].verify(node, self.kinds[name])
        self.res.tokenizers = load_tokenizers(self.graph)
        self.load_data()
        self.load_models()

    def load_data(self) -> None:
        """Hook: the data sources' datasets (a Ray worker has none: the driver draws)."""
        self.res.data = load_data(self.plan, self.kinds, self.res.tokenizers)

    def load_models(self) -> None:
        """Hook: this process's models, placed, and the optimizers of the trainable ones
        (the Ray driver starts its worker groups instead)."""
        hosted = self.hosted_models()
        for placed in hosted:
            spec = self.graph.model(placed.name)
            assert spec is not None  # the plan's verifier holds pools to the graph's models
            if placed.base_of is not None:
                continue
            model = self.place_model(placed, load_model(spec, placed, self.opts.device,
                                                        self.graph.trainer.seed))
            self.res.models[spec.name] = model
            if spec.trainable and any(self.kinds[n].trains and self.nodes[n].model == spec.name
                                      for n in self.order):
                self.res.optimizers[spec.name], self.res.schedulers[spec.name] = \
                    make_optimizer(spec, model, self.graph.trainer.steps)
        for placed in hosted:  # a LoRA model's base: that model, its adapters off
            if placed.base_of is not None:
                self.res.models[placed.name] = self.res.models[placed.base_of]
                self.adapters_off.add(placed.name)

    def hosted_models(self) -> tuple[ModelPlacement, ...]:
        """Hook: the models this process loads, as the plan places them: every pool's
        (the local and fsdp targets have one); a Ray worker, its pool's."""
        return tuple(m for p in self.plan.pools for m in p.models)

    def place_model(self, placed: ModelPlacement, model: torch.nn.Module) -> torch.nn.Module:
        """A model sharded with FSDP2 over this process's group of `workers` when the
        plan says `full_shard` (heads and tied embeddings replicated), else as it is."""
        if self.workers > 1 and placed.sharding == "full_shard":
            from flowgraph.compilers import _dist

            return _dist.shard_model(model, self.opts.device)
        return model

    # -- running ------------------------------------------------------------------------

    def ctx(self, name: str, step: int, **dp: Any) -> NodeContext:
        """The node's context; `dp` sets the data-parallel fields (row_offset, workers)
        where a distributed executor splits the batch."""
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
            state=self.node_state[name], dims=dict(self.dims),
            engines=partial(rollout_engine, verify_every=self.graph.trainer.verify_sync_every),
            **dp)

    def call(self, name: str, env: dict[tuple[str, str], Any], step: int,
             params: dict[str, Any], metrics: dict[str, float], **dp: Any
             ) -> tuple[dict[str, Any], float]:
        """Call one node's implementation; (outputs, seconds spent inside it). This is
        the dispatch point distributed executors override (see `ctx` for `dp`; an update's
        dp_rank / dp_size are its share in the update loop)."""
        node, kind, impl = self.nodes[name], self.kinds[name], self.impls[name]
        kw: dict[str, Any] = {port: env[(ref.node, ref.port)] for port, ref in node.inputs}
        kw.update({k: v for k, v in params.items() if k in impl.accepts})
        for p in kind.outputs:
            if p.optional and (name, p.name) in self.consumed and f"with_{p.name}" in impl.accepts:
                kw[f"with_{p.name}"] = True
        rank, size = dp.pop("dp_rank", 0), dp.pop("dp_size", 1)
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
            base = (adapters_off(ctx.model) if node.model in self.adapters_off
                    and ctx.model is not None else nullcontext())
            with torch.set_grad_enabled(kind.trains), base:
                result = impl.fn(**kw)
                if kind.trains:  # an Update: the update loop trains on it
                    update_loop.train(ctx, result, params, rank=rank, size=size)
                    result = {}
        except (NonFiniteError, NodeError):
            raise
        except Exception as exc:
            raise self.node_error(name, step, exc) from exc
        seconds = time.perf_counter() - t0
        metrics.update(ctx.metrics)
        return named_outputs(kind, result), seconds

    def cut(self, name: str, inputs: dict[str, Any], world: int
            ) -> tuple[Slices, Callable[[int], dict[str, Any]]] | None:
        """A data-parallel node's inputs cut for `world` workers as the plan dispatches
        them: the slices, and worker w's slice of each input on an edge dispatched
        `split` or `reshard` (whole groups of N rows where an edge is group-aligned;
        padded so every worker runs as many rows); the other inputs go whole. None when
        the plan cuts no input of the node."""
        from flowgraph.compilers._dist import Slices, take

        ports, aligned = [], False
        for port, ref in self.nodes[name].inputs:
            edge = self.edges[(str(ref), f"{name}.{port}")]
            if edge.dispatch in ("split", "reshard"):
                ports.append(port)
                aligned |= edge.group_aligned
        if not ports:
            return None
        slices = Slices.of(len(inputs[ports[0]]), world,
                           self.dims.get("N", 1) if aligned else 1)
        return slices, lambda w: {p: take(inputs[p], slices.index(w)) for p in ports}

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
        model = f"model {node.model}, " if node.model else ""
        text = (f"while executing node `{name}` (kind {kind.name}, {model}{node.pos}) "
                f"{at_step(step)}: "
                f"{type(exc).__name__}: {exc}\n  at {frame.filename}:{frame.lineno} in "
                f"{frame.name}: {(frame.line or '').strip()}")
        return NodeError(text + (f"\n{full}" if os.environ.get(DEBUG_ENV) else saved))

    def params_of(self, name: str, *, evaluation: bool = False) -> dict[str, Any]:
        """The node's params; a rollout's `val_n` / `val_temperature` are the executor's:
        at evaluation they replace n and the sampling (0: greedy, one response)."""
        node, kind = self.nodes[name], self.kinds[name]
        values = kind.param_values(node.params.to_python())
        n, temperature = values.pop("val_n", 1), values.pop("val_temperature", 0.0)
        val_n = n if isinstance(n, int) else 1
        val_temperature = float(temperature) if isinstance(temperature, (int, float)) else 0.0
        if evaluation and kind.category == "rollout":
            sampled = {"do_sample": True, "n": val_n, "temperature": val_temperature}
            greedy = {"do_sample": False, "n": 1}  # n greedy answers would be n copies
            values.update({k: v for k, v in (sampled if val_temperature > 0 else greedy).items()
                           if kind.param(k) is not None})
        return values

    def run_node(self, name: str, env: dict[tuple[str, str], Any], step: int, *,
                 strict: bool, metrics: dict[str, float], split: str = "train") -> float:
        """Run one node on `env` and store its outputs there; seconds spent in it. A
        prologue node's outputs for the batch's rows are read from what the prologue
        kept (no time). A node with others fused into its forward (`NodePlan.fused`)
        runs over the rows of all of them stacked and stores each one's rows; those
        nodes then do nothing (their outputs are stored already)."""
        if name in self.kept and step != PROLOGUE:
            self._store(name, self.kinds[name], self._kept_rows(name, env, split), env, step,
                        strict)
            return 0.0
        if name in self.fused_into:
            return 0.0
        group, kind = (name, *self.plan.node(name).fused), self.kinds[name]
        if strict:
            for member in group:
                for port, ref in self.nodes[member].inputs:
                    spec = kind.input(port)
                    assert spec is not None
                    self.contracts.check_edge(ref, member, port, spec.spec,
                                              env[(ref.node, ref.port)], step)
        params = self.params_of(name, evaluation=split != "train")
        if len(group) == 1:
            outputs, seconds = self.call(name, env, step, params, metrics)
            self._store(name, kind, outputs, env, step, strict)
            return seconds
        stacked, rows, source = self._stacked(group, env)
        outputs, seconds = self.call(name, stacked, step, params, metrics)
        parts = [{port: value[i] for port, value in _unstack(outputs, rows).items()}
                 for i in range(len(rows))]
        for member, i in zip(group, source, strict=True):
            self._store(member, kind, parts[i], env, step, strict)
        return seconds

    def _stacked(self, group: tuple[str, ...], env: dict[tuple[str, str], Any]
                 ) -> tuple[dict[tuple[str, str], Any], list[int], list[int]]:
        """`env` with the first node's inputs holding the rows of the whole group, in
        order; the rows of each distinct input set, and which one each node reads (a
        node with the same inputs as an earlier one shares its rows)."""
        wired = [dict(self.nodes[m].inputs) for m in group]  # port -> ref, in any order
        keys = [tuple(sorted((port, str(ref)) for port, ref in w.items())) for w in wired]
        distinct = list(dict.fromkeys(keys))
        sources = [wired[keys.index(k)] for k in distinct]
        port = self.nodes[group[0]].inputs[0][0]
        rows = [len(env[(w[port].node, w[port].port)]) for w in sources]
        stacked = dict(env)
        for port, ref in self.nodes[group[0]].inputs:
            stacked[(ref.node, ref.port)] = _join(
                [env[(w[port].node, w[port].port)] for w in sources])
        return stacked, rows, [distinct.index(k) for k in keys]

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
        """Draw the batch and run the step's nodes (`produce`); with asynchronous
        rollouts, take the producer's outputs for the step from the buffer and run the
        consumer's nodes."""
        t0 = time.perf_counter()
        env: dict[tuple[str, str], Any] = {}
        metrics: dict[str, float] = {}
        if self.rollouts is None:
            self.produce(env, step, strict, metrics, self.order)
        else:  # the producer's outputs from the buffer, then the consumer's nodes
            env = self.rollouts.take(step, metrics)
            for name in self.prologue:
                self.run_node(name, env, step, strict=strict, metrics=metrics)
            self._run_nodes(env, step, strict, metrics, self.consumer)
        seconds = {k.removeprefix("timing_s/"): v for k, v in metrics.items()
                   if k.startswith("timing_s/")}
        waited = 0.0
        if isinstance(self.rollouts, ProcessRollouts):
            # generation overlapped the step: what the step waited for it is its cost
            seconds = {n: s for n, s in seconds.items() if n in self.consumer}
            waited = metrics["perf/rollout_wait_s"]
        metrics.update(step_metrics(self.graph, self.kinds, env))
        wall = time.perf_counter() - t0
        metrics["timing_s/step"] = wall
        metrics.update(phase_seconds(self.kinds, seconds, wall, waited))
        metrics["perf/orchestration_frac"] = (metrics["phase_s/orchestration"] / wall
                                              if wall else 0.0)
        tokens = metrics.get("perf/tokens", 0.0)
        if tokens:
            metrics["perf/throughput"] = tokens / wall
        exporter = self.opts.exporter
        for worker, timings, memory in self.worker_reports(step, metrics):
            if exporter is not None:
                if timings:
                    exporter.observe_step(step, timings, worker=worker)
                for device, used in memory:
                    exporter.set_memory(worker, device, used)
        return metrics

    def produce(self, env: dict[tuple[str, str], Any], step: int, strict: bool,
                metrics: dict[str, float], names: list[str]) -> None:
        """Run `names` (the step's nodes, or an asynchronous plan's producer) on the next
        batches; with a resample loop in the plan, the tries up to its filter first
        (`run_tries`), then the rest of `names` once."""
        loop = self.plan.resample
        if loop is None:
            self.run_stages(env, step, strict, metrics, names)
        else:
            self.run_tries(env, step, strict, metrics)
            self._run_nodes(env, step, strict, metrics, [n for n in names if n not in loop.repeat])

    def run_stages(self, env: dict[tuple[str, str], Any], step: int, strict: bool,
                   metrics: dict[str, float], names: list[str]) -> None:
        """Draw every data source's next batch, look up the prologue's rows for it, and
        run `names` in order; seconds spent in data loading and in each node are added up
        over the tries of a step in `timing_s/<name>`."""
        loading = self.next_batches(env)
        for name, seconds in loading.items():
            metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + seconds
        for name in self.prologue:
            self.run_node(name, env, step, strict=strict, metrics=metrics)
        self._run_nodes(env, step, strict, metrics, names)

    def _run_nodes(self, env: dict[tuple[str, str], Any], step: int, strict: bool,
                   metrics: dict[str, float], names: list[str]) -> None:
        for name in names:
            seconds = self.run_node(name, env, step, strict=strict, metrics=metrics)
            metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + seconds

    def run_tries(self, env: dict[tuple[str, str], Any], step: int, strict: bool,
                  metrics: dict[str, float]) -> None:
        """The plan's resample loop (DAPO's dynamic sampling): each try draws the next
        batches and runs the nodes up to the filter; the filter's kept rows are joined
        over tries until `groups` groups are kept, then cut to exactly `groups * N` rows
        (the first groups kept, as verl's DAPO trainer keeps the first
        train_batch_size). `env` ends with the last try's tensors and the filter's joined
        outputs. Short of `groups` after `max_tries` tries, the run stops."""
        loop = self.plan.resample
        assert loop is not None
        repeat = [n for n in self.order if n in loop.repeat and n != loop.filter]
        parts: list[dict[str, Any]] = []
        kept = dropped = tries = 0
        while kept < loop.groups:
            if tries == loop.max_tries:
                raise FlowgraphError(self._exhausted(step, tries, kept, dropped))
            tries += 1
            env.clear()
            self.run_stages(env, step, strict, metrics, repeat)
            outputs, seconds = self._filter_try(env, step, strict, metrics, offset=kept)
            metrics[f"timing_s/{loop.filter}"] = \
                metrics.get(f"timing_s/{loop.filter}", 0.0) + seconds
            new = int(outputs["index"].unique().numel())
            kept, dropped = kept + new, dropped + self._groups_in(env, loop.filter) - new
            parts.append(outputs)
        joined = {port: _join([p[port] for p in parts])[:loop.rows] for port in parts[0]}
        self._store(loop.filter, self.kinds[loop.filter], joined, env, step, strict)
        metrics.update({"filter/kept_groups": float(kept), "filter/dropped_groups":
                        float(dropped), "filter/tries": float(tries),
                        "train/num_gen_batches": float(tries)})

    def _filter_try(self, env: dict[tuple[str, str], Any], step: int, strict: bool,
                    metrics: dict[str, float], offset: int) -> tuple[dict[str, Any], float]:
        """The filter on one try's batch, its inputs held to their contracts in strict
        mode; its outputs (a variable number of rows) are checked once joined."""
        loop = self.plan.resample
        assert loop is not None
        node, kind = self.nodes[loop.filter], self.kinds[loop.filter]
        if strict:
            for port, ref in node.inputs:
                spec = kind.input(port)
                assert spec is not None
                self.contracts.check_edge(ref, node.name, port, spec.spec,
                                          env[(ref.node, ref.port)], step)
        params = {**self.params_of(node.name), "offset": offset}
        return self.call(node.name, env, step, params, metrics)

    def _groups_in(self, env: dict[tuple[str, str], Any], name: str) -> int:
        ref = self.nodes[name].input("index")
        assert ref is not None  # a required port of the filter kind
        return int(env[(ref.node, ref.port)].unique().numel())

    def _exhausted(self, step: int, tries: int, kept: int, dropped: int) -> str:
        loop = self.plan.resample
        assert loop is not None
        node = self.nodes[loop.filter]
        return (f"node `{node.name}` (kind {node.kind}, {node.pos}) {at_step(step)}: "
                f"{tries} tries (max_tries) kept {kept} of the {loop.groups} groups the batch "
                f"needs ({dropped} dropped: {self.params_of(node.name)['metric']} refused "
                "them). The data may be too hard or too easy for the model (verl: 'Generated "
                f"too many'); raise nodes.{node.name}.params.max_tries, lower "
                f"nodes.{node.name}.params.groups, or sample more per prompt (N)")

    def worker_reports(self, step: int, metrics: dict[str, float]
                       ) -> list[tuple[str, dict[str, float], list[tuple[str, int]]]]:
        """Hook: (worker, its node seconds, its device memory) of the workers whose step
        this process's Prometheus endpoint reports besides its own row (fsdp: the other
        ranks; ray: every pool worker). Called on every process of a target, every step."""
        return []

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out prompts, each answered once, greedily; every node but the updates;
        `val/...` metrics: the step metrics, the log-ratio to the reference, and text
        metrics of the responses (diversity, exact-match accuracy:
        `flowgraph.runtime.evaluation`). Every held-out row counts once: batches of Bp
        in file order, the last one the last Bp rows, of which only the rows not seen
        yet count (its step metrics weigh by them)."""
        out: dict[str, float] = {}
        if not all(self.res.data[d.name].eval is not None for d in self.graph.data):
            return out
        evals = [self.res.data[d.name].eval for d in self.graph.data]
        for ev in evals:
            ev.load_state_dict({"epoch": 0, "position": 0})
        rows, size = min(len(ev) for ev in evals), self.dims["Bp"]
        self.run_prologue("eval")
        sums: dict[str, float] = {}
        held_out = HeldOut()
        with torch.no_grad():
            for fresh in _new_rows_per_batch(rows, size):
                if fresh < size:  # the last batch: the last Bp rows
                    for ev in evals:
                        ev.load_state_dict({"epoch": 0, "position": rows - size})
                env: dict[tuple[str, str], Any] = {}
                self.next_batches(env, split="eval")
                scratch = self._eval_nodes(env, step)
                scratch.update(step_metrics(self.graph, self.kinds, env))
                scratch.update(log_ratio_to_reference(self.graph, env))
                held_out.add(self.graph, self.kinds, env, self.res.tokenizers,
                             skip=size - fresh)
                for k, v in scratch.items():
                    sums[k] = sums.get(k, 0.0) + v * fresh / max(rows, size)
        for k, v in sums.items():
            if not k.startswith("perf/"):
                out["val/" + k.removeprefix("critic/")] = v
        out.update({f"val/{k}": v for k, v in held_out.metrics().items()})
        self.generations = held_out.table
        return out

    def _eval_nodes(self, env: dict[tuple[str, str], Any], step: int) -> dict[str, float]:
        """Every node on one held-out batch, the updates in the update loop's evaluation
        mode."""
        scratch: dict[str, float] = {}
        for name in self.prologue + self.order:
            if not self.kinds[name].trains:
                self.run_node(name, env, step, strict=False, metrics=scratch, split="eval")
            else:
                self._update_eval(name, env, step, scratch)
        return scratch

    def _update_eval(self, name: str, env: dict[tuple[str, str], Any], step: int,
                     metrics: dict[str, float]) -> None:
        """An update's held-out metrics (its loss's `held_out`), no step."""
        impl = self.impls[name]
        kw = {port: env[(ref.node, ref.port)] for port, ref in self.nodes[name].inputs}
        kw.update({k: v for k, v in self.params_of(name).items() if k in impl.accepts})
        ctx = self.ctx(name, step)
        update_loop.evaluate(ctx, impl.fn(**kw))
        metrics.update(ctx.metrics)

    # -- the loop -------------------------------------------------------------------------

    def saved_models(self) -> dict[str, torch.nn.Module]:
        """The models a checkpoint holds: the trained ones. A frozen model (a reference, a
        reward model) is rebuilt from its source when a run resumes, never saved again."""
        return {n: m for n, m in self.res.models.items() if n in self.res.optimizers}

    def checkpoint_modules(self) -> dict[str, Any]:
        mods: dict[str, Any] = {}
        for name, model in self.saved_models().items():
            mods[f"model.{name}"] = TrainedPart(model)
        for name, opt in self.res.optimizers.items():
            mods[f"optim.{name}"] = opt
            mods[f"sched.{name}"] = self.res.schedulers[name]
        return mods

    def run_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint holds besides weights and optimizers (JSON-able)."""
        cursors = (self.rollouts.data_cursors(step) if self.rollouts is not None
                   else {d: s.train.state_dict() for d, s in self.res.data.items()})
        return {
            "step": step,
            "cursors": cursors,
            "node_state": self.node_state,
            "plan": self.plan.graph.name,
        }

    def save(self, step: int) -> None:
        save_checkpoint(self.opts.run_dir, step, modules=self.checkpoint_modules(),
                        state=self.run_state(step), keep=self.graph.trainer.max_checkpoints,
                        rollouts=self.buffered(step))

    def buffered(self, step: int) -> list[Rollout] | None:
        """The rollouts a checkpoint after `step` holds; None: synchronous."""
        return self.rollouts.buffered(step) if self.rollouts is not None else None

    def restore(self) -> int:
        """Load the latest checkpoint; return the next step to run (0 when none).
        A checkpoint of any target loads on any other."""
        found = latest_checkpoint(self.opts.run_dir)
        if found is None:
            return 0
        self.load_weights(found[1])
        return self.restore_state(found[1])

    def load_weights(self, folder: Path) -> None:
        """Hook: this process's models, optimizers and schedulers from the checkpoint in
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

    def save_shards(self, folder: Path) -> None:
        """This process's part of a distributed checkpoint in `folder`: its DCP shards of
        the trained models and optimizers; the schedulers (the same on every worker)
        from worker 0."""
        from flowgraph.compilers import _dist

        _dist.dcp_save(folder, self.saved_models(), self.res.optimizers)
        if self.rank == 0:
            for name, sched in self.res.schedulers.items():
                torch.save(sched.state_dict(), folder / f"sched.{name}.pt")

    def restore_state(self, folder: Path) -> int:
        """Cursors and node state of the checkpoint in `folder`; the next step."""
        state = json.loads((folder / "state.json").read_text())
        for d, cursor in state["cursors"].items():
            self.res.data[d].train.load_state_dict(cursor)
        if self.rollouts is not None:  # a synchronous run's checkpoint holds no buffer
            self.rollouts.load(load_buffer(folder) or [], state["cursors"])
        for name, node_state in state["node_state"].items():
            self.node_state.setdefault(name, {}).update(node_state)
        return int(state["step"]) + 1

    def prepare_run_dir(self) -> None:
        run_dir = self.opts.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_partial(run_dir)
        (run_dir / "plan.json").write_text(self.plan.to_json())

    def open_log(self, worker: str = "local") -> MetricsLog:
        trackers = open_trackers(self.graph, self.opts.run_dir, resume=self.opts.resume,
                                 tensorboard=self.opts.tensorboard)
        return MetricsLog(self.opts.run_dir, trackers=trackers,
                          console="console" in self.graph.trainer.loggers,
                          out=self.opts.out, total_steps=self.graph.trainer.steps,
                          exporter=self.opts.exporter, worker=worker)

    def run(self) -> list[dict[str, float]]:
        """The training loop; returns the metric rows this process produced. A fault a
        target can recover from (`WorkerLost`: a Ray worker died or hung) goes to
        `recover`, which says the step to go on from."""
        trainer = self.graph.trainer
        self.prepare_run_dir()
        if self.plan.asynchronous is not None:
            self.rollouts = (ProcessRollouts if self.overlap_rollouts else InlineRollouts)(self)
        step = self.start_step = self.restore() if self.opts.resume else 0
        log = self.open_log()
        log.truncate_after(step - 1)
        rows: list[dict[str, float]] = []
        try:
            self.before_loop()
            if self.rollouts is not None:
                self.rollouts.start(step)
            while step < trainer.steps:
                try:
                    metrics, saved = self.train_step(step, log)
                except WorkerLost as exc:
                    step = self.start_step = self.recover(exc, step)
                    log.truncate_after(step - 1)
                    if self.rollouts is not None:
                        self.rollouts.start(step)
                    continue
                rows.append(metrics)
                self.completed(saved)
                step += 1
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
            log.close()
        return rows

    def recover(self, exc: WorkerLost, step: int) -> int:
        """Hook: after `exc` at `step`, the step to run next; here, nothing recovers."""
        raise exc

    def completed(self, saved: bool) -> None:
        """Hook: a step finished (`saved`: and its checkpoint was written)."""

    def before_loop(self) -> None:
        """The prologue over the training rows, and the held-out rows when the run
        evaluates; its time goes in the first row (`timing_s/prologue`)."""
        self.prologue_seconds = self.run_prologue("train")
        if self.graph.trainer.eval_every or self.graph.trainer.val_before_train:
            self.prologue_seconds += self.run_prologue("eval")

    def train_step(self, step: int, log: MetricsLog) -> tuple[dict[str, float], bool]:
        """One turn of the loop: the step, the evaluation when due, the row logged, a
        checkpoint when due; (the row, whether a checkpoint was written)."""
        trainer = self.graph.trainer
        before: dict[str, float] = {}
        self.generations = []
        if trainer.val_before_train and step == 0 and trainer.eval_every != 1:
            before = self.evaluate(step)  # the model before any update: the baseline
        metrics = self._guarded_step(step)
        if self.rollouts is not None:  # the update is done: its weights go to the producer
            self.rollouts.advance(step)
        metrics.update(before)
        if trainer.eval_every and (step + 1) % trainer.eval_every == 0:
            metrics.update(self.evaluate(step))
        if step == self.start_step:  # the prologue, what the data load dropped: first row
            if self.prologue:
                metrics["timing_s/prologue"] = self.prologue_seconds
            metrics.update({f"data/{name}/filtered_overlong": float(s.train.filtered_overlong)
                            for name, s in self.res.data.items()
                            if getattr(s.train, "filtered_overlong", 0)})
        log.write(step, metrics)
        if self.generations:
            log.table(step, "validation", self.generations)
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


class ProducerExecutor(LocalExecutor):
    """The producer of an asynchronous plan in a process of its own
    (`flowgraph.compilers.rollouts`): its nodes only, the models they run, no
    optimizer, no prologue (its outputs are looked up by the consumer)."""

    def __init__(self, plan: ExecutionPlan, options: ExecOptions) -> None:
        super().__init__(plan, options)
        self.order = self.producer
        self.prologue = []

    def hosted_models(self) -> tuple[ModelPlacement, ...]:
        run = {n.model for n in self.plan.nodes if n.name in self.order and n.loads_model}
        bases = {m.base_of for p in self.plan.pools for m in p.models if m.name in run}
        return tuple(m for p in self.plan.pools for m in p.models
                     if m.name in run or m.name in bases)


def _join(values: list[Any]) -> Any:
    """One port's rows of every try, in order: tensors concatenated, lists chained."""
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values)
    return [row for value in values for row in value]


def _unstack(outputs: dict[str, Any], rows: list[int]) -> dict[str, list[Any]]:
    """Each output's rows cut back into parts of `rows` rows (`_join`'s inverse)."""
    bounds = list(itertools.accumulate(rows, initial=0))
    return {port: [value[a:b] for a, b in itertools.pairwise(bounds)]
            for port, value in outputs.items()}


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
    holds a run unless resuming, and a tracker whose package is missing. Quiets Hugging
    Face."""
    check_trackers(plan.graph)
    run_dir = Path(plan.graph.trainer.run_dir)
    if not check_only:
        _quiet_hf()
        _writable(run_dir)
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
    run_dir = prepare_run(plan, resume=opts.resume)
    device = pick_device(plan.graph.resources.device)
    with serving(plan.graph, opts.metrics_port, opts.metrics_host, hold=opts.metrics_hold,
                 out=opts.out) as exporter:
        executor = LocalExecutor(plan, ExecOptions(
            run_dir, device, opts.strict, opts.resume, opts.out,
            opts.tensorboard, exporter))
        executor.setup()
        executor.run()


def _new_rows_per_batch(rows: int, size: int) -> list[int]:
    """Rows not seen before in each held-out batch of `size`: ⌈rows/size⌉ batches, the
    last one overlapping the one before (one batch when rows < size: it cannot be
    drawn, and the dataset says so)."""
    if rows <= size:
        return [size]
    return [min(size, rows - start) for start in range(0, rows, size)]
