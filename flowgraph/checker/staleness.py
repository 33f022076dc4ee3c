"""Asynchronous rollouts (`trainer.max_staleness` S > 0): what the graph must offer.

With S > 0 the rollout of step k may come from the policy S updates behind the one
that trains on it. The checker holds the graph to what that needs:

- FG120 (error): S > 0 in a graph with no rollout node (nothing to run ahead);
- FG121 (warning): an update of the rollout's model that takes more than one
  optimizer step per rollout (ppo_epochs > 1, or mini-batches smaller than its
  batch): every extra step moves the policy further from the one that sampled, so
  staleness compounds (AReaL and verl's fully-async recipe take one step per rollout);
- FG122 (error): `trainer.old_log_prob: rollout` where no update reads old log-probs,
  or where the rollout (or filter) its responses come from has no `rollout_log_prob`;
- FG124 (error): `trainer.partial_rollouts` without S > 0 (no update lands during a
  rollout), or with a rollout that cannot take new weights mid-rollout (a kind without
  a `policy_version` output: `generate` samples each response in one go).
"""

from __future__ import annotations

from flowgraph.checker.shapes import ShapeResult
from flowgraph.checker.structure import Resolved
from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.ir import Graph, NodeSpec
from flowgraph.runtime.update import one_optimizer_step


def check_staleness(graph: Graph, table: dict[str, Resolved], shapes: ShapeResult,
                    out: list[Diagnostic]) -> None:
    trainer = graph.trainer
    rollouts = {name: r for name, r in table.items()
                if r.kind is not None and r.kind.category == "rollout"
                and isinstance(r.spec, NodeSpec)}
    if trainer.partial_rollouts:
        _check_partial(graph, rollouts, out)
    if trainer.max_staleness < 1:
        return
    if not rollouts:
        out.append(error(
            "FG120", f"trainer.max_staleness is {trainer.max_staleness}, but the graph has no "
            "rollout node to run ahead of the update", trainer.pos,
            hint="asynchronous rollouts overlap generation with training; an offline graph "
                 "(DPO, SFT) has none: set trainer.max_staleness: 0"))
        return
    actors = {r.spec.model for r in rollouts.values() if isinstance(r.spec, NodeSpec)}
    readers = []
    for r in table.values():
        if r.kind is None or not r.kind.trains or not isinstance(r.spec, NodeSpec) \
                or r.spec.model not in actors:
            continue
        params = r.kind.param_values(r.spec.params.to_python())
        if r.kind.param("ppo_epochs") is not None \
                and not one_optimizer_step(params, shapes.batch.get(r.name)):
            out.append(warning(
                "FG121", f"`{r.name}` takes more than one optimizer step per rollout "
                f"(ppo_epochs {params.get('ppo_epochs')}, mini_batch_size "
                f"{params.get('mini_batch_size')}) under trainer.max_staleness "
                f"{trainer.max_staleness}: each step moves the policy further from the one "
                "that sampled, so staleness compounds", r.pos, node=r.name,
                hint=f"take one step per rollout (nodes.{r.name}.params.ppo_epochs: 1, "
                     "mini_batch_size: null), or weigh the rollout's tokens by their "
                     "staleness (rollout_is: token)"))
        if r.kind.on_policy_input:
            readers.append(r)
    if trainer.old_log_prob == "rollout":
        _check_rollout_log_prob(graph, table, readers, out)


def _check_rollout_log_prob(graph: Graph, table: dict[str, Resolved], readers: list[Resolved],
                            out: list[Diagnostic]) -> None:
    if not readers:
        out.append(error(
            "FG122", "trainer.old_log_prob is `rollout`, but no update of the rollout's model "
            "reads old log-probs", graph.trainer.pos,
            hint="only a PPO-style update (ppo_actor_update) has an old policy to take from "
                 "the rollout; use trainer.old_log_prob: recompute"))
        return
    for r in readers:
        assert isinstance(r.spec, NodeSpec)
        ref = r.spec.input("responses")
        source = table.get(ref.node) if ref is not None else None
        if source is None or source.kind is None \
                or source.kind.output("rollout_log_prob") is None:
            out.append(error(
                "FG122", f"trainer.old_log_prob is `rollout`, but `{r.name}`'s responses come "
                f"from `{ref.node if ref else '?'}`, which has no output `rollout_log_prob`",
                r.pos, node=r.name,
                hint="wire the update's responses from a generate node (or a filter after "
                     "one), or use trainer.old_log_prob: recompute"))


def _check_partial(graph: Graph, rollouts: dict[str, Resolved], out: list[Diagnostic]) -> None:
    trainer = graph.trainer
    if trainer.max_staleness < 1:
        out.append(error(
            "FG124", "trainer.partial_rollouts is true, but trainer.max_staleness is 0: no "
            "update lands while a rollout runs, so no episode outlasts one", trainer.pos,
            hint="partial rollouts go with asynchronous ones: set trainer.max_staleness: 1 "
                 "(or more), or leave partial_rollouts out"))
    for name, r in rollouts.items():
        assert r.kind is not None
        if r.kind.output("policy_version") is None:
            out.append(error(
                "FG124", f"trainer.partial_rollouts is true, but `{name}` (kind "
                f"{r.kind.name}) samples each response in one go: it cannot take new "
                "weights mid-rollout nor say which version sampled a token", r.pos, node=name,
                hint="partial rollouts continue multi-turn episodes between turns: use an "
                     "agent_rollout, or leave partial_rollouts out"))
