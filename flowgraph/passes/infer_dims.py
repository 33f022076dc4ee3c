"""Pass `infer_dims`: record the dims the checker bound, for the plan and the memory estimate.

Notation: B = Bp*N sequences, Bp prompts, N samples per prompt, P prompt length,
T response length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.dims import CANONICAL_DIMS
from flowgraph.passes.program import PortLabel, Program
from flowgraph.plan import DimValue


@dataclass(frozen=True, slots=True)
class InferDims:
    """Record every bound global dim (B = Bp*N too) and each output's resolved shape."""

    name: ClassVar[str] = "infer_dims"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        assert program.check is not None
        shapes = program.check.shapes
        env = shapes.env
        values = dict(env.values)
        # The checker keeps B as Bp*N; executors and the memory estimate want the number.
        if "Bp" in values and "N" in values:
            values.setdefault("B", values["Bp"] * values["N"])
        labels = tuple(PortLabel(f"{node}.{port}", env.label(s.dims, s.variadic))
                       for (node, port), s in shapes.outputs.items())
        return replace(program, dims=_ordered(values), labels=labels)


def _ordered(values: dict[str, int]) -> tuple[DimValue, ...]:
    """Canonical dims first (B, Bp, N, P, T, V), then the graph's own, by name."""
    rank = {name: i for i, name in enumerate(CANONICAL_DIMS)}
    names = sorted(values, key=lambda n: (rank.get(n, len(rank)), n))
    return tuple(DimValue(n, values[n]) for n in names)
