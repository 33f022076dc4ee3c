"""How far the trainer's log-probs of an agent rollout's tokens are from the sampler's,
per compute precision: the measurement behind `flowgraph.nodes.agent.TOLERANCE`.

For each model and mode (fp32; `autocast`: bf16 over fp32 weights, as `dtype: bfloat16`
trains; `pure`: a bf16 model), 12 steps of 32 episodes (8 rows x 4, up to 4 turns of 12
tokens, an env reply between turns) are rolled out and `check_rows` is asked for the
worst token with a tolerance of 0; the worst and the median over the steps are printed.

    python scripts/measure_sampler_tolerance.py builtin:tiny-lm,builtin:tiny-lm-calc \
        fp32 autocast pure
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager

import torch

import flowgraph.nodes.agent as agent_node
from flowgraph.agent import Env, Step
from flowgraph.errors import FlowgraphError
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.runtime.context import NodeContext

ROWS = [{"prompt": p} for p in ("reverse 123", "reverse 4567", "reverse 89", "add 3 4",
                                "the cat", "12+7=", "what is 6*7", "say hi")]


class Again(Env):
    """Replies `again` twice; the third answer ends the episode."""

    def reset(self, task):  # type: ignore[no-untyped-def]
        self.turn = 0
        return task["prompt"]

    def step(self, message):  # type: ignore[no-untyped-def]
        self.turn += 1
        return Step(["again"], reward=0.5, done=self.turn == 3)


def worst_of_a_step(model: torch.nn.Module, tok: object, seed: int) -> float:
    """The worst |trainer - sampler| log-prob of one step's trained tokens."""
    found = [0.0]
    check = agent_node.check_rows

    def measured(ctx, model, out, runs, temperature, atol=0.0):  # type: ignore[no-untyped-def]
        try:
            check(ctx, model, out, runs, temperature, atol=0.0)
        except FlowgraphError as exc:
            found[0] = float(str(exc).split(" by ")[1].split(" ")[0])

    agent_node.check_rows = measured
    agent_node._CHECKED.clear()
    try:
        ctx = NodeContext("agent", "agent_rollout", step=seed, seed=seed,
                          dims={"P": 16, "T": 64, "N": 4})
        agent_node.agent_rollout(ctx, model, tok, row=ROWS, env=Again, max_turns=4,
                                 max_turn_tokens=12, n=4)
    finally:
        agent_node.check_rows = check
    return found[0]


def precision(mode: str) -> AbstractContextManager[object]:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32")


def main() -> None:
    names, modes = sys.argv[1].split(","), sys.argv[2:]
    for name in names:
        model, tok = load_model(name), load_tokenizer(name)
        for mode in modes:
            model = model.to(torch.bfloat16 if mode == "pure" else torch.float32)
            with torch.no_grad(), precision(mode):
                worst = sorted(worst_of_a_step(model, tok, seed) for seed in range(12))
            print(f"{name} {mode}: worst {worst[-1]:.2e}, median {worst[6]:.2e} "
                  "(12 steps of 32 episodes)", flush=True)


if __name__ == "__main__":
    main()
