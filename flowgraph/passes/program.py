"""`Program`: the typed record the compile passes transform, and what passes are.

A pass is a small frozen dataclass with a `name`, the names of the passes whose
results it reads (`requires`), and one `apply(program) -> program` that builds a new
record with `dataclasses.replace`; nothing is mutated. Each field of `Program` is set
by one pass and read by later ones; `to_plan` lowers the finished program to the
`ExecutionPlan` executors run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

from flowgraph.agent.mcp_servers import resolved as mcp_resolved
from flowgraph.checker import CheckResult
from flowgraph.checker.shapes import has_batch_axis
from flowgraph.diagnostics import Diagnostic
from flowgraph.dims import resolved_text
from flowgraph.errors import PlanError
from flowgraph.frontend import graph_to_yaml
from flowgraph.ir import Graph, NodeSpec, Params, Plugin, PortRef, to_python
from flowgraph.objects import TAG, PyObject, by_value
from flowgraph.paths import written_file
from flowgraph.plan import (
    ROLLOUT_POOL,
    AsyncPlan,
    Bundle,
    DimValue,
    EdgePlan,
    ExecutionPlan,
    InputPlan,
    NodePlan,
    OutputPlan,
    ParamPlan,
    PoolMemory,
    PoolPlan,
    ResamplePlan,
    RunSpec,
    SpecPlan,
    StagePlan,
    gib,
    producer_side,
    repeated,
    verify,
)
from flowgraph.registry import (
    KindSpec,
    PortSpec,
    declared_function,
    plugin_folder,
    plugin_source,
    session_losses,
    with_loss_implementations,
)


@dataclass(frozen=True, slots=True)
class PortLabel:
    """The resolved dims of one output, e.g. `gen.responses`: `(Bp*N, T) = (16, 8)`."""

    ref: str
    """`node.port`."""
    label: str


@dataclass(frozen=True, slots=True)
class NodePlacement:
    """Where one node or data source runs."""

    node: str
    pool: str
    data_parallel: bool
    """Each worker of the pool gets a slice of the batch; False: the whole batch."""


@dataclass(frozen=True, slots=True)
class Placement:
    """The pools and every producer's place (pass `placement`)."""

    pools: tuple[PoolPlan, ...]
    nodes: tuple[NodePlacement, ...]

    def of(self, node: str) -> NodePlacement:
        return next(p for p in self.nodes if p.node == node)

    def pool(self, name: str) -> PoolPlan:
        return next(p for p in self.pools if p.name == name)


@dataclass(frozen=True, slots=True)
class Schedule:
    """Stages and per-edge dispatch (pass `schedule`)."""

    stages: tuple[StagePlan, ...]
    edges: tuple[EdgePlan, ...]


