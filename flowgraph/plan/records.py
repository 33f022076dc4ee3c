"""The execution plan's records: what runs where, in which order, and how each edge's
batch moves.

`flowgraph compile` lowers a graph to an `ExecutionPlan` and writes it as JSON; the
executors (`flowgraph.compilers.targets`: local, fsdp, ray) consume only the plan. Every
record is frozen and checks itself; the plan holds the run's settings (`RunSpec`) and
its node records, never a second copy of the graph.

One module past ~450 lines: it is the plan file's schema, every record with a docstring
under each field, and the vocabulary below that the fields use; what acts on the records
is in `verify`, `codec` and `summary`.

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
  samples of one prompt. `flowgraph.plan.verify.dispatch_of` is the rule, used by the
  compiler and by the verifier alike.

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

How the records fit together (every reference, pools hosting the models their nodes
run, stages that respect every dependency, each edge's dispatch against the rule) is
checked by `flowgraph.plan.verify`, on every plan compiled or read.

Notation: B = Bp*N sequences, Bp prompts, N samples per prompt, P prompt length,
T response length, V vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from flowgraph.choices import DEVICES, PLACEMENT_STRATEGIES, TARGETS
from flowgraph.contracts import TensorSpec
from flowgraph.errors import PlanError
from flowgraph.ir import (
    NAME_RE,
    DataSpec,
    ModelSpec,
    Plugin,
    ResourceSpec,
    TrainerSpec,
    readers,
)
from flowgraph.objects import (
    PyObject,
    by_value,
    pickled,
    tagged,
    unpickled,
    unresolved_message,
)
from flowgraph.registry import plugin_module

PLAN_VERSION = 7
"""Format version of the JSON plan; `flowgraph.plan.codec` reads this one and converts the
one before (6, which held a second copy of the graph)."""
DISPATCHES = ("local", "split", "gather", "broadcast", "reshard")
SHARDINGS = ("none", "full_shard")
LOADED_HEADS = ("lm", "scalar")
MEMORY_ITEMS = ("weights", "grads", "optimizer", "compute", "activations", "logits", "kv_cache",
                "vllm")
DRIVER = "driver"
"""The single controller's pool (target ray)."""


