"""Pass `on_policy` (flowgraph/passes/on_policy.py): the old-log-prob forward of an update
that takes one optimizer step is elided."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flowgraph.passes import PassPipeline
from flowgraph.plan import ExecutionPlan, plan_summary

PlanOf = Callable[..., ExecutionPlan]


# --- on_policy -------------------------------------------------------------------------------

ONE_STEP = ["nodes.update_actor.params.mini_batch_size=null"]
"""GRPO's update on its whole batch in one optimizer step: π_old is the policy it starts from."""


@pytest.mark.parametrize(("overrides", "elided"), [
    (ONE_STEP, True),
    ([], False),  # mini_batch_size 8 of 16: two optimizer steps, the second off-policy
    ([*ONE_STEP, "nodes.update_actor.params.ppo_epochs=2"], False),
    ([*ONE_STEP, "nodes.update_actor.params.mini_batch_size=16"], True),  # = the batch
    ([*ONE_STEP, "nodes.old_logprob.params.temperature=0.7"], False),  # another distribution
])
def test_on_policy_elides_the_old_log_prob_forward_of_one_step_updates(plan_of: PlanOf,
        overrides: list[str], elided: bool) -> None:
    plan = plan_of("grpo.yaml", overrides=overrides)
    update = plan.node("update_actor")
    assert ("old_log_prob" not in dict(update.wiring())) == elided
    assert ("old_logprob" in plan.dropped) == elided
    assert [r.split(":")[0] for r in plan.rewrites] == (["on_policy"] if elided else [])
    if elided:
        assert "rewritten: on_policy: `update_actor` takes one optimizer step" in plan_summary(plan)


def test_on_policy_keeps_a_forward_another_node_reads(plan_of: PlanOf) -> None:
    # PPO's kl_penalty reads old_logprob.log_prob too: the forward runs anyway.
    plan = plan_of("ppo.yaml", overrides=["nodes.update_actor.params.mini_batch_size=null"])
    assert plan.rewrites == () and "old_logprob" not in plan.dropped


def test_on_policy_can_be_disabled_by_name(plan_of: PlanOf) -> None:
    plan = plan_of("grpo.yaml", overrides=ONE_STEP,
                   pipeline=PassPipeline.default(disabled=("on_policy",)))
    assert plan.rewrites == () and "old_logprob" in {n.name for n in plan.nodes}
