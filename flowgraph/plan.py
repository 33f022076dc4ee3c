"""The execution plan: what runs where, in which order, and how each edge's batch moves.

`flowgraph compile` lowers a graph to an `ExecutionPlan` and writes it as JSON; the
executors (`flowgraph.compilers.targets.local`, `fsdp`, `ray`) consume only the plan. Every
record is frozen and checks itself; `ExecutionPlan.from_json(plan.to_json()) == plan`.

Vocabulary:

* a **pool** is a group of `size` identical workers (processes) that host some models
  together; `driver` (ray only) is the single controller, a pool without bundles that
  runs in the launching process and hosts no model;
* a node is **data-parallel** when each worker of its pool holds a 1/size slice of the
  batch; otherwise it sees the whole batch (the driver, the local process, or every
  fsdp rank running a model-free node redundantly on the whole batch);
* a **stage** is a set of nodes that depend only on earlier stages; the `prologue`
  stage (`once`) runs before the training loop, over every row of the dataset, in the
  listed order, and its outputs are kept by row (`uid`); the `step.K` stages run at
  every step, in order;
* between nodes every tensor is held whole (the batch of the step); a data-parallel
  node's outputs are gathered from its workers as it finishes. An edge's **dispatch**
  says how the consumer gets its tensor: `local` (a whole-batch consumer reads the
  whole tensor where it is), `gather` (the producer ran data-parallel: its slices,
  concatenated), `split` (a whole batch cut into per-worker slices for a
  data-parallel consumer), `reshard` (a data-parallel producer's slices re-cut for a
  data-parallel consumer: gather, then split) and `broadcast` (the whole tensor
  copied to every worker: a tensor with no batch axis, or the input of an update,
  whose workers each take their share of every mini-batch so that the mini-batches
  are the one-process run's). `group_aligned` splits cut only between groups of
  samples of one prompt. `dispatch_of` is the rule, used by the compiler and by the
  verifier alike.

A **resample** loop (DAPO's dynamic sampling) is plan data too: `ResamplePlan` names
the filter node, the producers each try repeats (the data sources and every step node
the filter depends on, in stage order), the number of groups to keep and the tries
allowed; an executor repeats exactly those, then runs the other step nodes once on
the filter's joined, truncated outputs.

**Asynchronous rollouts** (`trainer.max_staleness` S > 0) are plan data as well:
`AsyncPlan` lists the producer (data, rollouts, and the nodes that read only them and
run no trained model, `producer_side`), which runs up to S steps ahead of the rest of
the step, the consumer, through a buffer of rollouts stamped with the policy version
that generated them (`flowgraph.compilers.rollouts`).

A plan read from JSON is checked by `verify` (`from_json` calls it): the format
version, every reference, pools hosting the models their nodes run, stages that
respect every dependency, and each edge's dispatch against the rule.

Notation: B = Bp*N sequences, Bp prompts, N samples per prompt, P prompt length,
T response length, V vocabulary.
"""

from __future__ import annotations

import json
import types
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from flowgraph.choices import ADMISSIONS, DEVICES, PLACEMENT_STRATEGIES, TARGETS
from flowgraph.contracts import TensorSpec
from flowgraph.document import MAX_DEPTH, YMap, YNode, YScalar, YSeq
from flowgraph.errors import FlowgraphError, PlanError, PlanFileError
from flowgraph.frontend import graph_from_document, graph_to_document
from flowgraph.ir import (
    NAME_RE,
    DataSpec,
    Graph,
    ModelSpec,
    NodeSpec,
    Plugin,
    ResourceSpec,
    TrainerSpec,
    readers,
)
from flowgraph.objects import (
    PyObject,
    by_value,
    pickled,
    rebuilt,
    tagged,
    unpickled,
    unresolved_message,
)
from flowgraph.registry import HOISTABLE_CATEGORIES, KindSpec, plugin_module
from flowgraph.source import SourcePos

PLAN_VERSION = 6
MAX_PLAN_BYTES = 64 << 20
"""A plan file larger than this is refused before it is parsed (the plan of a 10,000-node
graph is a few MiB)."""
MAX_PLAN_DEPTH = MAX_DEPTH + 16
"""Nesting a plan file may have: a graph file's (`flowgraph.document.MAX_DEPTH`) and the
plan's own levels around it."""
"""Format version of the JSON plan; `from_json` refuses any other."""
DISPATCHES = ("local", "split", "gather", "broadcast", "reshard")
SHARDINGS = ("none", "full_shard")
LOADED_HEADS = ("lm", "scalar")
MEMORY_ITEMS = ("weights", "grads", "optimizer", "compute", "activations", "logits", "kv_cache",
                "vllm")
DRIVER = "driver"
"""The single controller's pool (target ray)."""
GIB = 1 << 30


def _require(problems: list[str], where: str) -> None:
    if problems:
        raise PlanError(f"invalid {where}: " + "; ".join(problems))


def _bad_name(name: str) -> bool:
    return not isinstance(name, str) or not NAME_RE.match(name)


@dataclass(frozen=True, slots=True)
class DimValue:
    """A global dim bound to a number."""

    name: str
    value: int

    def __post_init__(self) -> None:
        _require(["value must be >= 1"] if self.value < 1 else [], f"dim `{self.name}`")


@dataclass(frozen=True, slots=True)
class SpecPlan:
    """A port's contract as its kind declares it (`flowgraph.contracts.TensorSpec`):
    what strict mode holds a tensor to, beside its dims in global terms."""

    dims: str
    """The kind's own dims, jaxtyping grammar (`b T`)."""
    dtype: str = "float"
    constraints: tuple[str, ...] = ()

    def tensor_spec(self) -> TensorSpec:
        return TensorSpec(self.dims, self.dtype, self.constraints)

    @staticmethod
    def of(spec: TensorSpec) -> SpecPlan:
        return SpecPlan(spec.dims, spec.dtype, spec.constraints)


@dataclass(frozen=True, slots=True)
class ParamPlan:
    """One param of a node, resolved: the graph's value, else the kind's default."""

    name: str
    value: str
    """The value as JSON text (a param value is plain data: a scalar, list or mapping; a
    function or class is its reference `{"$python": ref}`, an entry of
    `ExecutionPlan.objects`)."""

    @staticmethod
    def of(params: Mapping[str, object]) -> tuple[ParamPlan, ...]:
        return tuple(ParamPlan(k, json.dumps(v, sort_keys=True)) for k, v in params.items())


@dataclass(frozen=True, slots=True)
class InputPlan:
    """One wired input of a node."""

    port: str
    src: str
    """The upstream output, `node.port`."""
    shape: str
    """Resolved dims of the tensor, e.g. `(Bp*N, T) = (16, 8)`; empty when the dims were
    not inferred (pass `infer_dims` disabled)."""
    dims: str | None = None
    """The port's contract in global terms, one word an axis (`Bp*N T`, `_`: any size),
    what strict mode holds the tensor to; None when the checker could not resolve it."""
    spec: SpecPlan | None = None
    """The port's contract (dtype, constraints); None for a data source's ports."""
    where: str = ""
    """Where the graph file wires it (`graph.yaml:14:17`), for messages."""

    @property
    def ref(self) -> tuple[str, str]:
        """The upstream output as (node, port)."""
        node, _, port = self.src.partition(".")
        return node, port


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """One output of a node: its contract in global terms (see `InputPlan.dims`)."""

    port: str
    dims: str | None = None
    batched: bool = True
    """It has a batch axis: the outputs of a node run on slices are concatenated along
    it (`EdgePlan.batched` of every edge it feeds); False: the same on every worker."""
    spec: SpecPlan | None = None
    optional: bool = False
    """Computed only when consumed (its implementation is asked `with_<port>=True`)."""


