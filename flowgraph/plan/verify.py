"""The plan's verifier: how its records fit together, every violation in one `PlanError`.

`verify` holds a plan to its invariants (every reference resolves, pools host the models
their nodes run, stages respect every dependency, each edge's dispatch follows the rule,
the resample loop, the asynchronous cut and the reported score are the compiler's, the
dims agree with themselves: `flowgraph.plan.shapes`); the compiler runs it on
what it lowers and `flowgraph.plan.codec` on every plan it reads. `verify_kinds` holds a
plan read from a file to the registry's kinds as well.

The rules the compiler applies and the verifier checks are written here once, over the
wiring (`reads`: each node -> the producers it reads), so that the compiler can ask them
of a graph and the verifier of a plan: `dispatch_of`, `producer_side`, `repeated`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable, Mapping

from flowgraph.choices import ADMISSIONS
from flowgraph.plan.records import (
    AsyncPlan,
    ExecutionPlan,
    ModelPlacement,
    NodePlan,
    PoolPlan,
    StagePlan,
    object_users,
    require,
)
from flowgraph.plan.shapes import shape_problems
from flowgraph.registry import HOISTABLE_CATEGORIES, KindSpec

Reads = Mapping[str, Collection[str]]
"""Each node -> the producers (nodes and data sources) its inputs read."""


def verify(plan: ExecutionPlan) -> ExecutionPlan:
    """`plan` when its records fit together; else one `PlanError` naming every problem."""
    problems = _reference_problems(plan) + _stage_problems(plan) + _source_problems(plan)
    if not problems:  # the checks below read the references these ones vouch for
        problems = (_placement_problems(plan) + _order_problems(plan) + _edge_problems(plan)
                    + _resample_problems(plan) + _async_problems(plan)
                    + _fusion_problems(plan) + _category_problems(plan)
                    + _object_problems(plan)
                    + shape_problems(plan))
    require(problems, "execution plan")
    return plan


def plan_reads(plan: ExecutionPlan) -> dict[str, tuple[str, ...]]:
    """The plan's wiring as the rules take it."""
    return {n.name: tuple(i.ref[0] for i in n.inputs) for n in plan.nodes}


# --- the rules the compiler and the verifier share ---------------------------------------


def dispatch_of(src_dp: bool, dst_dp: bool, dst_trains: bool, batched: bool) -> str:
    """How a consumer gets a tensor: the rule of `flowgraph.plan.records`' docstring, from
    whether producer and consumer run data-parallel, the consumer is an update, and the
    tensor has a batch axis."""
    if not dst_dp:
        return "gather" if src_dp else "local"
    if not batched or dst_trains:
        return "gather" if src_dp and batched else "broadcast"
    return "reshard" if src_dp else "split"


def producer_side(stages: tuple[StagePlan, ...], reads: Reads, data: Iterable[str],
                  kinds: Mapping[str, KindSpec], model_of: Mapping[str, str | None],
                  trained: Collection[str]) -> tuple[str, ...]:
    """The producer of asynchronous rollouts, in the order the step runs: the data
    sources, the rollouts (kind category `rollout`), and every other step node that
    reads only the producer's outputs, trains nothing and runs no trained model's
    weights (a reward function, a frozen reference, GRPO's advantage); a node that
    reads a trained model's output, or the prologue's, is the consumer's. The rule the
    compiler, the memory estimate and the verifier share."""

    def held(name: str) -> bool:
        kind = kinds[name]
        runs_trained = (model_of.get(name) in trained and kind.model != "none"
                        and kind.head != "tokenizer")
        return kind.trains or (runs_trained and kind.category != "rollout")

    side = set(data)
    order = [n for s in stages if not s.once for n in s.nodes]
    for name in order:
        if name in kinds and name not in side and not held(name) \
                and all(src in side for src in reads.get(name, ())):
            side.add(name)
    return tuple(n for n in order if n in side)


