"""Pass `fusion` (flowgraph/passes/fusion.py): forwards of one model over one batch run as one,
and the plan's and the executor's checks of a fused group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from flowgraph.errors import PlanError
from flowgraph.kinds import BUILTIN_KINDS
from flowgraph.passes import PassPipeline, compile_graph
from flowgraph.plan import ExecutionPlan, plan_summary, verify, verify_kinds

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
PlanOf = Callable[..., ExecutionPlan]


@pytest.mark.parametrize(("overrides", "disabled", "fused"), [
    ((), (), ("ref_rejected",)),
    ((), ("fusion",), ()),
    (("nodes.ref_rejected.params.chunk_size=512",), (), ()),  # other params: apart
    # two nodes of one kind on one model, but one reads the chosen side's prompts from
    # another producer: they would not run at the same point of the plan
])
def test_fusion_groups_forwards_of_one_model_over_one_batch(plan_of: PlanOf,
        overrides: tuple[str, ...], disabled: tuple[str, ...], fused: tuple[str, ...]) -> None:
    result = compile_graph(GRAPHS / "dpo.yaml", overrides=overrides,
                           pipeline=PassPipeline.default(disabled=disabled))
    assert result.plan is not None
    assert result.plan.node("ref_chosen").fused == fused
    assert result.plan.node("ref_rejected").fused == ()
    rewritten = [r for r in result.plan.rewrites if r.startswith("fusion")]
    assert rewritten == ([] if not fused else [
        "fusion: `ref_chosen`, `ref_rejected` run as one forward of model `ref` (kind "
        "sequence_logprob), their rows stacked"])
    summary = plan_summary(result.plan)
    assert ("fused      ref_chosen + ref_rejected: one forward" in summary) == bool(fused)
    # the estimate counts the fused forward's 2 x Bp rows
    ref = next(i.bytes for m in result.plan.memory for i in m.items
               if i.what == "activations" and i.owner == "ref_chosen")
    apart = plan_of("dpo.yaml", pipeline=PassPipeline.default(disabled=("fusion",)))
    assert ref == (2 if fused else 1) * next(
        i.bytes for m in apart.memory for i in m.items
        if i.what == "activations" and i.owner == "ref_chosen")


def test_a_fused_node_of_another_kind_is_refused_in_a_plan(plan_of: PlanOf) -> None:
    plan = plan_of("ppo.yaml")
    nodes = tuple(replace(n, fused=("values",)) if n.name == "ref_logprob" else n
                  for n in plan.nodes)
    with pytest.raises(PlanError, match=r"node `ref_logprob` fuses `values`, which is not a "
                                         r"later node of its stage with its kind, model"):
        verify(replace(plan, nodes=nodes))


def test_a_fused_node_whose_kind_is_not_row_wise_is_refused_with_the_kinds(plan_of: PlanOf) -> None:
    """The executor resolves the kinds: a group on a kind whose rows cannot be stacked
    (here `sequence_logprob` redeclared as a `custom` kind) is refused before it runs."""
    plan = plan_of("dpo.yaml")
    kinds = {n.name: BUILTIN_KINDS[n.kind] for n in plan.nodes}
    kinds["ref_chosen"] = replace(kinds["ref_chosen"], category="custom")
    with pytest.raises(PlanError, match=r"node `ref_chosen` \(kind `sequence_logprob`\) fuses "
                                        r"`ref_rejected`, but its kind does not run its model "
                                        r"row by row"):
        verify_kinds(plan, kinds)