@dataclass(frozen=True, slots=True)
class NodePlan:
    """A node or data source and where and when it runs."""

    name: str
    kind: str
    impl: str
    """`module:function` of the implementation, imported by executors; a kind declared in
    the compiling session (`__main__`, a notebook cell) names an entry of
    `ExecutionPlan.objects` instead."""
    model: str | None
    pool: str
    data_parallel: bool
    """Each worker of the pool gets a 1/size slice of the batch; False: the whole batch."""
    stage: str
    hoisted: bool
    """Computed in the prologue (its stage is `once`)."""
    inputs: tuple[InputPlan, ...] = ()
    outputs: tuple[OutputPlan, ...] = ()
    loads_model: bool = False
    """The node runs its model's weights (its pool must host the model); False for
    model-free nodes and for those that use a model's tokenizer only."""
    trains: bool = False
    """An update: each worker gets the whole batch and takes its share of every
    mini-batch (`broadcast` inputs)."""
    fused: tuple[str, ...] = ()
    """Nodes of this one's kind and model, later in its stage, that run in this node's
    forward over their rows stacked under its own (pass `fusion`); they do not run."""
    category: str = ""
    """The kind's category (`rollout`, `reward`, `advantage`, `update`, `filter`, `data`…):
    where its time goes, which step metrics it gives."""
    head: str = "lm"
    """What the node uses its model as (`KindSpec.head`): `lm`, `scalar`, `tokenizer`."""
    params: tuple[ParamPlan, ...] = ()
    """Every param of the kind, resolved; what the implementation is called with."""
    eval_params: tuple[ParamPlan, ...] = ()
    """The params at evaluation on held-out data (a rollout: `val_n` responses, greedy
    unless `val_temperature` > 0; an update: the same implementation, whose `Update` the
    update loop evaluates without a step); the kind's evaluation-only params are in
    neither."""
    where: str = ""
    """The node's place in the graph file (`graph.yaml:12:3`), for messages."""

    def __post_init__(self) -> None:
        _require(["name is not an identifier"] if _bad_name(self.name) else [],
                 f"node `{self.name}`")

    def wiring(self) -> tuple[tuple[str, tuple[str, str]], ...]:
        """Each input port and the (node, port) it reads."""
        return tuple((i.port, i.ref) for i in self.inputs)

    def param_values(self, *, evaluation: bool = False) -> dict[str, Any]:
        """The params as Python values (at evaluation: `eval_params`), a Python object as
        its reference (`ExecutionPlan.live_params` gives the object)."""
        return {p.name: json.loads(p.value)
                for p in (self.eval_params if evaluation else self.params)}


@dataclass(frozen=True, slots=True)
class Amount:
    """How much of a custom Ray resource a worker takes (`resources.pools.<p>.
    custom_resources`)."""

    name: str
    amount: float

    def __post_init__(self) -> None:
        _require([] if self.amount > 0 else [f"amount must be > 0, got {self.amount}"],
                 f"resource `{self.name}`")


@dataclass(frozen=True, slots=True)
class Label:
    """A node label a pool's workers select their nodes by, and Ray's selector of its value
    (`a100`, `!spot`, `in(a, b)`)."""

    name: str
    selector: str


@dataclass(frozen=True, slots=True)
class Bundle:
    """Resources of one worker: a Ray placement-group bundle, or one fsdp rank."""

    cpu: int = 1
    gpu: int = 0
    custom: tuple[Amount, ...] = ()
    """Custom Ray resources (what `ray start --resources` gives nodes)."""

    def __post_init__(self) -> None:
        _require(["cpu and gpu must be >= 0"] if min(self.cpu, self.gpu) < 0 else [], "bundle")

    def asks(self) -> dict[str, float]:
        """The bundle as Ray writes one: resource -> amount (`{"CPU": 1, "GPU": 1}`)."""
        return {"CPU": self.cpu, **({"GPU": self.gpu} if self.gpu else {}),
                **{a.name: a.amount for a in self.custom}}


@dataclass(frozen=True, slots=True)
class ModelPlacement:
    """A model hosted by a pool."""

    name: str
    trainable: bool
    sharding: str
    """`full_shard`: FSDP2 `fully_shard` per transformer block over the pool's workers;
    `none`: every worker holds the whole model."""
    head: str = "lm"
    """What the model is loaded as (`KindSpec.head` of the nodes that run it): `lm`, a
    causal LM; `scalar`, a backbone with a scalar head (critic, reward model)."""
    base_of: str | None = None
    """A frozen model that is the base of this pool's LoRA model `base_of` (same weights):
    it loads nothing and runs as that model with its adapters off."""

    def __post_init__(self) -> None:
        problems = [f"sharding must be one of {SHARDINGS}"] if self.sharding not in SHARDINGS \
            else []
        problems += [f"head must be one of {LOADED_HEADS}"] if self.head not in LOADED_HEADS \
            else []
        _require(problems, f"model `{self.name}`")


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """A group of `size` workers hosting `models` together."""

    name: str
    size: int
    device: str
    """`cpu`, `cuda` (each worker its own GPU) or `cuda:0` (target local)."""
    models: tuple[ModelPlacement, ...]
    bundles: tuple[Bundle, ...]
    """One per worker; empty for the driver, which runs in the launching process."""
    strategy: str = "pack"
    """How the bundles spread over Ray's nodes (`PLACEMENT_STRATEGIES`)."""
    label_selector: tuple[Label, ...] = ()
    """The node labels every worker's node must match (Ray's `bundle_label_selector`)."""

    def __post_init__(self) -> None:
        problems = []
        if self.strategy not in PLACEMENT_STRATEGIES:
            problems.append(f"strategy `{self.strategy}` is not one of {PLACEMENT_STRATEGIES}")
        if self.size < 1:
            problems.append(f"size must be >= 1, got {self.size}")
        if self.bundles and len(self.bundles) != self.size:
            problems.append(f"{len(self.bundles)} bundles for {self.size} workers")
        if not self.bundles and self.models:
            problems.append("a pool without bundles (the driver) cannot host models")
        if self.device.split(":")[0] not in DEVICES:
            problems.append(f"device `{self.device}` is not one of {DEVICES}")
        _require(problems, f"pool `{self.name}`")

    def shards(self, model: str) -> int:
        """How many ways the model's weights, grads and optimizer state are split."""
        mp = next(m for m in self.models if m.name == model)
        return self.size if mp.sharding == "full_shard" else 1


@dataclass(frozen=True, slots=True)
class StagePlan:
    """Nodes that run after every earlier stage; `once`: the prologue."""

    name: str
    nodes: tuple[str, ...]
    once: bool = False
    """Runs once before the loop over the whole dataset, nodes in the listed order;
    otherwise the nodes are independent and run at every step."""


@dataclass(frozen=True, slots=True)
class EdgePlan:
    """How the tensor on one edge moves from producer to consumer."""

    src: str
    """`node.port` of the producer."""
    dst: str
    """`node.port` of the consumer."""
    dispatch: str
    group_aligned: bool = False
    """Slices hold whole groups (the N samples of one prompt stay on one worker)."""
    batched: bool = True
    """The tensor has a batch axis (its first axis counts rows of the step's batch)."""

    def __post_init__(self) -> None:
        bad = self.dispatch not in DISPATCHES
        _require([f"dispatch must be one of {DISPATCHES}"] if bad else [],
                 f"edge `{self.src} -> {self.dst}`")


@dataclass(frozen=True, slots=True)
class MemoryItem:
    """One contribution to a device's memory."""

    what: str
    """One of `MEMORY_ITEMS`."""
    owner: str
    """The model (weights, grads, optimizer) or node (the rest) it belongs to."""
    bytes: int
    transient: bool
    """Alive only while its node runs; nodes of a pool run one at a time, so only the
    largest node's transient memory counts towards the peak."""

    def __post_init__(self) -> None:
        problems = [] if self.what in MEMORY_ITEMS else [f"`{self.what}` not in {MEMORY_ITEMS}"]
        problems += ["bytes must be >= 0"] if self.bytes < 0 else []
        _require(problems, f"memory item of `{self.owner}`")


