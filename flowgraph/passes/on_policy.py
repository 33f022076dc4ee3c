"""Pass `on_policy`: on-policy elision of the old-log-prob forward.

PPO's ratio ρ = π_θ / π_old needs log π_old, the log-probs of the policy that sampled
the rollout, which a `logprob` node computes before the update. When the update takes
exactly one optimizer step on the rollout (one epoch, one mini-batch), the weights it
starts from *are* π_old, so that forward only repeats the update's own: the update can
use its own log-probs, detached, instead (ρ = 1 in value, the same gradient), as
TRL's GRPOTrainer and verl's actor do in that case. The pass unwires the input the
kind names for this (`KindSpec.on_policy_input`, PPO's `old_log_prob`); dead-node
elimination, which runs next, then drops the log-prob node.

It does so only when every condition holds, each read from the graph and the kinds:
- the update takes one optimizer step per call: `ppo_epochs` = 1 and `mini_batch_size`
  null or at least the update's batch;
- the input comes from a causal-LM node (category `model`, head `lm`) on the update's
  own model, at the update's `temperature`;
- the update's input is the only edge out of that node, so it no longer runs at all.

With dropout active in the trained model the two forwards would differ; the
built-in models have none. `flowgraph compile --disable on_policy` keeps the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.ir import NodeSpec, PortRef
from flowgraph.passes.program import Program
from flowgraph.runtime.update import one_optimizer_step


@dataclass(frozen=True, slots=True)
class ElideOldLogProb:
    """Skip the old-log-prob forward of an update taking one optimizer step per rollout."""

    name: ClassVar[str] = "on_policy"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        graph, rewrites = program.graph, []
        for node in graph.nodes:
            ref = _elidable(node, program)
            if ref is None:
                continue
            inputs = tuple((p, r) for p, r in node.inputs if r is not ref)
            graph = replace(graph, nodes=tuple(replace(n, inputs=inputs) if n is node else n
                                               for n in graph.nodes))
            rewrites.append(f"on_policy: `{node.name}` takes one optimizer step per rollout, "
                            f"so it uses its own log-probs as `{ref.node}.{ref.port}` "
                            f"(detached); `{ref.node}` does not run")
        if not rewrites:
            return program
        return replace(program, graph=graph, rewrites=program.rewrites + tuple(rewrites))


def _elidable(node: NodeSpec, program: Program) -> PortRef | None:
    """The input edge the pass may cut from `node`, or None."""
    kind = program.kind(node.name)
    ref = node.input(kind.on_policy_input) if kind.on_policy_input else None
    source = program.graph.node(ref.node) if ref is not None else None
    if ref is None or source is None:
        return None
    params = kind.param_values(node.params.to_python())
    if not one_optimizer_step(params, _batch(program, node.name)):
        return None
    source_kind = program.kind(source.name)
    if source_kind.category != "model" or source_kind.head != "lm" or source.model != node.model:
        return None
    source_params = source_kind.param_values(source.params.to_python())
    if source_params.get("temperature") != params.get("temperature"):
        return None
    edges = [(n.name, p) for n in program.graph.nodes for p, r in n.inputs if r.node == ref.node]
    return ref if edges == [(node.name, kind.on_policy_input)] else None


def _batch(program: Program, name: str) -> int | None:
    assert program.check is not None
    return program.check.shapes.batch.get(name)

