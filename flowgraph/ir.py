"""The graph IR: frozen, self-verifying records that both front ends produce.

A `Graph` holds models, data sources, nodes wired by `PortRef`s, dims, the trainer
and resource settings, and the plugin modules it may import. Every element keeps its
`SourcePos`; positions never take part in equality, so a graph written to YAML and
read back is equal to the original. Passes build new graphs (`dataclasses.replace`)
instead of mutating.

The records of the graph file's sections (models, optimizer, lora, offload, trainer,
resources, pools) declare each setting once with `setting(default, doc, choices=, minimum=, ...)`:
the YAML reader's checks, the JSON Schema and its docs are derived from those
declarations (`flowgraph.settings`), and each record checks its own values with them.

One module past ~450 lines, on purpose: the records of every section of a graph file
refer to one another (`Graph` holds them all) and each declares its settings in place;
split by section, a setting's record and the graph that holds it would sit apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias, Union

from flowgraph.choices import (
    ADMISSIONS,
    ATTN_IMPLEMENTATIONS,
    LOGGERS,
    MODEL_DTYPES,
    OLD_LOG_PROBS,
    ON_NONFINITE,
    OPTIMIZERS,
    PLACEMENT_STRATEGIES,
    RESOURCE_DEVICES,
    SCHEDULES,
    Precision,
)
from flowgraph.errors import IRError
from flowgraph.objects import PyObject, rebuilt, tagged
from flowgraph.objects import of as object_of
from flowgraph.paths import folder_of
from flowgraph.settings import check_settings, setting
from flowgraph.source import UNKNOWN_POS, SourcePos

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""Names of nodes, models, data sources, ports and params."""