def peak_of(items: Iterable[MemoryItem]) -> tuple[int, str | None]:
    """(bytes, node): persistent memory plus the largest node's transient memory."""
    items = tuple(items)
    per_node: dict[str, int] = {}
    for i in items:
        if i.transient:
            per_node[i.owner] = per_node.get(i.owner, 0) + i.bytes
    persistent = sum(i.bytes for i in items if not i.transient)
    node = max(per_node, key=lambda n: per_node[n], default=None)
    return persistent + (per_node[node] if node else 0), node


@dataclass(frozen=True, slots=True)
class PoolMemory:
    """Estimated memory of each device of one pool."""

    pool: str
    items: tuple[MemoryItem, ...]
    total_bytes: int
    """Persistent items plus the transient items of `peak_node`."""
    peak_node: str | None
    missing: tuple[str, ...] = ()
    """Models and nodes left out for want of a config or bound dims: a lower bound then."""

    def __post_init__(self) -> None:
        total, node = peak_of(self.items)
        problems = [] if total == self.total_bytes else [f"total {self.total_bytes} != {total}"]
        problems += [] if node == self.peak_node else [f"peak node {self.peak_node} != {node}"]
        _require(problems, f"memory of pool `{self.pool}`")

    @staticmethod
    def of(pool: str, items: Iterable[MemoryItem], missing: tuple[str, ...] = ()) -> PoolMemory:
        items = tuple(items)
        total, node = peak_of(items)
        return PoolMemory(pool, items, total, node, missing)


@dataclass(frozen=True, slots=True)
class ResamplePlan:
    """The refill loop of a filter node: each try draws the next batch of every data
    source and runs `repeat`; the filter's kept rows are joined over tries until
    `groups` groups are kept, then cut to exactly `groups * group_size` rows."""

    filter: str
    """The filter node, last of `repeat`."""
    repeat: tuple[str, ...]
    """Data sources, then the step nodes the filter depends on and the filter, in the
    order they run; every other step node runs once per step, after the loop."""
    groups: int
    """Groups the filtered batch holds (the filter's `groups`, else Bp)."""
    group_size: int
    """Samples per group (N): the filtered batch has `groups * group_size` rows."""
    max_tries: int
    """Tries (generation batches) per step at most; short of `groups` then, the run stops."""

    def __post_init__(self) -> None:
        bad = [f"{k} must be >= 1, got {v}" for k, v in (("groups", self.groups),
               ("group_size", self.group_size), ("max_tries", self.max_tries)) if v < 1]
        bad += [] if self.repeat[-1:] == (self.filter,) else [
            f"repeat must end with the filter `{self.filter}`"]
        _require(bad, f"resample loop of `{self.filter}`")

    @property
    def rows(self) -> int:
        return self.groups * self.group_size


@dataclass(frozen=True, slots=True)
class AsyncPlan:
    """Asynchronous rollouts (`trainer.max_staleness` S > 0): the step nodes are cut at
    the rollout into a producer and a consumer joined by a buffer of rollouts, each
    stamped with the policy version (updates applied) that generated it. The producer
    runs up to S steps ahead of the consumer; the compiler decides how, once, from
    `trainer.max_staleness`, `trainer.admission` and `trainer.old_log_prob`."""

    producer: tuple[str, ...]
    """Data sources and the step nodes of the producer, in the order they run
    (`producer_side`); every other step node is the consumer's."""
    staleness: int = 1
    """S: how many steps ahead of the consumer the producer may run (>= 1)."""
    admission: str = "block"
    """`block`: the rollout of step j comes from version max(j − S, v0) exactly; `drop`:
    the newest weights, a rollout more than S versions old is dropped."""
    old_log_prob: str = "recompute"
    """Where the update's old log-probs come from: `recompute` (the trained model's
    forward) or `rollout` (the sampling policy's own, rewired by the compiler)."""
    own_process: bool = False
    """The producer runs in a process of its own, overlapping the consumer's update
    (`producer_process`: target local); False: in the loop, before the consumer (fsdp),
    or on `pool`."""
    pool: PoolPlan | None = None
    """The rollout pool (`rollout_pool`: target ray): a worker of its own, hosting its own
    copy of the models the producer runs, that produces the rollouts while the trainer's
    pools train; None: `own_process`, or in the loop."""
    partial: bool = False
    """Partial rollouts (`trainer.partial_rollouts`): the producer takes the newest
    published weights between an episode's turns, so episodes that outlast an update
    continue on the new weights; the producer waits for a version no older than
    admission allows (`block`), not for that very version."""
    versions: tuple[str, ...] = ()
    """The producer's rollout nodes that record each sampled token's policy version (a
    `policy_version` output): staleness is counted from their oldest trained token."""