def upstream_of(reads: Reads, name: str) -> set[str]:
    """The producers `name` reads, directly or not (data sources included)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for src in reads.get(todo.pop(), ()):
            if src not in seen:
                seen.add(src)
                todo.append(src)
    return seen


def repeated(stages: tuple[StagePlan, ...], reads: Reads, data: Iterable[str],
             filter_node: str) -> tuple[str, ...]:
    """What each try of `filter_node`'s loop runs, in stage order: every data source
    (each try draws the next batch of all of them), the step nodes the filter reads
    directly or not, then the filter."""
    before = upstream_of(reads, filter_node) | set(data)
    steps = [n for s in stages if not s.once for n in s.nodes if n in before]
    return (*steps, filter_node)


# --- the checks --------------------------------------------------------------------------


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
    problems += [f"node `{n.name}` reads `{i.src}`, which is not a node of the plan"
                 for n in plan.nodes for i in n.inputs if i.ref[0] not in nodes]
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


def _source_problems(plan: ExecutionPlan) -> list[str]:
    """The run's data sources are the plan's nodes of category `data`, and no others."""
    sources = plan.data_sources()
    problems = [f"`{n.name}` is {'a' if n.name in sources else 'no'} data source of the "
                f"run but its plan's category is `{n.category}`" for n in plan.nodes
                if n.category and (n.category == "data") != (n.name in sources)]
    planned = {n.name for n in plan.nodes}
    return problems + [f"the run's data source `{d}` has no node record"
                       for d in sorted(sources - planned)]


def _object_problems(plan: ExecutionPlan) -> list[str]:
    """Every Python object a param or an implementation names is in the plan's table,
    once; a session's implementation is named nowhere else."""
    listed = [o.ref for o in plan.objects]
    problems = [f"Python object `{r}` is listed twice" for r in _twice(listed)]
    users = object_users(plan)
    problems += [f"{' and '.join(who)} name(s) the Python object `{ref}`, which the plan's "
                 "`objects` do not list" for ref, who in users.items() if ref not in listed]
    problems += [f"Python object `{r}` is listed but nothing names it" for r in listed
                 if r not in users]
    return problems


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
        if name not in nodes:
            problems.append(f"the asynchronous producer names `{name}`, not a node of the plan")
            continue
        if nodes[name].trains:
            problems.append(f"the asynchronous producer runs `{name}`, an update")
        problems += [f"the asynchronous producer runs `{name}`, which reads `{i.src}` of the "
                     "consumer" for i in nodes[name].inputs if i.ref[0] not in side]
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


def _resample_problems(plan: ExecutionPlan) -> list[str]:
    """The loop repeats exactly the data and the step nodes before its filter, and no
    node after it reads a tensor of a single try (anything but the filter's outputs)."""
    loop = plan.resample
    if loop is None:
        return []
    if loop.filter not in {n.name for n in plan.nodes}:
        return [f"the resample loop names `{loop.filter}`, not a node of the plan"]
    once = {n for s in plan.stages if s.once for n in s.nodes}
    want = repeated(plan.stages, plan_reads(plan), plan.data_sources(), loop.filter)
    problems = [] if loop.repeat == want else [
        f"the resample loop of `{loop.filter}` repeats {list(loop.repeat)}; the data "
        f"sources and the step nodes before the filter are {list(want)}"]
    for node in plan.nodes:
        if node.name in want or node.name in once:
            continue
        problems += [f"node `{node.name}` runs after the filter `{loop.filter}` but reads "
                     f"`{i.src}`, a tensor of one try" for i in node.inputs
                     if (i.ref[0] in want or i.ref[0] in once) and i.ref[0] != loop.filter]
    return problems
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
    spec, adapted = plan.run.model(placed.name), plan.run.model(placed.base_of or "")
    where = f"model `{placed.name}` on pool `{pool.name}` is placed as the base of " \
            f"`{placed.base_of}`"
    if adapted is None or spec is None:
        return f"{where}, which is not a model of the run"
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
    data = plan.data_sources()
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
    for node in plan.nodes:
        for wire in node.inputs:
            src = wire.ref[0]
            if src in data:
                continue
            if node.name in once:
                ready = src in once and rank[src] < rank[node.name]
            else:
                ready = src in once or rank[src] < rank[node.name]
            if not ready:
                problems.append(f"node `{node.name}` (stage `{plan.node(node.name).stage}`) "
                                f"reads `{wire.src}`, which stage `{plan.node(src).stage}` only "
                                "computes at the same time or later")
    return problems