def require(problems: list[str], where: str) -> None:
    """Raise one `PlanError` listing every problem of `where` (none: return)."""
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
        require(["value must be >= 1"] if self.value < 1 else [], f"dim `{self.name}`")


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
    given: tuple[ParamPlan, ...] = ()
    """The params the graph sets, as it sets them (a policy loss by its name, where
    `params` holds the implementation the compiler resolved it to): what the graph's
    document records (`flowgraph.plan.codec.plan_document`)."""
    eval_params: tuple[ParamPlan, ...] = ()
    """The params at evaluation on held-out data (a rollout: `val_n` responses, greedy
    unless `val_temperature` > 0; an update: the same implementation, whose `Update` the
    update loop evaluates without a step); the kind's evaluation-only params are in
    neither."""
    where: str = ""
    """The node's place in the graph file (`graph.yaml:12:3`), for messages."""

    def __post_init__(self) -> None:
        require(["name is not an identifier"] if _bad_name(self.name) else [],
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
        require([] if self.amount > 0 else [f"amount must be > 0, got {self.amount}"],
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
        require(["cpu and gpu must be >= 0"] if min(self.cpu, self.gpu) < 0 else [], "bundle")

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
        require(problems, f"model `{self.name}`")


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
        require(problems, f"pool `{self.name}`")

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
        require([f"dispatch must be one of {DISPATCHES}"] if bad else [],
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
        require(problems, f"memory item of `{self.owner}`")


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
        require(problems, f"memory of pool `{self.pool}`")

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
        require(bad, f"resample loop of `{self.filter}`")

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


@dataclass(frozen=True, slots=True)
class ScorePlan:
    """Where the score a run reports comes from (`critic/score/mean`, the console's
    score, `val/score/mean`, the validation table's `score`, Prometheus'
    `flowgraph_reward_mean`): the scores the advantage node trains on, after every
    shaping node, penalty and weighted sum before it. `flowgraph.plan.score.score_plan`
    is the rule, applied to a plan's nodes where the score is reported (derived, never
    stored: a plan file cannot say otherwise)."""

    advantage: str
    """The advantage node (the first in the plan)."""
    scores: str
    """`node.port` of the per-sequence scores the advantage reads (its `scores`, or those a
    `token_reward` places on the tokens its `token_level_rewards` come from: verl's score,
    before the KL penalty); with `per_token`, a token-level reward with no per-sequence
    scores upstream (an agent's `token_level_rewards`)."""
    rows: str
    """`scores` one per sample of the rollout: through a filter to the scores it keeps
    from (the validation table's `score`, a row of each response); `scores` without one."""
    per_token: bool = False
    """`scores` is per token: a sequence's score is its sum over `mask`."""
    mask: str | None = None
    """`node.port` of the response mask the advantage reads."""
    rewards: str | None = None
    """`node.port` of the token-level rewards the advantage reads (after the KL penalty:
    `critic/rewards/mean` is their sum per sequence); None: it reads `scores`, which are
    the rewards then."""

    def __post_init__(self) -> None:
        refs = (self.scores, self.rows, self.mask or "a.b", self.rewards or "a.b")
        require([f"`{r}` is not `node.port`" for r in refs if r.count(".") != 1],
                 f"score of `{self.advantage}`")




@dataclass(frozen=True, slots=True)
class RunSpec:
    """The graph file's settings the executors read (its nodes and dims are the plan's own
    records): what to call the run, how to train, on what, with which plugins."""

    name: str
    trainer: TrainerSpec
    resources: ResourceSpec
    models: tuple[ModelSpec, ...]
    data: tuple[DataSpec, ...]
    plugins: tuple[Plugin, ...]

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Everything an executor needs to run a graph on one target. The records check
    themselves; how they fit together is `flowgraph.plan.verify`'s, which the compiler
    and the plan file's reader run."""

    run: RunSpec
    """The run's settings (`trainer`, `models`, `data`...), read through the accessors."""
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
    themselves are in `nodes` (an input unwired, a node dropped)."""
    plugin_paths: tuple[str, ...] = ()
    """Absolute folders holding the graph's plugins (a plugin file's own folder, the
    graph file's for a module beside it): every process that runs the plan imports them
    from there; a plugin file itself is recorded by its absolute path (`run.plugins`)."""
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
        problems = []
        if self.version != PLAN_VERSION:
            problems.append(f"format version {self.version}, this flowgraph reads "
                            f"{PLAN_VERSION}")
        if self.target not in TARGETS:
            problems.append(f"target `{self.target}` is not one of {TARGETS}")
        if self.device not in DEVICES:
            problems.append(f"device `{self.device}` is not one of {DEVICES}")
        if self.nproc < 1:
            problems.append(f"nproc must be >= 1, got {self.nproc}")
        require(problems, "execution plan")

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
        users = object_users(self)
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

    # The run's settings, held once, in `run`.
    @property
    def name(self) -> str:
        return self.run.name

    @property
    def trainer(self) -> TrainerSpec:
        return self.run.trainer

    @property
    def resources(self) -> ResourceSpec:
        return self.run.resources

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        return self.run.models

    @property
    def data(self) -> tuple[DataSpec, ...]:
        return self.run.data

    @property
    def plugins(self) -> tuple[Plugin, ...]:
        return self.run.plugins

    def with_models(self, models: tuple[ModelSpec, ...]) -> ExecutionPlan:
        """This plan loading `models` (the same names) instead: a model path resolved when
        the run starts (a run dir's model, `flowgraph.compilers.export.from_run_dirs`)."""
        return replace(self, run=replace(self.run, models=models))

    def with_trainer(self, trainer: TrainerSpec) -> ExecutionPlan:
        """This plan run with `trainer` (a run's own settings: where it writes, how long)."""
        return replace(self, run=replace(self.run, trainer=trainer))

    def readers(self, node: str, port: str) -> tuple[str, ...]:
        """The nodes that read output `node.port` (`flowgraph.ir.readers`)."""
        return readers([(i.ref, n.name, i.port) for n in self.nodes for i in n.inputs],
                       node, port)

    def model(self, name: str) -> ModelSpec:
        """The `models:` entry `name` (the verifier holds every placement to one)."""
        spec = self.run.model(name)
        if spec is None:
            raise PlanError(f"the plan has no model `{name}`")
        return spec

    def pool(self, name: str) -> PoolPlan:
        return next(p for p in self.pools if p.name == name)

    def edge(self, src: str, dst: str) -> EdgePlan:
        return next(e for e in self.edges if e.src == src and e.dst == dst)

    def data_sources(self) -> frozenset[str]:
        """The names of its data sources (their nodes' records are `nodes` too)."""
        return frozenset(d.name for d in self.run.data)

def object_users(plan: ExecutionPlan) -> dict[str, list[str]]:
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

