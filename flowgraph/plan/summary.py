"""The plan as `flowgraph compile` prints it: pools and their models, stages, the score
it reports, edges, what the passes rewrote, the Python objects it carries and the memory
estimate."""

from __future__ import annotations

from flowgraph.plan.records import (
    DISPATCHES,
    ExecutionPlan,
    ModelPlacement,
    PoolPlan,
    object_users,
)
from flowgraph.plan.score import score_plan

GIB = 1 << 30


def plan_summary(plan: ExecutionPlan) -> str:
    return "\n".join(_summary_lines(plan))


def gib(n_bytes: float) -> str:
    """Bytes as GiB, with enough digits to tell tiny models apart."""
    v = n_bytes / GIB
    return f"{v:.2f} GiB" if v >= 1 else f"{v:.3g} GiB"


def _role(plan: ExecutionPlan, m: ModelPlacement) -> str:
    spec = plan.run.model(m.name)
    if m.base_of is not None:
        return f"frozen: the base of `{m.base_of}`, its adapters off, no weights of its own"
    if spec is not None and spec.lora is not None:
        return f"trainable: LoRA r={spec.lora.r} adapters on a frozen base"
    return "trainable" if m.trainable else "frozen"


def _summary_lines(plan: ExecutionPlan) -> list[str]:
    dims = " ".join(f"{d.name}={d.value}" for d in plan.dims) or "(none bound)"
    lines = [f"plan for `{plan.name}` ({plan.source}): target {plan.target}, "
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
    lines += ["", _score_line(plan), "edges: " + _edge_counts(plan)]
    if plan.dropped:
        lines.append(f"dropped (dead): {', '.join(plan.dropped)}")
    lines += [f"rewritten: {r}" for r in plan.rewrites]
    return lines + _object_lines(plan) + _memory_lines(plan)


def _score_line(plan: ExecutionPlan) -> str:
    """Which scores the run reports as its score (`flowgraph.plan.score`)."""
    score = score_plan(plan.nodes)
    if score is None:
        return "score: none reported (no advantage node reads scores)"
    what = f"the sum per sequence of `{score.scores}`" if score.per_token \
        else f"`{score.scores}`"
    rewards = f"; rewards: `{score.rewards}` summed per sequence" \
        if score.rewards and not score.per_token else ""
    return f"score: {what}, the scores advantage `{score.advantage}` is computed from{rewards}"


def _object_lines(plan: ExecutionPlan) -> list[str]:
    """The Python objects the plan holds: who names each, where it is defined, and how
    it reaches the run's processes."""
    if not plan.objects:
        return []
    users = object_users(plan)
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