ROLLOUT_POOL = "rollouts"
"""The name of an asynchronous plan's rollout pool (target ray)."""


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


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Everything an executor needs to run a graph on one target."""

    graph: Graph
    """The graph after the passes (dead nodes dropped, `hoisted` set)."""
    target: str
    nproc: int
    """Data-parallel size: fsdp ranks, or workers per inferred ray pool."""
    device: str
    dims: tuple[DimValue, ...]
    nodes: tuple[NodePlan, ...]
    """Data sources and nodes, in file order."""
    pools: tuple[PoolPlan, ...]
    stages: tuple[StagePlan, ...]
    edges: tuple[EdgePlan, ...]
    memory: tuple[PoolMemory, ...] = ()
    """Per pool with models; empty when pass `memory` was disabled."""
    dropped: tuple[str, ...] = ()
    """Nodes and data sources removed by dead-node elimination."""
    rewrites: tuple[str, ...] = ()
    """What the optimising passes changed in the graph, one line each; the changes
    themselves are in `graph` (an input unwired, a node dropped)."""
    plugin_paths: tuple[str, ...] = ()
    """Absolute folders holding the graph's plugins (the graph file's folder when a
    plugin lies there): every process that runs the plan imports them from there."""
    source: str = "<python>"
    """The graph file."""
    version: int = PLAN_VERSION
    resample: ResamplePlan | None = None
    """The step's refill loop when the graph has a filter node; None: one pass."""
    asynchronous: AsyncPlan | None = None
    """The producer / consumer cut of asynchronous rollouts; None: synchronous."""
    objects: tuple[PyObject, ...] = ()
    """The Python functions and classes its params and kinds name (`flowgraph.objects`):
    in JSON their references; in a process that holds them, the objects themselves."""

    def __post_init__(self) -> None:
        _require(_plan_problems(self), "execution plan")

    # Python objects: what the executors call with `live_params` and `implementation`;
    # shipped to the run's processes with `pickled_objects` / `with_pickled`.
    def live_params(self, name: str, *, evaluation: bool = False) -> dict[str, Any]:
        """Node `name`'s params as its implementation takes them: each `{"$python": ref}`
        replaced by the object itself."""
        table = {o.ref: o for o in self.objects}
        return {k: _live(v, table, f"node `{name}` param `{k}`")
                for k, v in self.node(name).param_values(evaluation=evaluation).items()}

    def implementation(self, name: str) -> Any:
        """The function node `name` runs when the plan carries it (a kind declared in the
        compiling session), else None: the executor imports `NodePlan.impl`."""
        impl = self.node(name).impl
        held = next((o for o in self.objects if o.ref == impl), None)
        if held is None:
            return None
        if held.obj is None:
            raise PlanError(unresolved_message([(held, f"node `{name}`")]))
        return held.obj

    def unresolved(self) -> str | None:
        """What this process could not rebuild of the plan's objects, and what to do;
        None: it has them all."""
        users = _object_users(self)
        missing = [(o, " and ".join(users.get(o.ref, ["the plan"]))) for o in self.objects
                   if o.obj is None]
        return unresolved_message(missing) if missing else None

    def pickled_objects(self) -> bytes | None:
        """Its objects for the run's own processes (None: it holds none)."""
        if not self.objects:
            return None
        missing = self.unresolved()
        if missing:
            raise PlanError(missing)
        return pickled({o.ref: o.obj for o in self.objects})

    def with_pickled(self, data: bytes | None) -> ExecutionPlan:
        """This plan holding the objects `pickled_objects` wrote (on the run's channel)."""
        if data is None:
            return self
        for plugin in self.plugins:  # an object of a plugin file is unpickled by its name
            plugin_module(plugin.module, self.plugin_paths)
        held = unpickled(data)
        return replace(self, objects=tuple(o.with_object(held[o.ref]) if o.ref in held else o
                                           for o in self.objects))

    def node(self, name: str) -> NodePlan:
        return next(n for n in self.nodes if n.name == name)

    # The run's settings: the graph file's sections, held once, in the plan's graph
    # record. Executors read them here and the nodes' wiring and params from `nodes`;
    # `graph` itself is the compiler's and the verifier's.
    @property
    def name(self) -> str:
        return self.graph.name

    @property
    def trainer(self) -> TrainerSpec:
        return self.graph.trainer

    @property
    def resources(self) -> ResourceSpec:
        return self.graph.resources

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        return self.graph.models

    @property
    def data(self) -> tuple[DataSpec, ...]:
        return self.graph.data

    @property
    def plugins(self) -> tuple[Plugin, ...]:
        return self.graph.plugins

    def document(self) -> dict[str, object]:
        """The graph file as a document (what experiment trackers record as config)."""
        return graph_to_document(self.graph)

    def with_models(self, models: tuple[ModelSpec, ...]) -> ExecutionPlan:
        """This plan loading `models` (the same names) instead: a model path resolved when
        the run starts (a run dir's model, `flowgraph.compilers.export.from_run_dirs`)."""
        return replace(self, graph=replace(self.graph, models=models))

    def readers(self, node: str, port: str) -> tuple[str, ...]:
        """The nodes that read output `node.port` (`flowgraph.ir.readers`)."""
        return readers([(i.ref, n.name, i.port) for n in self.nodes for i in n.inputs],
                       node, port)

    def model(self, name: str) -> ModelSpec:
        """The `models:` entry `name` (the verifier holds every placement to one)."""
        spec = self.graph.model(name)
        if spec is None:
            raise PlanError(f"the plan has no model `{name}`")
        return spec

    def pool(self, name: str) -> PoolPlan:
        return next(p for p in self.pools if p.name == name)

    def edge(self, src: str, dst: str) -> EdgePlan:
        return next(e for e in self.edges if e.src == src and e.dst == dst)

    def to_json(self) -> str:
        return json.dumps(_encode(self), indent=2) + "\n"

    @staticmethod
    def from_json(text: str) -> ExecutionPlan:
        """The plan a file's text holds; what cannot be read as one is `PlanFileError`, and
        a plan that breaks its invariants `PlanError`."""
        if len(text) > MAX_PLAN_BYTES:
            raise PlanFileError(f"the plan is larger than {MAX_PLAN_BYTES >> 20} MiB")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"the plan is not valid JSON: {exc}") from exc
        except RecursionError as exc:  # the parser's own recursion, long before the limit
            raise PlanFileError(f"the plan is nested more than {MAX_PLAN_DEPTH} levels "
                                "deep") from exc
        if _depth(data) > MAX_PLAN_DEPTH:
            raise PlanFileError(f"the plan is nested more than {MAX_PLAN_DEPTH} levels deep")
        source = data.get("source") if isinstance(data, dict) else None
        version = data.get("version") if isinstance(data, dict) else None
        if version != PLAN_VERSION:
            raise PlanFileError(f"the plan is format version {version}; this flowgraph reads "
                                f"version {PLAN_VERSION}: compile the graph again "
                                "(`flowgraph compile GRAPH -o plan.json`)")
        edges = data.get("edges")
        if isinstance(edges, list):  # before decoding them: thousands of copies decode slowly
            _require(_repeated_edges([(e.get("src"), e.get("dst")) for e in edges
                                      if isinstance(e, dict)]), "execution plan")
        plan = _decode(ExecutionPlan, data, "plan", source if isinstance(source, str) else "<plan>")
        assert isinstance(plan, ExecutionPlan)
        return plan

    def summary(self) -> str:
        return "\n".join(_summary_lines(self))


def write_run_plan(plan: ExecutionPlan, path: Path) -> None:
    """The plan for the run's own processes (fsdp ranks): its JSON at `path` and, when it
    holds Python objects, those pickled beside it (`<path>.objects`), where only this run
    writes; `read_run_plan` reads both."""
    path.write_text(plan.to_json())
    held = plan.pickled_objects()
    objects = path.with_name(path.name + ".objects")
    if held is None:
        objects.unlink(missing_ok=True)
    else:
        objects.write_bytes(held)


def read_run_plan(path: Path) -> ExecutionPlan:
    """What `write_run_plan` wrote at `path`, its Python objects in place."""
    objects = path.with_name(path.name + ".objects")
    plan = ExecutionPlan.from_json(path.read_text())
    return plan.with_pickled(objects.read_bytes() if objects.is_file() else None)


# --- validation ------------------------------------------------------------------------


def _plan_problems(plan: ExecutionPlan) -> list[str]:
    problems = []
    if plan.version != PLAN_VERSION:
        problems.append(f"format version {plan.version}, this flowgraph reads {PLAN_VERSION}")
    if plan.target not in TARGETS:
        problems.append(f"target `{plan.target}` is not one of {TARGETS}")
    if plan.device not in DEVICES:
        problems.append(f"device `{plan.device}` is not one of {DEVICES}")
    if plan.nproc < 1:
        problems.append(f"nproc must be >= 1, got {plan.nproc}")
    problems += _graph_problems(plan) + _reference_problems(plan) + _stage_problems(plan)
    if problems:  # the checks below read the references these ones vouch for
        return problems
    return (_placement_problems(plan) + _order_problems(plan) + _edge_problems(plan)
            + _resample_problems(plan) + _async_problems(plan) + _fusion_problems(plan)
            + _category_problems(plan) + _param_problems(plan) + _object_problems(plan))


def _object_problems(plan: ExecutionPlan) -> list[str]:
    """Every Python object a param or an implementation names is in the plan's table,
    once; a session's implementation is named nowhere else."""
    listed = [o.ref for o in plan.objects]
    problems = [f"Python object `{r}` is listed twice" for r in _twice(listed)]
    users = _object_users(plan)
    problems += [f"{' and '.join(who)} name(s) the Python object `{ref}`, which the plan's "
                 "`objects` do not list" for ref, who in users.items() if ref not in listed]
    problems += [f"Python object `{r}` is listed but nothing names it" for r in listed
                 if r not in users]
    return problems


def _object_users(plan: ExecutionPlan) -> dict[str, list[str]]:
    """Each object reference -> who names it (`node `r` param `fn``)."""
    users: dict[str, list[str]] = {}
    for n in plan.nodes:
        if by_value(n.impl):
            users.setdefault(n.impl, []).append(f"node `{n.name}` (kind `{n.kind}`)")
        for p in (*n.params, *n.eval_params):
            for ref in _refs_in(json.loads(p.value)):
                who = f"node `{n.name}` param `{p.name}`"
                if who not in users.setdefault(ref, []):
                    users[ref].append(who)
    return users


def _refs_in(value: object) -> list[str]:
    ref = tagged(value)
    if ref is not None:
        return [ref]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) \
        else ()
    return [r for v in items for r in _refs_in(v)]


