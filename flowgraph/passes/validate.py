"""Pass `validate`: the checker, as the first pass; any error stops the pipeline."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from flowgraph.checker import check_graph
from flowgraph.passes.program import Program


@dataclass(frozen=True, slots=True)
class Validate:
    """Check structure, edge contracts, dims and batch arithmetic (`flowgraph check`)."""

    name: ClassVar[str] = "validate"
    requires: ClassVar[tuple[str, ...]] = ()

    def apply(self, program: Program) -> Program:
        # Batch arithmetic is checked for the data-parallel sizes the plan will use.
        result = check_graph(program.graph, dp=program.nproc, target=program.target)
        return replace(program, check=result).add(*result.diagnostics)