Scalar: TypeAlias = str | int | float | bool | None
ParamValue: TypeAlias = Union[Scalar, tuple["ParamValue", ...], "Params", PyObject]
"""A param: plain data, or a function or class held by reference (`flowgraph.objects`)."""


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise IRError(
            f"{what} name {name!r} is not valid: use letters, digits and `_`, "
            "starting with a letter or `_`"
        )


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter value, possibly nested."""

    name: str
    value: ParamValue
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)


@dataclass(frozen=True, slots=True)
class Params:
    """An ordered, frozen mapping of parameters."""

    items: tuple[Param, ...] = ()

    def __post_init__(self) -> None:
        names = [p.name for p in self.items]
        if len(names) != len(set(names)):
            raise IRError(f"duplicate parameter names in {names}")

    def get(self, name: str, default: ParamValue = None) -> ParamValue:
        for p in self.items:
            if p.name == name:
                return p.value
        return default

    def find(self, name: str) -> Param | None:
        return next((p for p in self.items if p.name == name), None)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.items)

    def to_python(self) -> dict[str, object]:
        return {p.name: to_python(p.value) for p in self.items}

    def objects(self) -> list[PyObject]:
        """The Python functions and classes these params hold, nested ones too."""
        return [o for p in self.items for o in _objects_in(p.value)]

    @staticmethod
    def of(mapping: Mapping[str, object], pos: SourcePos = UNKNOWN_POS) -> Params:
        return Params(tuple(Param(k, from_python(v, pos), pos) for k, v in mapping.items()))


def _objects_in(value: ParamValue) -> list[PyObject]:
    if isinstance(value, PyObject):
        return [value]
    if isinstance(value, Params):
        return value.objects()
    if isinstance(value, tuple):
        return [o for v in value for o in _objects_in(v)]
    return []


def to_python(value: ParamValue) -> object:
    """Plain dicts and lists, for JSON and YAML output (a Python object: its tagged
    mapping `{"$python": "module:qualname"}`)."""
    if isinstance(value, PyObject):
        return value.document()
    if isinstance(value, Params):
        return value.to_python()
    if isinstance(value, tuple):
        return [to_python(v) for v in value]
    return value


def from_python(value: object, pos: SourcePos = UNKNOWN_POS) -> ParamValue:
    """Freeze plain Python values (dicts, lists, scalars) into a `ParamValue`; a function
    or class (a reward function, a tool, an env class) is held by reference."""
    if isinstance(value, (Params, PyObject)):
        return value
    ref = tagged(value)
    if ref is not None:
        return rebuilt(ref)
    if isinstance(value, Mapping):
        return Params(tuple(Param(str(k), from_python(v, pos), pos) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(from_python(v, pos) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    held = object_of(value)
    if held is not None:
        return held
    raise IRError(f"parameter value {value!r} of type {type(value).__name__} is neither plain "
                  "data (a number, string, list or mapping) nor a function or class; pass "
                  "the function that builds or calls it instead")


@dataclass(frozen=True, slots=True)
class PortRef:
    """`node.port`: an output of a node or data source."""

    node: str
    port: str
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __str__(self) -> str:
        return f"{self.node}.{self.port}"


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One computation: a kind from the registry, its model, inputs and params."""

    name: str
    kind: str
    """Registry name, e.g. `gae`."""
    inputs: tuple[tuple[str, PortRef], ...] = ()
    """(input port, upstream output) pairs, in the order written."""
    model: str | None = None
    """The model this node runs, a key of `Graph.models`."""
    params: Params = Params()
    hoisted: bool = False
    """Computed once before the training loop (set by loop-invariant hoisting)."""
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        _check_name("node", self.name)
        ports = [p for p, _ in self.inputs]
        if len(ports) != len(set(ports)):
            raise IRError(f"node `{self.name}` binds an input port twice: {ports}")

    def input(self, port: str) -> PortRef | None:
        return next((ref for p, ref in self.inputs if p == port), None)


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """Optimizer and learning-rate schedule of a trainable model."""

    name: str = setting("adamw", "Optimizer.", choices=tuple(OPTIMIZERS))
    lr: float = setting(1e-6, "Peak learning rate.")
    weight_decay: float = setting(0.0, "Decoupled weight decay.")
    betas: tuple[float, float] = setting((0.9, 0.999), "Adam betas (beta1, beta2).")
    eps: float = setting(1e-8, "Adam epsilon.")
    warmup_steps: int = setting(
        0, "Training steps (not optimizer steps, as verl's lr_warmup_steps) of linear "
        "warm-up from 0: the LR of step s < w is lr*s/w.", minimum=0)
    schedule: str = setting(
        "constant", "LR decay after warm-up (TRL's lr_scheduler_type): constant (the default: "
        "none), or linear or cosine to 0 at trainer.steps, as transformers' "
        "get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup (TRL's default is "
        "linear). It steps once per training step.", choices=SCHEDULES)
    grad_clip: float = setting(1.0, "Max global gradient norm; 0 disables clipping.",
                               minimum=0)
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        check_settings(self, "optimizer")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """Low-rank adapters (LoRA, through `peft`) on a trainable model: only they train and
    are checkpointed; the base weights load once from `path` and stay frozen."""

    r: int = setting(8, "The adapters' rank (verl's lora_rank).", minimum=1,
                     hint="r: 8 (verl's lora_rank) is a common start")
    alpha: float = setting(16.0, "Scale of the update, (alpha / r)*B*A (verl's lora_alpha).",
                           above=0, hint="alpha: 2*r is common (the update is scaled by "
                                         "alpha / r)")
    dropout: float = setting(0.0, "Dropout on the adapters' input.", minimum=0, below=1)
    target_modules: tuple[str, ...] = setting(
        ("all-linear",), "Names of the modules that get adapters (q_proj, v_proj, ...), or "
        "all-linear: every linear layer but the output head (peft's and verl's default).",
        written=(list, str))
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        check_settings(self, "lora")


@dataclass(frozen=True, slots=True)
class OffloadSpec:
    """Host (CPU) memory for a sharded model's state between its uses on the device
    (targets fsdp and ray; a CPU run accepts it, with nothing to gain)."""

    params: bool = setting(
        False, "Keep the sharded parameters and gradients in host memory, each unit "
        "copied to the device for its forward and backward (FSDP2's CPUOffloadPolicy): the "
        "optimizer then steps there, so its state is in host memory too.")
    optimizer: bool = setting(
        False, "Keep the optimizer's state in host memory between optimizer steps (moved to "
        "the device for each step, back after it; verl's optimizer_offload); implied by "
        "params.")
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        check_settings(self, "offload")

    @property
    def any(self) -> bool:
        return self.params or self.optimizer