def _live(value: object, table: Mapping[str, PyObject], owner: str) -> object:
    """A JSON param value with each tagged reference replaced by its object."""
    ref = tagged(value)
    if ref is not None:
        held = table.get(ref)
        if held is None or held.obj is None:
            raise PlanError(unresolved_message([(held or PyObject(ref), owner)]))
        return held.obj
    if isinstance(value, dict):
        return {k: _live(v, table, owner) for k, v in value.items()}
    if isinstance(value, list):
        return [_live(v, table, owner) for v in value]
    return value


def plan_objects(graph: Graph, functions: Mapping[str, Any]) -> tuple[PyObject, ...]:
    """The table of a plan: the objects the graph's params hold, and the session kinds'
    implementations (`functions`: impl path -> function), in that order. Two different
    objects with one reference (two lambdas, a function defined again under its old name
    in another scope) are an error: a worker could not tell them apart."""
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


def producer_side(graph: Graph, stages: tuple[StagePlan, ...],
                  kinds: Mapping[str, KindSpec]) -> tuple[str, ...]:
    """The producer of asynchronous rollouts, in the order the step runs: the data
    sources, the rollouts (kind category `rollout`), and every other step node that
    reads only the producer's outputs, trains nothing and runs no trained model's
    weights (a reward function, a frozen reference, GRPO's advantage); a node that
    reads a trained model's output, or the prologue's, is the consumer's. The rule the
    compiler, the memory estimate and the verifier share."""
    trained = {m.name for m in graph.models if m.trainable}

    def held(node: NodeSpec) -> bool:
        kind = kinds[node.name]
        runs_trained = (node.model in trained and kind.model != "none"
                        and kind.head != "tokenizer")
        return kind.trains or (runs_trained and kind.category != "rollout")

    side = {d.name for d in graph.data}
    order = [n for s in stages if not s.once for n in s.nodes]
    for name in order:
        node = graph.node(name)
        if node is not None and name not in side and not held(node) \
                and all(ref.node in side for _, ref in node.inputs):
            side.add(name)
    return tuple(n for n in order if n in side)


def _async_problems(plan: ExecutionPlan) -> list[str]:
    """An asynchronous plan's producer holds the data, nodes that read only the
    producer and train nothing, and the whole resample loop; the rest of the rule
    (which nodes are rollouts) is checked with the kinds (`verify_kinds`)."""
    cut = plan.asynchronous
    if cut is None:
        return []
    problems = []
    if cut.staleness < 1:
        problems.append(f"the asynchronous plan's staleness is {cut.staleness}, not >= 1")
    if cut.admission not in ADMISSIONS:
        problems.append(f"admission `{cut.admission}` is not one of {ADMISSIONS}")
    if cut.partial and not cut.versions:
        problems.append("the asynchronous plan has partial rollouts but no rollout node that "
                        "records its tokens' policy versions (`versions`)")
    nodes = {n.name: n for n in plan.nodes}
    side = set(cut.producer)
    for name in cut.producer:
        node = plan.graph.node(name)
        if name not in nodes or (node is None and plan.graph.data_source(name) is None):
            problems.append(f"the asynchronous producer names `{name}`, not a node of the plan")
            continue
        if nodes[name].trains:
            problems.append(f"the asynchronous producer runs `{name}`, an update")
        problems += [f"the asynchronous producer runs `{name}`, which reads `{ref}` of the "
                     "consumer" for _, ref in (node.inputs if node else ())
                     if ref.node not in side]
    if plan.resample is not None:
        problems += [f"the resample loop repeats `{n}`, which the asynchronous producer does "
                     "not run" for n in plan.resample.repeat if n not in side]
    return problems + _rollout_pool_problems(plan, cut)


def _rollout_pool_problems(plan: ExecutionPlan, cut: AsyncPlan) -> list[str]:
    """A rollout pool: on ray only, not with a producer process, one worker named apart
    from the trainer's pools, hosting every model the producer's nodes run."""
    pool = cut.pool
    if pool is None:
        return []
    where = f"the rollout pool `{pool.name}`"
    problems = []
    if plan.target != "ray":
        problems.append(f"{where} is for target ray, not {plan.target}")
    if cut.own_process:
        problems.append(f"{where} and a producer process (own_process) both run the producer")
    if pool.size != 1 or not pool.bundles:
        problems.append(f"{where} must have one worker with its bundle (the producer runs "
                        "whole in it)")
    if pool.name in {p.name for p in plan.pools}:
        problems.append(f"{where} has the name of a trainer pool")
    hosted = {m.name for m in pool.models}
    problems += [f"{where} does not host model `{n.model}`, which the producer's node "
                 f"`{n.name}` runs" for n in plan.nodes
                 if n.name in cut.producer and n.loads_model and n.model not in hosted]
    return problems