def _fusion_problems(plan: ExecutionPlan) -> list[str]:
    """A fused node runs later in its leader's stage, on its model, with its kind and
    params, each input from the producer the leader's comes from; in one group only."""
    problems, seen = [], set()
    nodes = {n.name: n for n in plan.nodes}
    for lead in plan.nodes:
        if not lead.fused:
            continue
        stage = next(s.nodes for s in plan.stages if s.name == lead.stage)
        producers = {i.port: i.ref[0] for i in lead.inputs}
        for name in lead.fused:
            node = nodes.get(name)
            if node is None:
                problems.append(f"node `{lead.name}` fuses `{name}`, which is not in the plan")
                continue
            if name in seen or node.fused or name == lead.name:
                problems.append(f"node `{name}` is fused twice, or fuses nodes itself")
            seen.add(name)
            if ((node.kind, node.model, node.stage) != (lead.kind, lead.model, lead.stage)
                    or node.params != lead.params
                    or {i.port: i.ref[0] for i in node.inputs} != producers
                    or stage.index(name) < stage.index(lead.name)):
                problems.append(f"node `{lead.name}` fuses `{name}`, which is not a later node "
                                f"of its stage with its kind, model, params and producers")
    return problems


def _edge_problems(plan: ExecutionPlan) -> list[str]:
    wired = {(i.src, f"{n.name}.{i.port}") for n in plan.nodes for i in n.inputs}
    planned = {(e.src, e.dst) for e in plan.edges}
    twice = repeated_edges([(e.src, e.dst) for e in plan.edges])
    if twice:
        return twice
    problems = [f"edge `{a} -> {b}` has no dispatch in the plan"
                for a, b in sorted(wired - planned)]
    problems += [f"edge `{a} -> {b}` is wired by no node of the plan"
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


def repeated_edges(pairs: list[tuple[object, object]]) -> list[str]:
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


def _category_problems(plan: ExecutionPlan) -> list[str]:
    """What a node's category allows: a filter node, and only one, drives the resample
    loop; a prologue node is the same at every step."""
    problems = []
    for n in plan.nodes:
        spec = plan.run.model(n.model) if n.model else None
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


def verify_kinds(plan: ExecutionPlan, kinds: Mapping[str, KindSpec]) -> None:
    """A plan read from a file against the registry's kinds (plugins imported): each node's
    implementation and kind facts are its kind's, its fusion is of a kind whose rows can
    be stacked, and the asynchronous producer is the rule's. Raises `PlanError`. The
    executors never call it: they run the plan as it is (`flowgraph.api.load_plan` does)."""
    problems = []
    for n in plan.nodes:
        kind = kinds[n.name]
        spec = plan.run.model(n.model) if n.model else None
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
        want_side = producer_side(plan.stages, plan_reads(plan), plan.data_sources(), kinds,
                                  {n.name: n.model for n in plan.nodes},
                                  {m.name for m in plan.models if m.trainable})
        if plan.asynchronous.producer != want_side:
            problems.append(f"the asynchronous producer is {list(plan.asynchronous.producer)}; "
                            f"the data, rollouts and the nodes that read only them are "
                            f"{list(want_side)}")
        if not rollouts & set(want_side):
            problems.append("the plan is asynchronous, but no rollout reads only the data")
    require(problems, "execution plan")