def _dtype_doc() -> str:
    return "Parameter and compute dtype: " + "; ".join(
        f"`{name}`: {p.doc}" for name, p in MODEL_DTYPES.items()) + "."


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model: where its weights come from and whether it is trained."""

    name: str
    path: str = setting(doc="Local directory, hub id, or `builtin:<name>` for the embedded "
                            "tiny models (builtin:tiny-lm); a relative path is relative to "
                            "the graph file's folder.")
    trainable: bool = setting(False, "An update node trains this model; it then needs an "
                                     "optimizer.")
    dtype: str = setting("float32", _dtype_doc(), choices=tuple(MODEL_DTYPES))
    optimizer: OptimizerSpec | None = setting(None, "Optimizer and learning-rate schedule "
                                                    "of a trainable model.")
    tokenizer: str | None = setting(None, "Tokenizer directory or hub id; default: the "
                                          "model's path.", written=(str,))
    gradient_checkpointing: bool = setting(False, "Recompute activations in the backward "
                                                  "pass to save memory.")
    attn_implementation: str = setting(
        "sdpa", "transformers' attention: sdpa (its default), flash_attention_2 or eager; "
        "only eager materialises the T x T scores (the memory estimate).",
        choices=ATTN_IMPLEMENTATIONS)
    config: Params = setting(Params(), "Architecture fields (hidden_size, "
                                       "num_hidden_layers, ...) for the memory estimate when "
                                       "`path` has no readable config.json.")
    lora: LoraSpec | None = setting(None, "Train low-rank adapters (peft LoRA) instead of the "
                                          "weights: only they train and are checkpointed; a "
                                          "frozen model with the same path (the reference) "
                                          "is the base with the adapters off, no second copy.")
    offload: OffloadSpec | None = setting(None, "CPU offload of a sharded model's parameters "
                                                "and optimizer state (fsdp and ray).")
    init_from: str | None = setting(
        None, "A flowgraph run dir whose newest intact checkpoint gives this model's "
        "starting weights (over `path`'s, which still says the architecture and "
        "tokenizer), with a fresh optimizer from step 0: a critic warmed up by another "
        "graph (VAPO, VC-PPO's value pretraining). Its model of the same name, or "
        "`init_from_model`; a relative path is relative to the graph file's folder. "
        "`--resume` loads the run's own checkpoint instead.", written=(str,))
    init_from_model: str | None = setting(
        None, "The model of the `init_from` run to start from; default: this model's "
        "name.", written=(str,))
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        _check_name("model", self.name)
        check_settings(self, f"models.{self.name}")

    @property
    def precision(self) -> Precision:
        """What `dtype` keeps and computes in (`flowgraph.choices.MODEL_DTYPES`)."""
        return MODEL_DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class DataSpec:
    """A data source; it acts as a node with no inputs and the outputs of its kind."""

    name: str
    kind: str
    """`prompts` or `preferences` (or a plugin's data kind)."""
    path: str
    """Parquet or JSONL file, or `builtin:<task>` for the embedded toy tasks."""
    params: Params = Params()
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        _check_name("data source", self.name)


@dataclass(frozen=True, slots=True)
class DimBinding:
    """`dims: {N: 4}` binds N; `dims: {T: null}` declares T symbolic."""

    name: str
    value: int | None
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        _check_name("dim", self.name)
        if self.value is not None and (isinstance(self.value, bool) or self.value < 1):
            raise IRError(
                f"dim `{self.name}` must be a positive integer or null, got {self.value!r}"
            )




@dataclass(frozen=True, slots=True)
class TrainerSpec:
    """The training loop around the graph."""

    steps: int = setting(10, "Training steps.", minimum=0)
    seed: int = setting(0, "Random seed of data order, sampling and initialisation.",
                        minimum=0)
    run_dir: str = setting("runs/flowgraph", "Where metrics, TensorBoard events and "
                                             "checkpoints go (relative to the working "
                                             "directory of the run).")
    checkpoint_every: int = setting(0, "Checkpoint every this many steps; 0: only at the "
                                       "end.", minimum=0)
    max_checkpoints: int = setting(2, "Keep the newest this many checkpoints; 0: keep all.",
                                   minimum=0)
    eval_every: int = setting(0, "Evaluate every this many steps; 0: never.", minimum=0)
    log_every: int = setting(
        1, "The console prints the line of every this many steps (TRL's logging_steps), and "
        "of the last; metrics.jsonl and the trackers get every step.", minimum=1)
    val_before_train: bool = setting(
        False, "Also evaluate before the first update (verl's val_before_train): the first "
        "row's val/ metrics are that baseline (unless eval_every is 1).")
    resume: bool = setting(False, "Resume from the latest checkpoint in run_dir.")
    strict: bool = setting(False, "Check every tensor on every edge at every step (the "
                                  "first step always is).")
    on_nonfinite: str = setting("stop", "`stop`, or `skip` a batch with NaN/inf in rewards, "
                                        "advantages, losses or gradients.",
                                choices=ON_NONFINITE)
    step_timeout_s: float = setting(
        1800.0, "A worker with no progress for this long is treated as dead: ray restarts "
        "its worker groups from the last checkpoint, fsdp ends the job with the command "
        "that resumes it (the local target: a node that runs this long stops the run); "
        "generous for real steps, so that a stopped or hung worker never hangs the run "
        "for good; 0 disables.", minimum=0)
    stop_grace_s: float = setting(
        120.0, "After SIGTERM or SIGINT, the seconds the run may take to finish its node and "
        "save a checkpoint before it stops at once (keep it below the scheduler's kill wait: "
        "SLURM KillWait, Kubernetes terminationGracePeriodSeconds); 0: no limit.", minimum=0)
    verify_sync_every: int = setting(
        0, "After a weight sync into the vLLM engine, compare its log-probs of a probe batch "
        "with the trainer's and stop on a mismatch: at the first sync, and every this many "
        "syncs (one a step) after it (0: the first only).", minimum=0)
    max_staleness: int = setting(
        0, "Asynchronous rollouts: generation runs up to this many steps ahead of the update "
        "(the rollout of step k comes from the policy of step k-S, generated while earlier "
        "steps train); 0: synchronous.", minimum=0)
    admission: str = setting(
        "block", "With max_staleness > 0: `block` a rollout until the policy S steps behind "
        "its step is out (exact, reproducible), or `drop` (rollouts never wait; one more "
        "than S updates old when its step comes is dropped).", choices=ADMISSIONS)
    old_log_prob: str = setting(
        "recompute", "With max_staleness > 0, where the update's pi_old comes from: "
        "`recompute` (the actor's log-probs when the rollout is consumed) or `rollout` (the "
        "rollout's own rollout_log_prob: the policy that sampled it).", choices=OLD_LOG_PROBS)
    partial_rollouts: bool = setting(
        False, "With max_staleness > 0 and an agent_rollout: episodes that outlast an update "
        "continue on the new weights from their next turn (the producer takes the newest "
        "published weights between turns); each sampled token records the version that "
        "sampled it (`policy_version`), staleness and admission count the oldest trained "
        "token. Numbers then depend on timing, under either admission.")
    metrics_port: int | None = setting(None, "Serve Prometheus metrics on this port; null: "
                                             "off.")
    loggers: tuple[str, ...] = setting(
        ("console", "jsonl", "tensorboard"), "Where step rows go: console (the line per "
        "step), jsonl (run_dir/metrics.jsonl, always written), tensorboard, wandb (offline "
        "unless WANDB_MODE says otherwise), mlflow. wandb and mlflow need pip install "
        "'flowgraph[trackers]'.", choices=LOGGERS)
    mlflow_tracking_uri: str | None = setting(
        None, "The MLflow store of the mlflow logger; null: MLFLOW_TRACKING_URI, else "
        "sqlite:///<run_dir>/mlflow/mlflow.db.")
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        check_settings(self, "trainer")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A resource pool: `size` workers that host the listed models together."""

    name: str
    size: int = setting(doc="Workers in the pool.")
    models: tuple[str, ...] = setting(doc="Models hosted together in the pool.")
    cpus: int = setting(1, "CPU cores of each worker (target ray: its bundle's CPU).",
                        minimum=1, hint="a worker takes one core at least, e.g. `cpus: 4`")
    gpus: int | None = setting(
        None, "GPUs of each worker (target ray: its bundle's GPU); null: 1 with device "
        "cuda, 0 on cpu.", minimum=0,
        hint="0 on cpu, 1 or more on cuda; leave it out for 1 on cuda, 0 on cpu")
    custom_resources: tuple[tuple[str, float], ...] = setting(
        (), "Custom Ray resources of each worker, name -> amount (what `ray start "
        "--resources` gives the nodes, e.g. `{TPU: 1}`).", written=(dict,))
    strategy: str = setting(
        "pack", "How the workers spread over the cluster's nodes: Ray's placement-group "
        "strategy PACK, SPREAD, STRICT_PACK (all on one node) or STRICT_SPREAD (each on "
        "its own node).", choices=PLACEMENT_STRATEGIES)
    label_selector: tuple[tuple[str, str], ...] = setting(
        (), "Node affinity: the node labels a worker's node must have, label -> Ray's "
        "selector (`a100`, `!spot`, `in(a, b)`, `!in(a, b)`), e.g. `{ray.io/node-id: "
        "ID}` or a label given by `ray start --labels`.", written=(dict,))
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        check_settings(self, f"resources.pools.{self.name}")


@dataclass(frozen=True, slots=True)
class ResourceSpec:
    """Where the graph runs; the CLI's `--nproc` overrides `nproc`."""

    device: str = setting("auto", "cpu, cuda, or auto (cuda when available).",
                          choices=RESOURCE_DEVICES)
    nproc: int = setting(1, "Data-parallel size: ranks (fsdp) or workers per pool (ray).",
                         minimum=1)
    memory_gib: float | None = setting(None, "Memory of one device in GiB; the compiler's "
                                             "estimate must fit. null: not checked.")
    pools: tuple[PoolSpec, ...] = setting((), "Resource pools by name; empty lets the "
                                              "compiler infer them.", written=(dict,))
    rollout_cpus: int = setting(
        1, "Target ray with trainer.max_staleness > 0: CPU cores of the rollout pool's "
        "worker (its torch threads), which holds its own copy of the models the rollout "
        "runs and generates beside the trainer's pools (with device cuda, one GPU too).",
        minimum=1)
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def __post_init__(self) -> None:
        check_settings(self, "resources")


@dataclass(frozen=True, slots=True)
class Plugin:
    """A module the graph may import to register custom kinds: a module name, or a `.py`
    file relative to the folder of the file that lists it (`flowgraph.paths`); in a
    compiled plan, the file's absolute path (`flowgraph.passes.program.resolved_plugins`)."""

    module: str
    pos: SourcePos = field(default=UNKNOWN_POS, compare=False)

    def folder(self) -> str:
        """Where the plugin is looked for first: the folder of the file that lists it (a
        graph file, or the Python file that called `GraphBuilder.plugin`), or the working
        directory for one given on the command line."""
        return str(folder_of(self.pos))


@dataclass(frozen=True, slots=True)
class Graph:
    """A whole RL pipeline."""

    name: str
    nodes: tuple[NodeSpec, ...] = ()
    models: tuple[ModelSpec, ...] = ()
    data: tuple[DataSpec, ...] = ()
    dims: tuple[DimBinding, ...] = ()
    trainer: TrainerSpec = TrainerSpec()
    resources: ResourceSpec = ResourceSpec()
    plugins: tuple[Plugin, ...] = ()
    source: str = field(default="<python>", compare=False)
    """The file the graph was read from."""

    def node(self, name: str) -> NodeSpec | None:
        return next((n for n in self.nodes if n.name == name), None)

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    def data_source(self, name: str) -> DataSpec | None:
        return next((d for d in self.data if d.name == name), None)

    def dim_values(self) -> dict[str, int | None]:
        return {d.name: d.value for d in self.dims}

    def edges(self) -> Iterator[tuple[PortRef, NodeSpec, str]]:
        """(upstream output, consuming node, input port) for every wired input."""
        for n in self.nodes:
            for port, ref in n.inputs:
                yield ref, n, port

    def readers(self, node: str, port: str) -> tuple[str, ...]:
        """The nodes that read output `node.port` (`readers`)."""
        return readers([((ref.node, ref.port), n.name, p) for ref, n, p in self.edges()],
                       node, port)


def readers(edges: list[tuple[tuple[str, str], str, str]], node: str, port: str
            ) -> tuple[str, ...]:
    """The nodes that read output `node.port`, given each edge as ((producer, output),
    consumer, input): the last consumers along the edges that carry it, whatever their
    input is called (a plugin reward may read the ground truth as `answers`); a node
    passes it on when its output of the input's name is read (a `generate` hands
    `ground_truth` on to, say, the reward)."""
    found: list[str] = []
    produced = {ref for ref, _, _ in edges}
    frontier, seen = [(node, port)], {(node, port)}
    while frontier:
        producer = frontier.pop()
        for ref, consumer, name in edges:
            if ref != producer:
                continue
            onward = (consumer, name)
            if onward not in produced:
                found.append(consumer)
            elif onward not in seen:
                seen.add(onward)
                frontier.append(onward)
    return tuple(sorted(set(found)))