def upstream_of(graph: Graph, name: str) -> set[str]:
    """The producers `name` reads, directly or not (data sources included)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        node = graph.node(todo.pop())
        for _, ref in node.inputs if node is not None else ():
            if ref.node not in seen:
                seen.add(ref.node)
                todo.append(ref.node)
    return seen


def repeated(graph: Graph, stages: tuple[StagePlan, ...], filter_node: str) -> tuple[str, ...]:
    """What each try of `filter_node`'s loop runs, in stage order: every data source
    (each try draws the next batch of all of them), the step nodes the filter reads
    directly or not, then the filter."""
    before = upstream_of(graph, filter_node) | {d.name for d in graph.data}
    steps = [n for s in stages if not s.once for n in s.nodes if n in before]
    return (*steps, filter_node)


def _resample_problems(plan: ExecutionPlan) -> list[str]:
    """The loop repeats exactly the data and the step nodes before its filter, and no
    node after it reads a tensor of a single try (anything but the filter's outputs)."""
    loop = plan.resample
    if loop is None:
        return []
    if plan.graph.node(loop.filter) is None:
        return [f"the resample loop names `{loop.filter}`, not a node of the plan's graph"]
    once = {n for s in plan.stages if s.once for n in s.nodes}
    want = repeated(plan.graph, plan.stages, loop.filter)
    problems = [] if loop.repeat == want else [
        f"the resample loop of `{loop.filter}` repeats {list(loop.repeat)}; the data "
        f"sources and the step nodes before the filter are {list(want)}"]
    for node in plan.graph.nodes:
        if node.name in want or node.name in once:
            continue
        problems += [f"node `{node.name}` runs after the filter `{loop.filter}` but reads "
                     f"`{ref}`, a tensor of one try" for _, ref in node.inputs
                     if (ref.node in want or ref.node in once) and ref.node != loop.filter]
    return problems


def dispatch_of(src_dp: bool, dst_dp: bool, dst_trains: bool, batched: bool) -> str:
    """How a consumer gets a tensor: the rule of the module docstring, from whether
    producer and consumer run data-parallel, the consumer is an update, and the tensor
    has a batch axis."""
    if not dst_dp:
        return "gather" if src_dp else "local"
    if not batched or dst_trains:
        return "gather" if src_dp and batched else "broadcast"
    return "reshard" if src_dp else "split"


def _placement_problems(plan: ExecutionPlan) -> list[str]:
    problems = [_base_problem(plan, p, m) for p in plan.pools for m in p.models
                if m.base_of is not None]
    problems = [p for p in problems if p]
    for n in plan.nodes:
        if not n.loads_model:
            continue
        pool = plan.pool(n.pool)
        if n.model is None or n.model not in {m.name for m in pool.models}:
            hosts = [p.name for p in plan.pools if n.model in {m.name for m in p.models}]
            problems.append(f"node `{n.name}` runs model `{n.model}` on pool `{n.pool}`, which "
                            f"does not host it (hosted by: {', '.join(hosts) or 'no pool'})")
    return problems


def _base_problem(plan: ExecutionPlan, pool: PoolPlan, placed: ModelPlacement) -> str:
    """Why `placed` cannot run as the base of `placed.base_of` ("" when it can)."""
    spec, adapted = plan.graph.model(placed.name), plan.graph.model(placed.base_of or "")
    where = f"model `{placed.name}` on pool `{pool.name}` is placed as the base of " \
            f"`{placed.base_of}`"
    if adapted is None or spec is None:
        return f"{where}, which is not a model of the graph"
    if placed.base_of not in {m.name for m in pool.models}:
        return f"{where}, which the pool does not host"
    if adapted.lora is None:
        return f"{where}, which has no lora adapters"
    if spec.trainable or spec.lora is not None:
        return f"{where} but is trained itself"
    if (spec.path, spec.dtype) != (adapted.path, adapted.dtype) or placed.head != "lm":
        return (f"{where} but its weights are not that model's base (path {spec.path} "
                f"{spec.dtype} vs {adapted.path} {adapted.dtype})")
    return ""


def _order_problems(plan: ExecutionPlan) -> list[str]:
    """Every input is ready when its node runs: a prologue node reads data sources and
    earlier prologue nodes; a step node, those and nodes of earlier step stages."""
    data = {d.name for d in plan.graph.data}
    rank: dict[str, tuple[int, int]] = {}  # node -> (stage index, position in a prologue)
    for i, stage in enumerate(plan.stages):
        for j, name in enumerate(stage.nodes):
            rank[name] = (i, j if stage.once else 0)
    once = {n for s in plan.stages if s.once for n in s.nodes}
    problems = [f"node `{n.name}` is marked hoisted but its stage `{n.stage}` is not the "
                "prologue" if n.hoisted else f"node `{n.name}` is in the prologue but not "
                "marked hoisted" for n in plan.nodes if n.hoisted != (n.name in once)]
    problems += [f"data source `{d}` is in the prologue; data is drawn at every step"
                 for d in data & once]
    for node in plan.graph.nodes:
        for _, ref in node.inputs:
            src = ref.node
            if src in data:
                continue
            if node.name in once:
                ready = src in once and rank[src] < rank[node.name]
            else:
                ready = src in once or rank[src] < rank[node.name]
            if not ready:
                problems.append(f"node `{node.name}` (stage `{plan.node(node.name).stage}`) "
                                f"reads `{ref}`, which stage `{plan.node(src).stage}` only "
                                "computes at the same time or later")
    return problems


def _fusion_problems(plan: ExecutionPlan) -> list[str]:
    """A fused node runs later in its leader's stage, on its model, with its kind and
    params, each input from the producer the leader's comes from; in one group only."""
    problems, seen = [], set()
    for lead in plan.nodes:
        if not lead.fused:
            continue
        stage = next(s.nodes for s in plan.stages if s.name == lead.stage)
        spec = plan.graph.node(lead.name)
        assert spec is not None
        producers = {p: r.node for p, r in spec.inputs}
        for name in lead.fused:
            node, other = plan.node(name), plan.graph.node(name)
            if node is None or other is None:
                problems.append(f"node `{lead.name}` fuses `{name}`, which is not in the plan")
                continue
            if name in seen or node.fused or name == lead.name:
                problems.append(f"node `{name}` is fused twice, or fuses nodes itself")
            seen.add(name)
            if ((node.kind, node.model, node.stage) != (lead.kind, lead.model, lead.stage)
                    or other.params.to_python() != spec.params.to_python()
                    or {p: r.node for p, r in other.inputs} != producers
                    or stage.index(name) < stage.index(lead.name)):
                problems.append(f"node `{lead.name}` fuses `{name}`, which is not a later node "
                                f"of its stage with its kind, model, params and producers")
    return problems


def _edge_problems(plan: ExecutionPlan) -> list[str]:
    wired = {(str(ref), f"{node.name}.{port}") for ref, node, port in plan.graph.edges()}
    planned = {(e.src, e.dst) for e in plan.edges}
    repeated = _repeated_edges([(e.src, e.dst) for e in plan.edges])
    if repeated:
        return repeated
    problems = [f"edge `{a} -> {b}` has no dispatch in the plan"
                for a, b in sorted(wired - planned)]
    problems += [f"edge `{a} -> {b}` is not in the plan's graph"
                 for a, b in sorted(planned - wired)]
    for e in plan.edges:
        if (e.src, e.dst) not in wired:
            continue
        src, dst = plan.node(e.src.split(".")[0]), plan.node(e.dst.split(".")[0])
        out = next((o for o in src.outputs if f"{src.name}.{o.port}" == e.src), None)
        if out is not None and out.batched != e.batched:
            flags = json.dumps(e.batched), json.dumps(out.batched)
            problems.append(f"edge `{e.src} -> {e.dst}` is flagged batched: {flags[0]}, but "
                            f"output `{e.src}` is declared with batched: {flags[1]}; the two "
                            "must agree (edit both alike)")
        want = dispatch_of(src.data_parallel, dst.data_parallel, dst.trains, e.batched)
        if e.dispatch in ("split", "reshard") and not e.batched:
            problems.append(f"edge `{e.src} -> {e.dst}` is dispatched `{e.dispatch}` but its "
                            f"tensor has no batch axis to split; it is `{want}`")
        elif e.dispatch != want:
            problems.append(f"edge `{e.src} -> {e.dst}` is dispatched `{e.dispatch}`; from "
                            f"`{src.name}` ({_runs(src)}) to `{dst.name}` ({_runs(dst)}) it "
                            f"is `{want}`")
        if e.group_aligned and e.dispatch not in ("split", "reshard"):
            problems.append(f"edge `{e.src} -> {e.dst}` is group-aligned but not split")
    return problems


def _repeated_edges(pairs: list[tuple[object, object]]) -> list[str]:
    """One message for every edge listed more than once (a file may repeat thousands)."""
    seen = Counter(pairs)
    twice = [f"`{a} -> {b}` ({n} times)" for (a, b), n in seen.items() if n > 1]
    if not twice:
        return []
    return [f"{len(twice)} edge(s) are listed more than once, each must be listed once: "
            f"{', '.join(twice[:3])}{', ...' if len(twice) > 3 else ''}"]


def _runs(n: NodePlan) -> str:
    how = ("data-parallel update" if n.trains else "data-parallel") if n.data_parallel \
        else "whole batch"
    return f"{how} on pool `{n.pool}`"


def verify_kinds(plan: ExecutionPlan, kinds: Mapping[str, KindSpec]) -> None:
    """A plan read from a file against the registry's kinds (plugins imported): each node's
    implementation and kind facts are its kind's, its fusion is of a kind whose rows can
    be stacked, and the asynchronous producer is the rule's. Raises `PlanError`. The
    executors never call it: they run the plan as it is (`flowgraph.api.load_plan` does)."""
    problems = []
    for n in plan.nodes:
        kind = kinds[n.name]
        spec = plan.graph.model(n.model) if n.model else None
        loads = kind.model != "none" and kind.head != "tokenizer" and spec is not None
        said = (n.impl, n.trains, n.loads_model, n.category, n.head)
        want = (kind.impl, kind.trains, loads, kind.category, kind.head)
        if said != want:
            problems.append(f"node `{n.name}`: (impl, trains, loads_model, category, "
                            f"head) {said}, but kind `{kind.name}` says {want}")
        if n.fused and not kind.row_wise_forward:
            problems.append(f"node `{n.name}` (kind `{kind.name}`) fuses "
                            f"{', '.join(f'`{f}`' for f in n.fused)}, but its kind does not run "
                            "its model row by row: its rows cannot be stacked with theirs")
    if plan.asynchronous is not None:
        rollouts = {n.name for n in plan.nodes if kinds[n.name].category == "rollout"}
        want_side = producer_side(plan.graph, plan.stages, kinds)
        if plan.asynchronous.producer != want_side:
            problems.append(f"the asynchronous producer is {list(plan.asynchronous.producer)}; "
                            f"the data, rollouts and the nodes that read only them are "
                            f"{list(want_side)}")
        if not rollouts & set(want_side):
            problems.append("the plan is asynchronous, but no rollout reads only the data")
    _require(problems, "execution plan")


def _param_problems(plan: ExecutionPlan) -> list[str]:
    """A param the graph section sets has the value the node's plan runs with (a plan
    file edited in one place and not the other would run what the reader did not see)."""
    problems = []
    resolved = {n.name: {p.name: json.loads(p.value) for p in n.params} for n in plan.nodes}
    for node in plan.graph.nodes:
        for key, value in node.params.to_python().items():
            runs = resolved.get(node.name, {}).get(key, value)
            if json.dumps(runs, sort_keys=True) != json.dumps(value, sort_keys=True):
                problems.append(
                    f"node `{node.name}`: param `{key}` is {json.dumps(value)} in the graph "
                    f"section but {json.dumps(runs)} in the node's plan, which is what runs: "
                    "edit both alike (or compile the graph again)")
    return problems


def _category_problems(plan: ExecutionPlan) -> list[str]:
    """What a node's category allows: a filter node, and only one, drives the resample
    loop; a prologue node is the same at every step."""
    problems = []
    for n in plan.nodes:
        spec = plan.graph.model(n.model) if n.model else None
        if (n.category == "filter") != (plan.resample is not None
                                         and plan.resample.filter == n.name):
            problems.append(f"node `{n.name}` (kind `{n.kind}`, category `{n.category}`) and "
                            f"the plan's resample loop "
                            f"({plan.resample.filter if plan.resample else 'none'}) disagree: "
                            "a filter node, and only one, drives the loop")
        if n.hoisted and (n.category not in HOISTABLE_CATEGORIES or n.trains
                          or (spec is not None and spec.trainable)):
            problems.append(f"node `{n.name}` (kind `{n.kind}`) is in the prologue, but it "
                            "is not the same at every step (it samples, trains, reads a "
                            "trained model or batch statistics): move it to a step stage")
    return problems


def _graph_problems(plan: ExecutionPlan) -> list[str]:
    """The node records describe exactly the producers of the plan's graph."""
    kinds = {d.name: d.kind for d in plan.graph.data} | {n.name: n.kind for n in plan.graph.nodes}
    problems = [f"node `{n.name}` is kind `{n.kind}` in the plan, `{kinds[n.name]}` in its graph"
                for n in plan.nodes if n.name in kinds and kinds[n.name] != n.kind]
    planned = {n.name for n in plan.nodes}
    problems += [f"node `{n}` is not in the plan's graph" for n in planned - kinds.keys()]
    problems += [f"the graph's `{n}` has no node record" for n in kinds.keys() - planned]
    sources = {d.name for d in plan.graph.data}
    problems += [f"`{n.name}` is {'a' if n.name in sources else 'no'} data source of the "
                 f"graph but its plan's category is `{n.category}`" for n in plan.nodes
                 if n.category and (n.category == "data") != (n.name in sources)]
    for n in plan.nodes:
        spec = plan.graph.node(n.name)
        if spec is None:
            continue
        wired = tuple((port, (ref.node, ref.port)) for port, ref in spec.inputs)
        if n.wiring() != wired:
            problems.append(f"node `{n.name}` reads {_wires(n.wiring())} in the plan, "
                            f"{_wires(wired)} in its graph")
        if n.model != spec.model and n.model is not None:
            problems.append(f"node `{n.name}` runs model `{n.model}` in the plan, "
                            f"`{spec.model}` in its graph")
    return problems


def _wires(wiring: Iterable[tuple[str, tuple[str, str]]]) -> str:
    return "{" + ", ".join(f"{port}: {node}.{out}" for port, (node, out) in wiring) + "}"


def _twice(names: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    twice: set[str] = set()
    for n in names:
        if n in seen:
            twice.add(n)
        seen.add(n)
    return sorted(twice)


def _reference_problems(plan: ExecutionPlan) -> list[str]:
    nodes = {n.name for n in plan.nodes}
    pools = {p.name for p in plan.pools}
    problems = [f"node `{n}` is listed twice" for n in _twice(n.name for n in plan.nodes)]
    problems += [f"pool `{p}` is listed twice" for p in _twice(p.name for p in plan.pools)]
    problems += [f"node `{n.name}` runs on unknown pool `{n.pool}`" for n in plan.nodes
                 if n.pool not in pools]
    problems += [f"edge `{e.src} -> {e.dst}` names an unknown node" for e in plan.edges
                 if not {e.src.split(".")[0], e.dst.split(".")[0]} <= nodes]
    if plan.asynchronous is not None and plan.asynchronous.pool is not None:
        pools.add(plan.asynchronous.pool.name)
    problems += [f"memory of unknown pool `{m.pool}`" for m in plan.memory if m.pool not in pools]
    problems += [f"dropped node `{n}` is still planned" for n in plan.dropped if n in nodes]
    return problems


def _stage_problems(plan: ExecutionPlan) -> list[str]:
    staged = [n for s in plan.stages for n in s.nodes]
    problems = [f"node `{n}` is in two stages" for n in _twice(staged)]
    problems += [f"stage lists unknown node `{n}`" for n in staged
                 if n not in {p.name for p in plan.nodes}]
    stage_of = {n: s.name for s in plan.stages for n in s.nodes}
    problems += [f"node `{n.name}` says stage `{n.stage}`, the stages say "
                 f"`{stage_of.get(n.name)}`" for n in plan.nodes if stage_of.get(n.name) != n.stage]
    return problems


# --- JSON ------------------------------------------------------------------------------


def _encode(value: object) -> object:
    if isinstance(value, Graph):
        return graph_to_document(value)
    if isinstance(value, PyObject):  # the reference, never the object (see `objects`)
        return {"ref": value.ref, "what": value.what, "defined_at": value.where,
                "shipped": value.shipped}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _depth(data: object) -> int:
    """How deeply JSON data nests its lists and objects (counted without recursing)."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(data, 1)]
    while todo:
        value, depth = todo.pop()
        deepest = max(deepest, depth)
        items = value.values() if isinstance(value, dict) else value
        todo += [(v, depth + 1) for v in items if isinstance(v, (dict, list))]
    return deepest if isinstance(data, (dict, list)) else 0


def _decode(tp: Any, data: object, where: str, source: str) -> object:
    """Rebuild a typed value from JSON data, guided by the dataclasses' type hints;
    `source` is the graph file, for the positions of the rebuilt graph."""
    if tp is Graph:
        return _graph(data, where, source)
    if tp is PyObject:
        return _python_object(data, where)
    if is_dataclass(tp):
        return _record(tp, data, where, source)
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple:
        items = _expect(data, list, where)
        return tuple(_decode(args[0], v, f"{where}[{i}]", source) for i, v in enumerate(items))
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        return _decode(next(a for a in args if a is not type(None)), data, where, source)
    return _expect(data, tp, where)


def _expect(data: object, tp: type, where: str) -> Any:
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)  # `1` where a number is meant
    # bool is an int in Python; a plan field typed int must not read `true`.
    if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
        raise PlanError(f"`{where}` must be {tp.__name__}, got {type(data).__name__} {data!r:.40}")
    return data


def _record(cls: Any, data: object, where: str, source: str) -> object:
    obj = _expect(data, dict, where)
    hints = get_type_hints(cls)
    unknown = sorted(set(obj) - {f.name for f in fields(cls)})
    if unknown:
        raise PlanError(f"`{where}` has unknown field(s) {unknown}")
    values = {k: _decode(hints[k], v, f"{where}.{k}", source) for k, v in obj.items()}
    try:
        return cls(**values)
    except TypeError as exc:  # a missing field
        raise PlanError(f"`{where}`: {exc}") from exc


def _python_object(data: object, where: str) -> PyObject:
    """An entry of a plan's `objects`, imported by reference where that works (a plan
    whose objects this process cannot rebuild does not run: `ExecutionPlan.unresolved`)."""
    obj = _expect(data, dict, where)
    ref, what, at = obj.get("ref"), obj.get("what", "function"), obj.get("defined_at", "")
    if not isinstance(ref, str) or not isinstance(what, str) or not isinstance(at, str):
        raise PlanError(f"`{where}` must hold `ref`, `what` and `defined_at` as strings")
    try:
        return rebuilt(ref, what, at)
    except FlowgraphError as exc:
        raise PlanError(f"`{where}`: {exc}") from exc


def _graph(data: object, where: str, source: str) -> Graph:
    pos = SourcePos(source, 0, 0)
    graph, diags = graph_from_document(_ynode(data, pos, where), source)
    errors = [d.one_line() for d in diags if d.is_error]
    if graph is None or errors:
        raise PlanError(f"`{where}` is not a valid graph: " + "; ".join(errors))
    return graph


def _ynode(value: object, pos: SourcePos, where: str) -> YNode:
    """Plain JSON data as the located document tree the YAML front end reads."""
    if isinstance(value, dict):
        return YMap(tuple((YScalar(str(k), pos), _ynode(v, pos, where)) for k, v in value.items()),
                    pos)
    if isinstance(value, list):
        return YSeq(tuple(_ynode(v, pos, where) for v in value), pos)
    if value is None or isinstance(value, (str, int, float, bool)):
        return YScalar(value, pos)
    raise PlanError(f"`{where}` holds {type(value).__name__}, not plain data")


# --- summary ---------------------------------------------------------------------------


def gib(n_bytes: float) -> str:
    """Bytes as GiB, with enough digits to tell tiny models apart."""
    v = n_bytes / GIB
    return f"{v:.2f} GiB" if v >= 1 else f"{v:.3g} GiB"


def _role(plan: ExecutionPlan, m: ModelPlacement) -> str:
    spec = plan.graph.model(m.name)
    if m.base_of is not None:
        return f"frozen: the base of `{m.base_of}`, its adapters off, no weights of its own"
    if spec is not None and spec.lora is not None:
        return f"trainable: LoRA r={spec.lora.r} adapters on a frozen base"
    return "trainable" if m.trainable else "frozen"


def _summary_lines(plan: ExecutionPlan) -> list[str]:
    dims = " ".join(f"{d.name}={d.value}" for d in plan.dims) or "(none bound)"
    lines = [f"plan for `{plan.graph.name}` ({plan.source}): target {plan.target}, "
             f"nproc {plan.nproc}, device {plan.device}",
             f"dims: {dims}", "", "pools:"]
    rollout = plan.asynchronous.pool if plan.asynchronous is not None else None
    width = max(len(p.name) for p in (*plan.pools, *([rollout] if rollout else [])))
    for p in plan.pools:
        lines.append(f"  {p.name:<{width}}  {_workers(p, plan.target)}")
        lines += [f"  {'':<{width}}    model {m.name} ({_role(plan, m)}, {_sharding(m, p)})"
                  for m in p.models]
        lines.append(f"  {'':<{width}}    nodes: "
                     + ", ".join(n.name for n in plan.nodes if n.pool == p.name))
    if rollout is not None and plan.asynchronous is not None:
        lines.append(f"  {rollout.name:<{width}}  {_workers(rollout, plan.target)}, beside "
                     "the trainer's pools")
        for m in rollout.models:
            what = "a copy, the trained weights sent after every update" if m.trainable \
                else "a copy"
            lines.append(f"  {'':<{width}}    model {m.name} ({what})")
        lines.append(f"  {'':<{width}}    runs the asynchronous producer: "
                     + ", ".join(plan.asynchronous.producer))
    lines += ["", "stages:"]
    once = "  (once per row, before the loop)"
    lines += [f"  {s.name:<10} {', '.join(s.nodes)}{once if s.once else ''}"
              for s in plan.stages]
    lines += [f"  fused      {' + '.join((n.name, *n.fused))}: one forward, rows stacked"
              for n in plan.nodes if n.fused]
    if plan.resample is not None:
        loop = plan.resample
        lines.append(f"  resample   {', '.join(loop.repeat)} again until `{loop.filter}` has "
                     f"kept {loop.groups} groups ({loop.rows} rows); at most "
                     f"{loop.max_tries} tries a step")
    if plan.asynchronous is not None:
        cut = plan.asynchronous
        consumer = [n for s in plan.stages if not s.once for n in s.nodes
                    if n not in cut.producer]
        lines.append(f"  async      producer {', '.join(cut.producer)} runs up "
                     f"to {cut.staleness} step(s) ahead of consumer {', '.join(consumer)} "
                     f"(admission {cut.admission}, old log-probs: {cut.old_log_prob}"
                     + (", partial rollouts: new weights between turns" if cut.partial else "")
                     + ")")
    lines += ["", "edges: " + _edge_counts(plan)]
    if plan.dropped:
        lines.append(f"dropped (dead): {', '.join(plan.dropped)}")
    lines += [f"rewritten: {r}" for r in plan.rewrites]
    return lines + _object_lines(plan) + _memory_lines(plan)


def _object_lines(plan: ExecutionPlan) -> list[str]:
    """The Python objects the plan holds: who names each, where it is defined, and how
    it reaches the run's processes."""
    if not plan.objects:
        return []
    users = _object_users(plan)
    lines = ["", "python objects:"]
    for o in plan.objects:
        at = f", defined at {o.where}" if o.where else ""
        how = ("by value (cloudpickle) to the run's processes; a plan file records only its "
               "reference" if o.by_value else "by reference (imported by name)")
        lines.append(f"  {o.ref}  {o.what}{at}: {', '.join(users.get(o.ref, []))}; shipped "
                     f"{how}")
    return lines


def _workers(p: PoolPlan, target: str) -> str:
    if not p.bundles:
        return "1 process (the single controller)"
    res = ", ".join(f"{k}: {v:g}" for k, v in p.bundles[0].asks().items())
    where = f", placed {p.strategy.upper()}" if target == "ray" else ""
    labels = ", ".join(f"{lb.name}: {lb.selector}" for lb in p.label_selector)
    return (f"{p.size} worker(s) on {p.device}, each {{{res}}}{where}"
            + (f" on nodes labelled {{{labels}}}" if labels else ""))


def _sharding(m: ModelPlacement, p: PoolPlan) -> str:
    return f"FSDP-sharded {p.size} ways" if m.sharding == "full_shard" else "unsharded"


def _edge_counts(plan: ExecutionPlan) -> str:
    parts = []
    for d in DISPATCHES:
        n = sum(e.dispatch == d for e in plan.edges)
        aligned = sum(e.dispatch == d and e.group_aligned for e in plan.edges)
        if n:
            parts.append(f"{n} {d}" + (f" ({aligned} group-aligned)" if aligned else ""))
    return ", ".join(parts) or "none"


def _memory_lines(plan: ExecutionPlan) -> list[str]:
    if not plan.memory:
        return []
    lines = ["", "memory per device (estimate):"]
    for m in plan.memory:
        peak = f", peak in node {m.peak_node}" if m.peak_node else ""
        lines.append(f"  {m.pool}: {gib(m.total_bytes)}{peak}")
        counted = [i for i in m.items if not i.transient or i.owner == m.peak_node]
        lines += [f"    {i.what:<12} {i.owner:<16} {gib(i.bytes)}" for i in counted]
        if m.missing:
            lines.append(f"    (a lower bound: no estimate for {', '.join(m.missing)})")
    return lines
