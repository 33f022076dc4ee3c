"""Pass `packing`: forwards without pad tokens where the attention is varlen.

A padded forward computes every pad token of its micro-batch: rows × (longest prompt +
longest response) tokens, however short most responses are. With `packing: true` a
node runs each forward as one row of the valid tokens only, each sequence's position
ids restarting at 0 and no attention mask (verl's `use_remove_padding`); transformers
finds the sequences from the position ids, and flash-attention's varlen kernel attends
within each one. A token budget (`max_token_len`, pass `token_budget`) then counts
valid tokens, so more short rows share a forward within the same memory. The numbers
are the padded run's (`tests/nodes/test_logprob.py`, `tests/compilers/test_local.py`).

The pass sets `packing: true` on every node whose kind takes the param, that runs a
model with varlen attention (`VARLEN_ATTENTION`: flash_attention_2), and that does not
set `packing` itself. SDPA and eager attention would see one N × N block-diagonal mask
instead — more work than the padding it saves — so they are left padded unless a node
asks (which the checker warns about). `flowgraph compile --disable-pass packing` keeps
every forward padded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.choices import VARLEN_ATTENTION
from flowgraph.frontend import with_params
from flowgraph.passes.program import Program


@dataclass(frozen=True, slots=True)
class PackSequences:
    """Turn on packing for the forwards of models whose attention is varlen."""

    name: ClassVar[str] = "packing"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        nodes, rewrites = [], []
        for node in program.graph.nodes:
            model = program.graph.model(node.model) if node.model else None
            if (program.kind(node.name).param("packing") is None or model is None
                    or model.attn_implementation not in VARLEN_ATTENTION
                    or node.params.find("packing") is not None):
                nodes.append(node)
                continue
            nodes.append(with_params(node, packing=True))
            rewrites.append(f"packing: `{node.name}` runs its forwards as one row of valid "
                            f"tokens ({model.attn_implementation} on `{model.name}` attends "
                            f"within each sequence)")
        if not rewrites:
            return program
        return replace(program, graph=replace(program.graph, nodes=tuple(nodes)),
                       rewrites=program.rewrites + tuple(rewrites))