@dataclass(frozen=True, slots=True)
class Program:
    """A graph on its way to a plan, with what each pass has found out so far."""

    graph: Graph
    target: str
    """`local`, `fsdp` or `ray`."""
    nproc: int
    """Data-parallel size: `--nproc`, else `resources.nproc`."""
    device: str
    """`cpu` or `cuda`: `resources.device`, or the caller's choice when it says `auto`."""
    check: CheckResult | None = None
    """Set by `validate`: the kinds of every producer and the inferred shapes."""
    dims: tuple[DimValue, ...] = ()
    """Set by `infer_dims`: every global dim bound to a number (B = Bp*N included)."""
    labels: tuple[PortLabel, ...] = ()
    """Set by `infer_dims`: the resolved dims of every output."""
    dropped: tuple[str, ...] = ()
    """Set by `dce`: removed nodes and data sources, in file order."""
    rewrites: tuple[str, ...] = ()
    """What the optimising passes changed in the graph, one line each (`on_policy`)."""
    fused: tuple[tuple[str, ...], ...] = ()
    """Set by `fusion`: groups of nodes that run as one forward over their rows stacked."""
    asynchronous: bool = False
    """Set by `asynchronous`: the plan cuts the step into a producer running ahead of
    the update and a consumer (`AsyncPlan`, built by `to_plan`)."""
    placement: Placement | None = None
    schedule: Schedule | None = None
    memory: tuple[PoolMemory, ...] | None = None
    """Set by `memory`: the estimate per pool hosting models."""
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def failed(self) -> bool:
        return any(d.is_error for d in self.diagnostics)

    def add(self, *diags: Diagnostic) -> Program:
        return replace(self, diagnostics=self.diagnostics + diags)

    def kind(self, name: str) -> KindSpec:
        """The kind of a producer; `validate` resolved every one or stopped the pipeline."""
        if self.check is None:
            raise RuntimeError("pass `validate` has not run")
        kind = self.check.table[name].kind
        if kind is None:
            raise RuntimeError(f"`{name}` has no resolved kind")
        return kind

    def producers(self) -> tuple[str, ...]:
        """Data sources, then nodes, in file order."""
        return tuple(d.name for d in self.graph.data) + tuple(n.name for n in self.graph.nodes)

    def model_of(self, name: str) -> str | None:
        node = self.graph.node(name)
        return node.model if node is not None else None

    def describe(self) -> str:
        """The graph as YAML, then what the passes added, as YAML comments."""
        return graph_to_yaml(self.graph) + "".join(f"# {line}\n" for line in self._facts())

    def _facts(self) -> list[str]:
        lines = []
        if self.dims:
            lines.append("dims: " + " ".join(f"{d.name}={d.value}" for d in self.dims))
        lines += [f"shape {p.ref}: {p.label}" for p in self.labels]
        if self.dropped:
            lines.append(f"dropped: {', '.join(self.dropped)}")
        return lines + self._placement_facts() + self._schedule_facts() + self._memory_facts()

    def _placement_facts(self) -> list[str]:
        if self.placement is None:
            return []
        lines = [f"pool {p.name}: {p.size} x {p.device}, models "
                 f"{', '.join(f'{m.name} ({m.sharding})' for m in p.models) or '-'}"
                 for p in self.placement.pools]
        return lines + [f"node {n.node} -> {n.pool}{' (data-parallel)' if n.data_parallel else ''}"
                        for n in self.placement.nodes]

    def _schedule_facts(self) -> list[str]:
        if self.schedule is None:
            return []
        lines = [f"stage {s.name}: {', '.join(s.nodes)}" for s in self.schedule.stages]
        return lines + [f"edge {e.src} -> {e.dst}: {e.dispatch}"
                        f"{' (group-aligned)' if e.group_aligned else ''}"
                        for e in self.schedule.edges]

    def _memory_facts(self) -> list[str]:
        lines = []
        for m in self.memory or ():
            lines.append(f"memory {m.pool}: {gib(m.total_bytes)} per device, peak node "
                         f"{m.peak_node}")
            lines += [f"  {i.what} {i.owner}: {i.bytes} bytes"
                      f"{' (transient)' if i.transient else ''}" for i in m.items]
        return lines

    def to_plan(self) -> ExecutionPlan:
        """Lower the finished program; `placement` and `schedule` must have run."""
        if self.placement is None or self.schedule is None:
            raise RuntimeError("passes `placement` and `schedule` must run before lowering")
        stage_of = {n: s.name for s in self.schedule.stages for n in s.nodes}
        labels = {p.ref: p.label for p in self.labels}
        nodes = tuple(self._node_plan(n, stage_of[n], labels) for n in self.producers())
        order = [n for s in self.schedule.stages for n in s.nodes]
        leads = {}  # the first of each group in the schedule runs the others' rows too
        for group in self.fused:
            first, *rest = sorted(group, key=order.index)
            leads[first] = tuple(rest)
        nodes = tuple(replace(n, fused=leads.get(n.name, ())) for n in nodes)
        g = self.graph
        return verify(ExecutionPlan(
            run=RunSpec(g.name, g.trainer, g.resources, g.models, g.data,
                        resolved_plugins(g)),
            target=self.target, nproc=self.nproc, device=self.device,
            dims=self.dims, nodes=nodes, pools=self.placement.pools,
            stages=self.schedule.stages, edges=self.schedule.edges, memory=self.memory or (),
            dropped=self.dropped, rewrites=self.rewrites,
            plugin_paths=plugin_paths(self.graph), source=self.graph.source,
            resample=self._resample(), asynchronous=self._async_plan(nodes),
            objects=plan_objects(self.graph, {
                n.impl: declared_function(n.kind) for n in nodes if by_value(n.impl)}
                | _session_losses(nodes))))

    def _async_plan(self, nodes: tuple[NodePlan, ...]) -> AsyncPlan | None:
        """The producer / consumer cut when pass `asynchronous` ran (None: synchronous),
        with where the producer runs on this target."""
        if not self.asynchronous or self.placement is None or self.schedule is None:
            return None
        kinds = {n.name: self.kind(n.name) for n in self.graph.nodes}
        t = self.graph.trainer
        producer = graph_producer_side(self.graph, self.schedule.stages, kinds)
        runs = {n.model for n in nodes if n.name in producer and n.loads_model and n.model}
        return AsyncPlan(producer, t.max_staleness, t.admission, t.old_log_prob,
                         producer_process(self.target),
                         rollout_pool(self.target, self.placement.pools, runs, self.device,
                                      self.graph.resources.rollout_cpus),
                         t.partial_rollouts,
                         tuple(n for n in producer if n in kinds
                               and kinds[n].output("policy_version") is not None))

    def _resample(self) -> ResamplePlan | None:
        """The refill loop of the graph's filter node (the checker allows one, and only
        with bound dims: FG304), None without one."""
        name = next((n.name for n in self.graph.nodes if self.kind(n.name).category == "filter"),
                    None)
        if name is None or self.check is None or self.schedule is None:
            return None
        env = self.check.shapes.env
        groups, size = (env.value(env.locals_.get(f"{name}.{d}")) for d in ("g", "n"))
        if groups is None or size is None:
            raise RuntimeError(f"filter `{name}`: its dims g and n are not bound")
        repeat = repeated(self.schedule.stages, graph_reads(self.graph),
                          (d.name for d in self.graph.data), name)
        node = self.graph.node(name)
        assert node is not None
        tries = self.kind(name).param_values(node.params.to_python())["max_tries"]
        assert isinstance(tries, int)
        return ResamplePlan(name, repeat, groups, size, tries)

    def _node_plan(self, name: str, stage: str, labels: dict[str, str]) -> NodePlan:
        """What the executors need of node `name`: its placement and every fact of its
        kind they act on (they never read the registry)."""
        assert self.placement is not None
        kind = self.kind(name)
        place = self.placement.of(name)
        node = self.graph.node(name)
        inputs = tuple(InputPlan(port, str(ref), labels.get(str(ref), ""),
                                 self._contract(name, spec := kind.input(port)),
                                 SpecPlan.of(spec.spec) if spec is not None else None,
                                 str(ref.pos))
                       for port, ref in (node.inputs if node else ()))
        outputs = tuple(OutputPlan(p.name, self._contract(name, p), self._batched(name, p.name),
                                   SpecPlan.of(p.spec), p.optional)
                        for p in kind.outputs)
        model = self.model_of(name)
        hosted = {m.name for p in self.placement.pools for m in p.models}
        loads = model in hosted and kind.model != "none" and kind.head != "tokenizer"
        given = files_resolved(kind, node) if node is not None else {}
        call = with_loss_implementations(kind, kind.call_values(given))
        held_out = with_loss_implementations(kind, kind.eval_values(given, self._eval_dims()))
        return NodePlan(name, kind.name, kind.impl, model, place.pool, place.data_parallel,
                        stage, bool(node and node.hoisted), inputs, outputs, loads,
                        kind.trains, category=kind.category, head=kind.head,
                        params=ParamPlan.of(call) if node else (), given=ParamPlan.of(given),
                        eval_params=ParamPlan.of(held_out) if node else (),
                        where=str(spot.pos) if (spot := node or self.graph.data_source(name))
                        else "")

    def _eval_dims(self) -> dict[str, int]:
        """Global dims that take another value at evaluation: N, when every rollout whose
        samples per prompt are N (`n` null or N) answers `n` times on held-out prompts
        (greedy: once), so that a node defaulting to N (`repeat`) follows the batch."""
        N = next((d.value for d in self.dims if d.name == "N"), None)
        held_out: set[object] = set()
        for node in self.graph.nodes:
            kind = self.kind(node.name)
            given = node.params.to_python()
            if kind.category != "rollout" or kind.call_values(given).get("n", N) not in (None, N):
                continue
            held_out.add(kind.eval_values(given).get("n"))
        n = held_out.pop() if len(held_out) == 1 else None
        return {"N": n} if isinstance(n, int) else {}

    def _batched(self, name: str, port: str) -> bool:
        """The output has a batch axis (see `has_batch_axis`); unchecked: taken for one."""
        if self.check is None:
            return True
        return has_batch_axis(self.check.shapes, PortRef(name, port))

    def _contract(self, node: str, port: PortSpec | None) -> str | None:
        """A port's contract in global terms (`Bp*N T`); None without inferred shapes."""
        if port is None or self.check is None or self.check.shapes is None:
            return None
        env = self.check.shapes.env
        return resolved_text(tuple(env.qualify(a.size, node) if a.size is not None else None
                                   for a in port.spec.shape.fixed_axes()))


