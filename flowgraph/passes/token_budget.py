"""Pass `token_budget`: micro-batches cut by tokens instead of rows.

A node with `micro_batch_size: m` runs m rows per forward, each padded to P + T
tokens, whatever the responses' lengths: the memory it needs is that of m full-length
rows. The pass gives it the token budget of those rows instead, `max_token_len` =
m × sequences per row × (P + T) (verl's `use_dynamic_bsz`), with `micro_batch_size`
null: a micro-batch then takes consecutive rows while rows × (longest prompt + longest
response) fits (`flowgraph.nodes.logprob.micro_batches`), so short responses share a
forward and never more memory is used than the row count allowed. Forwards give the
same outputs; an update's loss weights keep its step the one-shot step, so the numbers
do not move (token-level metrics such as clip fractions are weighted by the loss
denominators, exact for token-mean).

It rewrites a node only when its kind takes both params, `micro_batch_size` is set and
smaller than the node's batch, `max_token_len` is not, and P and T are known.
`flowgraph compile --disable-pass token_budget` keeps the row counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.frontend import with_params
from flowgraph.passes.program import Program


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """Turn row-count micro-batches into the token budget of the same rows."""

    name: ClassVar[str] = "token_budget"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        assert program.check is not None
        env = program.check.shapes.env.values
        P, T = env.get("P"), env.get("T")
        if P is None or T is None:
            return program
        nodes, rewrites = [], []
        for node in program.graph.nodes:
            kind = program.kind(node.name)
            params = kind.param_values(node.params.to_python())
            micro, rows = params.get("micro_batch_size"), program.check.shapes.batch.get(node.name)
            if (kind.param("max_token_len") is None or params.get("max_token_len") is not None
                    or not isinstance(micro, int) or rows is None or micro >= rows):
                nodes.append(node)
                continue
            budget = micro * kind.sequences_per_row * (P + T)
            nodes.append(with_params(node, micro_batch_size=None, max_token_len=budget))
            rewrites.append(f"token_budget: `{node.name}` micro_batch_size {micro} -> "
                            f"max_token_len {budget} (the tokens of {micro} full-length rows)")
        if not rewrites:
            return program
        return replace(program, graph=replace(program.graph, nodes=tuple(nodes)),
                       rewrites=program.rewrites + tuple(rewrites))
