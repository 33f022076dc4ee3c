"""Pass `fusion`: nodes that run one model over sequences of one batch run as one forward.

Offline DPO scores the chosen and the rejected responses of each pair with the frozen
reference: two `sequence_logprob` nodes on one model, the same prompts, two response
tensors of one shape. Run apart they are two forwards (two passes over the weights, two
kernel launches a layer, half-full micro-batches); fused they are one forward over the
rows of both stacked, each node's rows split back after. TRL concatenates chosen and
rejected for the same reason (`concatenated_forward`); the update does it inside
`dpo_update`. Two nodes computing exactly the same thing (one model, one kind, the same
inputs and params) become one forward over the rows once.

Nodes fuse when all of this holds, each read from the graph and the kinds:
- the kind runs its model's weights row by row (`KindSpec.row_wise_forward`): a row's
  outputs depend on its own inputs only;
- one kind, one model, the same params (defaults filled in), the same `hoisted` mark;
- each input port is read from the same producer node, and the producers' ports have
  the same dims past the batch axis (so the rows stack);
- the same output ports are read downstream (one call computes what each needs).

The plan lists a group on the node that runs it, the first of the group in the
schedule (`NodePlan.fused`, and `rewritten: fusion: …`); the executor runs that node
over the stacked rows and stores each node's rows as its outputs, and the others do
not run (their time counts in the first one's `timing_s`). A token budget or
`micro_batch_size` cuts the stacked rows like any batch; the numbers are those of the
nodes run apart (`tests/compilers/test_local.py`). `flowgraph compile --disable-pass
fusion` runs them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.ir import NodeSpec
from flowgraph.passes.program import Program


@dataclass(frozen=True, slots=True)
class FuseForwards:
    """Group the row-wise forwards of one model over one batch into one forward each."""

    name: ClassVar[str] = "fusion"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        groups: dict[tuple[object, ...], list[str]] = {}
        for node in program.graph.nodes:
            key = _key(node, program)
            if key is not None:
                groups.setdefault(key, []).append(node.name)
        fused = tuple(tuple(names) for names in groups.values() if len(names) > 1)
        if not fused:
            return program
        rewrites = []
        for names in fused:
            first = program.graph.node(names[0])
            assert first is not None
            rewrites.append(f"fusion: {', '.join(f'`{n}`' for n in names)} run as one forward "
                            f"of model `{first.model}` (kind {program.kind(first.name).name}), "
                            f"their rows stacked")
        return replace(program, fused=fused, rewrites=program.rewrites + tuple(rewrites))


def _key(node: NodeSpec, program: Program) -> tuple[object, ...] | None:
    """What two nodes must share to fuse; None for a node that cannot."""
    kind = program.kind(node.name)
    if not kind.row_wise_forward or node.model is None:
        return None
    assert program.check is not None
    shapes = program.check.shapes.outputs
    inputs = []
    for port, ref in sorted(node.inputs):
        shape = shapes.get((ref.node, ref.port))
        if shape is None or shape.variadic or None in shape.dims[1:]:
            return None  # rows whose width is not known cannot be proved to stack
        inputs.append((port, ref.node, repr(shape.dims[1:])))
    read = sorted({r.port for n in program.graph.nodes for _, r in n.inputs
                   if r.node == node.name})
    params = sorted(kind.param_values(node.params.to_python()).items())
    return (kind.name, node.model, node.hoisted, repr(params), tuple(inputs),
            tuple(read))
