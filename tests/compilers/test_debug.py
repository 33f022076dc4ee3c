"""`flowgraph.debug` (issue #26, point 5): run one node, or the graph up to a node, on one
batch from Python and get its outputs — on the local target's own interpreter."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import flowgraph
from flowgraph.errors import ContractViolation, UsageError

GRPO = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"
SMALL = ("models.actor.path=builtin:tiny-lm", "models.ref.path=builtin:tiny-lm", "dims.Bp=2",
         "dims.N=2", "nodes.update_actor.params.mini_batch_size=4")


def test_run_until_a_node_and_run_it_again_with_inputs_of_your_own() -> None:
    dbg = flowgraph.debug(GRPO, overrides=SMALL, out=io.StringIO())
    out = dbg.run_until("reward")
    # the batch, and the nodes the reward reads from; no log-prob, advantage or update
    assert set(out) == {"train", "gen", "reward"}
    assert out["train"]["input_ids"].shape == (2, 16)  # Bp prompts of P tokens
    assert out["gen"]["responses"].shape == (4, 8)  # Bp*N responses of T tokens
    assert out["reward"]["scores"].shape == (4,)
    # GRPO's advantage on scores of our own: the groups (index) are the batch's, N = 2
    # per prompt; (1, 0) in a group normalise to +-(0.5 / std) = +-0.7071 (std unbiased)
    adv = dbg.run_node("adv", inputs={"scores": torch.tensor([1.0, 0.0, 1.0, 0.0])})
    first = adv["advantages"][:, 0]  # every response has its first token
    assert first.tolist() == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-3)
    with pytest.raises(ContractViolation, match=r"edge `reward.scores -> adv.scores`"):
        dbg.run_node("adv", inputs={"scores": torch.zeros(3)})
    with pytest.raises(UsageError, match=r"no input `score`; did you mean `scores`\?"):
        dbg.run_node("adv", inputs={"score": torch.zeros(4)})
    with pytest.raises(UsageError, match=r"no node `rewrd`; did you mean `reward`\?"):
        dbg.run_until("rewrd")