class Pass(Protocol):
    """One step of the pipeline."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]
    """Passes whose results `apply` reads; they cannot be disabled while this one runs."""

    def apply(self, program: Program) -> Program: ...


def resolved_plugins(graph: Graph) -> tuple[Plugin, ...]:
    """The graph's plugins as every process of the run finds them: a `.py` file by the
    absolute path `check` found it at (`Plugin.folder`: `plug/rewards.py` next to the
    graph file, or in the working directory for one given on the command line), so that
    no process resolves it again from its own working directory; a module name, or a
    file not found (the checker's FG113), as written."""
    found = [(p, plugin_source(p.module, p.folder()) if p.module.endswith(".py") else None)
             for p in graph.plugins]
    return tuple(replace(p, module=str(source)) if source is not None else p
                 for p, source in found)


def files_resolved(kind: KindSpec, node: NodeSpec) -> dict[str, Any]:
    """The params `node` sets, each file one names (`ParamSpec.files`: a verl tool config,
    a `.jinja` chat template; an MCP server's `cwd`) made absolute by the rule the checker
    finds it by (`written_file`): the run opens that file, from whatever folder it starts
    in."""
    given = node.params.to_python()
    for spec in kind.params:
        param = node.params.find(spec.name) if spec.files or spec.agent == "mcp" else None
        if param is not None and spec.agent == "mcp":  # each server's cwd
            given[spec.name] = mcp_resolved(given[spec.name], param.pos)
        elif param is not None and isinstance(param.value, str) and \
                param.value.endswith(spec.files):
            given[spec.name] = written_file(param.value, param.pos)
        elif param is not None and isinstance(param.value, Params):  # `envs`: each value
            given[spec.name] = {p.name: written_file(p.value, p.pos)
                                if isinstance(p.value, str) and p.value.endswith(spec.files)
                                else to_python(p.value) for p in param.value.items}
    return given


def plugin_paths(graph: Graph) -> tuple[str, ...]:
    """The absolute folders of the graph's plugins that lie next to the file listing them."""
    found = [plugin_folder(p.module, p.folder()) for p in graph.plugins]
    return tuple(dict.fromkeys(f for f in found if f is not None))


def graph_reads(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Each node of `graph` -> the producers it reads: its wiring as the plan's rules take
    it (`flowgraph.plan.verify`)."""
    return {n.name: tuple(ref.node for _, ref in n.inputs) for n in graph.nodes}


def graph_producer_side(graph: Graph, stages: tuple[StagePlan, ...],
                        kinds: Mapping[str, KindSpec]) -> tuple[str, ...]:
    """The asynchronous producer of `graph` (`flowgraph.plan.producer_side`)."""
    return producer_side(stages, graph_reads(graph), (d.name for d in graph.data), kinds,
                         {n.name: n.model for n in graph.nodes},
                         {m.name for m in graph.models if m.trainable})


def _session_losses(nodes: tuple[NodePlan, ...]) -> dict[str, Any]:
    """The session's policy losses the nodes' params name (`with_loss_implementations`)."""
    named = {json.loads(p.value).get(TAG) for n in nodes for p in (*n.params, *n.eval_params)
             if p.value.startswith("{")}
    return {ref: fn for ref, fn in session_losses().items() if ref in named}


def producer_process(target: str) -> bool:
    """Whether an asynchronous plan's producer gets a process of its own on `target`:
    on `local`, where it overlaps the update; the fsdp ranks produce in their loop (same
    numbers, no overlap); ray gives it a pool of its own (`rollout_pool`)."""
    return target == "local"


def rollout_pool(target: str, pools: tuple[PoolPlan, ...], runs: set[str], device: str,
                 cpus: int) -> PoolPlan | None:
    """The pool an asynchronous plan's producer runs on, on `target`: on ray one worker
    of `cpus` cores (and a GPU on cuda) hosting a whole copy of each model the producer's
    nodes run (`runs`, with the LoRA models whose base they run), which it loads itself
    and then takes the trained weights into after every update; None elsewhere (the
    producer runs in a process of its own, or in the loop)."""
    if target != "ray":
        return None
    bases = {m.base_of for p in pools for m in p.models if m.name in runs and m.base_of}
    models = tuple(replace(m, sharding="none") for p in pools for m in p.models
                   if m.name in runs or m.name in bases)
    return PoolPlan(ROLLOUT_POOL, 1, device, models,
                    (Bundle(cpu=cpus, gpu=1 if device == "cuda" else 0),))


def plan_objects(graph: Graph, functions: Mapping[str, Any]) -> tuple[PyObject, ...]:
    """The table of a plan: the objects the graph's params hold, and the session kinds'
    and policy losses' implementations (`functions`: impl path -> function), in that
    order. Two different objects with one reference (two lambdas, a function defined
    again under its old name in another scope) are an error: a worker could not tell
    them apart."""
    found: dict[str, PyObject] = {}
    held = [o for n in graph.nodes for o in n.params.objects()]
    held += [PyObject(ref, "function").with_object(fn) for ref, fn in functions.items()]
    for o in held:
        first = found.setdefault(o.ref, o)
        if first.obj is not o.obj:
            raise PlanError(f"two different Python objects are both `{o.ref}` (defined at "
                            f"{first.where or '?'} and {o.where or '?'}): give each its own "
                            "name at module level")
    return tuple(found.values())
