"""Pass `placement`: worker pools, which models they host, and where each node runs.

A node *runs a model* when it is bound to one and its kind's `head` is not
`tokenizer` (generate, logprob, values, reward_model, the updates); such a node runs
where its model lives, data-parallel, and the model is loaded as that head (`lm` or
`scalar`; one model run as both is FG404). A kind that lends its model's tokenizer
only (the rule `reward`) runs with the model-free nodes. Per target:

* `local`: one pool `main` of one process hosting every model; every node sees the
  whole batch;
* `fsdp`: one SPMD pool `spmd` of nproc ranks; every model is FSDP2-sharded per
  transformer block over the ranks (frozen ones too, unless `shard_frozen` is off);
  model nodes run data-parallel, model-free nodes run on every rank over the whole
  batch (cheap, and the numbers equal the local target's);
* `ray`: the `driver` (single controller) runs the model-free nodes; the worker pools
  are `resources.pools` when declared, else inferred as in verl: `actor_rollout_ref`
  (the policy, every model a `generate` uses, frozen reference models), `critic`
  (models an update trains with a scalar head: `ppo_critic_update`) and `reward`
  (frozen models a reward kind runs with a scalar head: `reward_model`), each of nproc
  workers.

The reference of a LoRA model (a frozen model with the same path and dtype, in its
pool) is placed as its base (`ModelPlacement.base_of`): it loads no weights and runs as
the LoRA model with its adapters off.

Declared pools are checked on every target: each model a node runs is in exactly one
pool, sizes are >= 1, model names exist (FG403). On ray each worker of a declared pool
asks for its `cpus`, `gpus` (by default one on cuda) and `custom_resources`, placed by its
`strategy` on nodes matching its `label_selector`; `gpus: 0` on cuda is an error, GPUs on
cpu a warning (FG406). A model's `offload` needs it sharded over two or more workers
(FG405).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.checker.resources import gpu_problems
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.document import did_you_mean
from flowgraph.ir import Graph, ModelSpec, PoolSpec
from flowgraph.passes.program import NodePlacement, Placement, Program
from flowgraph.plan import DRIVER, ROLLOUT_POOL, Amount, Bundle, Label, ModelPlacement, PoolPlan
from flowgraph.registry import KindSpec
from flowgraph.spelling import option

INFERRED_POOLS = ("actor_rollout_ref", "critic", "reward")
"""Pool names inferred for target ray, in plan order."""


@dataclass(frozen=True, slots=True)
class PlaceNodes:
    """Group models into worker pools and put every node on a pool."""

    name: ClassVar[str] = "placement"
    requires: ClassVar[tuple[str, ...]] = ()
    shard_frozen: bool = True
    """Shard frozen models (the reference) over the pool like trainable ones; off:
    every worker holds a whole copy."""

    def apply(self, program: Program) -> Program:
        runs = _model_nodes(program)
        problems = check_pools(program.graph, runs) + _head_problems(program, runs)
        problems += _rollout_pool_name(program)
        if problems:
            return program.add(*problems)
        gpus = _gpu_problems(program)
        if any(d.is_error for d in gpus):
            return program.add(*gpus)
        program = program.add(*gpus)
        pools = self._pools(program, runs, _heads(program, runs))
        offload = _offload_problems(program, pools)
        if offload:
            return program.add(*offload)
        home = {m.name: p.name for p in pools for m in p.models}
        default = {"local": "main", "fsdp": "spmd", "ray": DRIVER}[program.target]
        nodes = tuple(
            NodePlacement(name, home[runs[name]] if name in runs else default,
                          name in runs and program.target != "local")
            for name in program.producers())
        return replace(program, placement=Placement(pools, nodes))

    def _pools(self, program: Program, runs: dict[str, str], heads: dict[str, str]
               ) -> tuple[PoolPlan, ...]:
        graph = program.graph
        used = [m for m in graph.models if m.name in runs.values()]
        bundle = Bundle(cpu=1, gpu=1 if program.device == "cuda" else 0)
        if program.target == "local":
            device = "cuda:0" if program.device == "cuda" else "cpu"
            models = tuple(ModelPlacement(m.name, m.trainable, "none", heads[m.name],
                                          _base_of(m, used, heads))
                           for m in used)
            return (PoolPlan("main", 1, device, models, (bundle,)),)
        if program.target == "fsdp":
            return (self._pool("spmd", program.nproc, program.device, used, bundle, heads),)
        driver = PoolPlan(DRIVER, 1, "cpu", (), ())
        if graph.resources.pools:
            return (driver, *(replace(
                self._pool(p.name, p.size, program.device,
                           [m for m in graph.models if m.name in p.models], _bundle(p, program),
                           heads),
                strategy=p.strategy, label_selector=tuple(Label(*lb) for lb in p.label_selector))
                for p in graph.resources.pools))
        return (driver, *(self._pool(name, size, program.device,
                                     [m for m in graph.models if m.name in names], bundle,
                                     heads)
                          for name, size, names in _inferred(program, runs, used,
                                                             program.nproc)))

    def _pool(self, name: str, size: int, device: str, models: list[ModelSpec],
              bundle: Bundle, heads: dict[str, str]) -> PoolPlan:
        hosted = [m for m in models if m.name in heads]
        bases = {m.name: _base_of(m, hosted, heads) for m in hosted}
        by_name = {m.name: m for m in hosted}
        placed = tuple(ModelPlacement(m.name, m.trainable, self._sharding(
            by_name[bases[m.name] or m.name]), heads[m.name], bases[m.name]) for m in hosted)
        return PoolPlan(name, size, device, placed, (bundle,) * size)

    def _sharding(self, model: ModelSpec) -> str:
        return "full_shard" if model.trainable or self.shard_frozen else "none"


def _offload_problems(program: Program, pools: tuple[PoolPlan, ...]) -> list[Diagnostic]:
    """`models.<m>.offload` where it can work: on a model sharded over two or more workers
    (FSDP2 offloads each worker's shards; a whole model in one process has none), and
    `optimizer` on a model with an optimizer (FG405)."""
    sharded = {m.name for p in pools if p.size > 1 for m in p.models
               if m.sharding == "full_shard" and m.base_of is None}
    out = []
    for m in program.graph.models:
        if m.offload is None or not m.offload.any:
            continue
        where = f"models.{m.name}.offload"
        if m.offload.optimizer and not m.trainable:
            out.append(error("FG405", f"{where}.optimizer: model `{m.name}` is frozen and has "
                             "no optimizer state", m.offload.pos,
                             hint=f"remove {where}.optimizer (params offloads a frozen "
                                  "model's shards)"))
        if m.name in sharded:
            continue
        why = ("the local target runs whole models in one process" if program.target == "local"
               else f"model `{m.name}` is not sharded over two or more workers")
        out.append(error("FG405", f"{where}: CPU offload moves the shards of an FSDP2-sharded "
                         f"model to host memory, and {why}", m.offload.pos,
                         hint=f"compile with {option('target', 'fsdp')} {option('nproc', 2)} (or "
                              "more), or remove "
                              f"{where}"))
    return out


def _base_of(model: ModelSpec, pool: list[ModelSpec], heads: dict[str, str]) -> str | None:
    """The LoRA model of the pool whose base `model` is (same path and dtype, frozen,
    run as a causal LM): the reference of a LoRA actor is its base with the adapters
    off — no second copy of the weights (verl's `ref_in_actor`)."""
    if model.trainable or heads.get(model.name) != "lm":
        return None
    return next((m.name for m in pool if m.lora is not None and heads.get(m.name) == "lm"
                 and (m.path, m.dtype) == (model.path, model.dtype)), None)


Group = tuple[str, int, tuple[str, ...]]
"""(pool name, workers, model names)."""


def _model_nodes(program: Program) -> dict[str, str]:
    """Node -> the model it runs, for nodes bound to a model whose kind runs it (not its
    tokenizer alone: `KindSpec.head`)."""
    return {n.name: n.model for n in program.graph.nodes
            if n.model is not None and program.kind(n.name).model != "none"
            and program.kind(n.name).head != "tokenizer"}


def _heads(program: Program, runs: dict[str, str]) -> dict[str, str]:
    """Model -> what it is loaded as: the `head` of the kinds that run it."""
    return {model: program.kind(node).head for node, model in runs.items()}


def _head_problems(program: Program, runs: dict[str, str]) -> list[Diagnostic]:
    first: dict[str, str] = {}
    out = []
    for node, model in runs.items():
        head = program.kind(node).head
        other = first.setdefault(model, node)
        if program.kind(other).head != head:
            n = program.graph.node(node)
            assert n is not None
            out.append(error(
                "FG404", f"model `{model}` runs as a {_HEAD_WORDS[head]} in node `{node}` and "
                f"as a {_HEAD_WORDS[program.kind(other).head]} in node `{other}`",
                n.pos,
                hint="one set of weights cannot be both: declare two models"))
    return out


_HEAD_WORDS = {"lm": "causal LM", "scalar": "backbone with a scalar head (critic, reward model)"}


def _bundle(pool: PoolSpec, program: Program) -> Bundle:
    """What each worker of a declared pool asks Ray for: its `cpus`, its `gpus` (by
    default one on cuda), its custom resources."""
    gpus = pool.gpus if pool.gpus is not None else int(program.device == "cuda")
    return Bundle(cpu=pool.cpus, gpu=gpus,
                  custom=tuple(Amount(name, amount) for name, amount in pool.custom_resources))


def _inferred(program: Program, runs: dict[str, str], used: list[ModelSpec], size: int
              ) -> list[Group]:
    kinds: dict[str, list[KindSpec]] = {m.name: [] for m in used}
    for node, model in runs.items():
        kinds[model].append(program.kind(node))
    role = {m.name: _role(m, kinds[m.name]) for m in used}
    groups = [(pool, size, tuple(m for m in role if role[m] == pool)) for pool in INFERRED_POOLS]
    return [g for g in groups if g[2]]


def _role(model: ModelSpec, kinds: list[KindSpec]) -> str:
    """verl's pools, from what the kinds that run a model say of it (`KindSpec`)."""
    if any(k.trains and k.head == "scalar" for k in kinds):  # ppo_critic_update
        return "critic"
    if not model.trainable and any(k.category == "reward" and k.head == "scalar"
                                   for k in kinds):  # reward_model
        return "reward"
    # The policy, what generate uses, and frozen reference models share one pool, so
    # weights sync from the trained actor to the rollout engine stays on-device.
    return "actor_rollout_ref"


# --- declared pools -------------------------------------------------------------------------


def check_pools(graph: Graph, runs: dict[str, str]) -> list[Diagnostic]:
    """Every problem with `resources.pools` (FG403); none when no pool is declared."""
    pools = graph.resources.pools
    if not pools:
        return []
    out = [d for p in pools for d in _check_pool(graph, p)]
    first: dict[str, PoolSpec] = {}
    for p in pools:
        for m in p.models:
            if m in first and first[m] is not p:
                out.append(error("FG403", f"model `{m}` is in pools `{first[m].name}` and "
                                 f"`{p.name}`", p.pos, notes=(f"first listed at {first[m].pos}",),
                                 hint="a model lives in exactly one pool; remove it from one"))
            first.setdefault(m, p)
    out += [_unpooled(graph, model, runs) for model in dict.fromkeys(runs.values())
            if model not in first]
    return out


def _rollout_pool_name(program: Program) -> list[Diagnostic]:
    """On ray an asynchronous plan's producer gets a pool named `ROLLOUT_POOL`
    (`flowgraph.passes.program.rollout_pool`): a declared pool cannot have that name (FG403)."""
    if program.target != "ray" or program.graph.trainer.max_staleness < 1:
        return []
    return [error("FG403", f"pool name `{ROLLOUT_POOL}` is reserved for the rollout pool of "
                  "asynchronous rollouts (trainer.max_staleness > 0) on ray", p.pos,
                  hint="rename the pool, e.g. `workers`")
            for p in program.graph.resources.pools if p.name == ROLLOUT_POOL]


def _gpu_problems(program: Program) -> list[Diagnostic]:
    """FG406 on ray for a graph whose `resources.device` is `auto`, against the device
    the compiler chose (the checker has reported it for a device written down)."""
    if program.target != "ray" or program.graph.resources.device != "auto":
        return []
    return gpu_problems(program.graph, program.device)


def _check_pool(graph: Graph, pool: PoolSpec) -> list[Diagnostic]:
    out = []
    if pool.name == DRIVER:
        out.append(error("FG403", f"pool name `{DRIVER}` is reserved for the single controller",
                         pool.pos, hint="rename the pool, e.g. `workers`"))
    if pool.size < 1:
        out.append(error("FG403", f"pool `{pool.name}` has size {pool.size}", pool.pos,
                         expected="size >= 1", hint="give the number of workers, e.g. `size: 2`"))
    known = [m.name for m in graph.models]
    out += [error("FG403", f"pool `{pool.name}` lists model `{m}`, which is not declared under "
                  "`models:`", pool.pos, hint=did_you_mean(m, known))
            for m in pool.models if m not in known]
    return out


def _unpooled(graph: Graph, model: str, runs: dict[str, str]) -> Diagnostic:
    nodes = ", ".join(n for n, m in runs.items() if m == model)
    spec = graph.model(model)
    names = ", ".join(p.name for p in graph.resources.pools)
    return error("FG403", f"model `{model}` runs in node(s) {nodes} but no pool in "
                 "`resources.pools` lists it", spec.pos if spec else graph.resources.pos,
                 hint=f"add `{model}` to the `models:` of one pool ({names}), or remove "
                      "`resources.pools` to let the compiler infer the pools")
