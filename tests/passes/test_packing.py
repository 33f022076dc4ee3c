"""Pass `packing` (flowgraph/passes/packing.py): forwards of a varlen attention run as one
row of valid tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgraph.passes import PassPipeline, compile_graph

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


@pytest.mark.parametrize(("overrides", "disabled", "packed"), [
    # the actor's attention is varlen: its log-prob and update forwards are packed
    (("models.actor.attn_implementation=flash_attention_2",), (), {"old_logprob", "update_actor"}),
    # a node that sets packing keeps its choice
    (("models.actor.attn_implementation=flash_attention_2",
      "nodes.update_actor.params.packing=false"), (), {"old_logprob"}),
    (("models.actor.attn_implementation=flash_attention_2",), ("packing",), set()),
    ((), (), set()),  # SDPA: one N x N mask would cost more than the padding
])
def test_packing_is_set_where_the_attention_is_varlen(
        overrides: tuple[str, ...], disabled: tuple[str, ...], packed: set[str]) -> None:
    result = compile_graph(GRAPHS / "ppo.yaml", overrides=overrides,
                           pipeline=PassPipeline.default(disabled=disabled))
    assert result.plan is not None and result.program is not None
    got = {n.name for n in result.program.graph.nodes if n.params.get("packing") is True}
    assert got == packed
    rewritten = [r for r in result.plan.rewrites if r.startswith("packing")]
    assert [r.split("`")[1] for r in rewritten] == sorted(packed, key=["old_logprob",
                                                                       "update_actor"].index)
    if packed:
        assert rewritten[0] == ("packing: `old_logprob` runs its forwards as one row of valid "
                                "tokens (flash_attention_2 on `actor` attends within each "
                                "sequence)")
