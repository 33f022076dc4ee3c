"""Pass `asynchronous`: rollouts that run ahead of the update (`trainer.max_staleness`).

With `trainer.max_staleness` S > 0 the step is cut at the rollout: a *producer* (the
data, the rollout, and every node that reads only them and runs no trained model — a
reward, a frozen reference, GRPO's advantage) and a *consumer* (the rest: log-probs of
the trained models, values, the updates), joined by a buffer of rollouts stamped with
the policy version that generated them. The producer of step k+S runs while the
consumer trains step k (`flowgraph.compilers.rollouts`); the plan records the cut
(`AsyncPlan`, built from `flowgraph.plan.producer_side` when the program is lowered).

With `trainer.old_log_prob: rollout` the pass also rewires the update's old log-probs
(`KindSpec.on_policy_input`) to the rollout's own `rollout_log_prob`, read where the
update's responses come from (the rollout, or a filter after it): π_old is then the
policy that sampled, and the old-log-prob forward, left unread, is dropped by
dead-node elimination. With `recompute` π_old is the actor when the rollout is
consumed, and on-policy elision still applies (that actor is the one the update
starts from).

`flowgraph compile --disable asynchronous` runs the graph synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.ir import NodeSpec, PortRef
from flowgraph.passes.program import Program


@dataclass(frozen=True, slots=True)
class SplitRollouts:
    """Cut the step into a producer running up to S steps ahead and a consumer."""

    name: ClassVar[str] = "asynchronous"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        trainer = program.graph.trainer
        if trainer.max_staleness < 1:
            return program
        rewrites = [f"asynchronous: the rollout runs up to {trainer.max_staleness} step(s) "
                    f"ahead of the update (admission {trainer.admission})"]
        graph = program.graph
        if trainer.old_log_prob == "rollout":
            nodes = []
            for node in graph.nodes:
                ref = _rollout_log_prob(node, program)
                if ref is None:
                    nodes.append(node)
                    continue
                port = program.kind(node.name).on_policy_input
                assert port  # `_rollout_log_prob` answers only for a node that has one
                inputs = (*((p, r) for p, r in node.inputs if p != port), (port, ref))
                nodes.append(replace(node, inputs=inputs))
                rewrites.append(f"asynchronous: `{node.name}` takes its old log-probs from "
                                f"`{ref}` (trainer.old_log_prob: rollout)")
            graph = replace(graph, nodes=tuple(nodes))
        return replace(program, graph=graph, asynchronous=True,
                       rewrites=program.rewrites + tuple(rewrites))


def _rollout_log_prob(node: NodeSpec, program: Program) -> PortRef | None:
    """Where `node`'s old log-probs come from under `old_log_prob: rollout`: the
    `rollout_log_prob` of the producer of its responses (the checker, FG122, holds the
    graph to having one); None for a node that reads no old log-probs."""
    kind = program.kind(node.name)
    responses = node.input("responses")
    if not kind.on_policy_input or responses is None:
        return None
    if program.kind(responses.node).output("rollout_log_prob") is None:
        return None
    return PortRef(responses.node, "rollout_log_prob")
