"""Runtime strict mode: every tensor on every edge checked against its contract.

The compiler resolved each port's dims in global terms (`Bp*N T`) and wrote them into
the plan (`InputPlan.dims`, `OutputPlan.dims`); dims the graph left symbolic are bound
here from the first tensor that shows them, and must agree ever after. Dtype families
and value constraints (a mask is 0/1, log-probs are <= 0, no NaN) are checked on the
real values. A violation names the node, the edge, expected vs actual and the graph
file's line.

Notation: B sequences, Bp prompts, N samples per prompt, P prompt length, T response
length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flowgraph.contracts import TensorSpec
from flowgraph.dims import Poly, format_dims, parse_resolved
from flowgraph.errors import ContractViolation, at_step
from flowgraph.plan import ExecutionPlan, InputPlan

Dims = tuple[Poly | None, ...]


@dataclass
class RuntimeContracts:
    """Checks values against the contracts a plan resolved for its graph."""

    values: dict[str, int]
    """Global dims the plan binds."""
    ports: dict[tuple[str, str, bool], Dims | None]
    """(node, port, is an output) -> its axes in global terms; None: not resolved (only
    the rank, dtype and values are checked then)."""
    bound: dict[str, int] = field(default_factory=dict)
    """Global dims bound from real tensors (those `dims:` left open)."""

    @staticmethod
    def of(plan: ExecutionPlan) -> RuntimeContracts:
        ports: dict[tuple[str, str, bool], Dims | None] = {}
        for n in plan.nodes:
            for i in n.inputs:
                ports[(n.name, i.port, False)] = None if i.dims is None else parse_resolved(i.dims)
            for o in n.outputs:
                ports[(n.name, o.port, True)] = None if o.dims is None else parse_resolved(o.dims)
        return RuntimeContracts({d.name: d.value for d in plan.dims}, ports)

    def expected_dims(self, node: str, port: str, output: bool, spec: TensorSpec) -> Dims:
        dims = self.ports.get((node, port, output))
        return dims if dims is not None else (None,) * len(spec.shape.fixed_axes())

    def check_edge(self, wired: InputPlan, node: str, spec: TensorSpec, value: Any,
                   step: int) -> None:
        """Raise `ContractViolation` unless `value` honours the input port's contract."""
        port = wired.port
        where = f"edge `{wired.src} -> {node}.{port}` ({wired.where}) {at_step(step)}"
        problem = self._problem(self.expected_dims(node, port, False, spec), spec, value)
        if problem is not None:
            raise ContractViolation(f"{where}: {problem}; the contract is {spec.describe()}")

    def check_output(self, node: str, port: str, spec: TensorSpec, value: Any, step: int,
                     pos: str) -> None:
        """Raise `ContractViolation` unless a node's output honours its declared contract."""
        problem = self._problem(self.expected_dims(node, port, True, spec), spec, value)
        if problem is not None:
            raise ContractViolation(f"output `{node}.{port}` ({pos}) {at_step(step)}: {problem}; "
                                    f"the kind declares {spec.describe()}")

    def _problem(self, want: Dims, spec: TensorSpec, value: Any) -> str | None:
        rows = {"str", "object"} & spec.dtypes
        if spec.dtype in ("str", "object") or (rows and isinstance(value, list)):
            return self._list_problem(want, spec, value)
        shape = getattr(value, "shape", None)
        if shape is None:
            return f"expected a tensor, got {type(value).__name__}"
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in spec.dtypes:
            return f"dtype is {dtype}, expected {spec.dtype}"
        problem = self._shape_problem(want, spec, tuple(int(s) for s in shape))
        return problem or constraint_problem(spec.constraints, value)

    def _list_problem(self, want: Dims, spec: TensorSpec, value: Any) -> str | None:
        what = "strings" if spec.dtype == "str" else "values, one per row"
        if not isinstance(value, Sequence) or isinstance(value, str):
            return f"expected a list of {what}, got {type(value).__name__}"
        if spec.dtype == "str" and not all(isinstance(v, str) for v in value):
            wrong = next(v for v in value if not isinstance(v, str))
            return f"expected a list of strings, got a {type(wrong).__name__} in it"
        return self._shape_problem(want, spec, (len(value),))

    def _shape_problem(self, want: Dims, spec: TensorSpec, actual: tuple[int, ...]
                       ) -> str | None:
        variadic = spec.shape.variadic
        if len(actual) != len(want) and not (variadic and len(actual) >= len(want)):
            return f"shape is {actual}, expected {len(want)} axes {self._show(want)}"
        tail = actual[len(actual) - len(want):] if want else ()
        for i, (w, a) in enumerate(zip(want, tail, strict=True)):
            problem = self._axis_problem(w, a)
            if problem is not None:
                return f"shape is {actual}, expected {self._show(want)}: axis {i + 1} {problem}"
        return None

    def _axis_problem(self, want: Poly | None, actual: int) -> str | None:
        if want is None:
            return None
        known = {k: Poly.const(v) for k, v in {**self.values, **self.bound}.items()}
        value = want.subs(known)
        if value.is_const():
            got = value.const_value()
            return None if got == actual else f"is {actual}, expected {want} = {got}"
        free = sorted(value.symbols())
        sol = value.linear_in(free[0]) if len(free) == 1 else None
        if sol is None or sol[0] != 1:
            return None  # not determined by one axis; the other edges pin it down
        self.bound[free[0]] = actual - sol[1].const_value()
        return None

    def _show(self, dims: Dims) -> str:
        """`(Bp*N, T) = (16, 8)` where the plan binds every dim, else `(Bp*N, T)`."""
        known = {k: Poly.const(v) for k, v in self.values.items()}
        nums = tuple(d.subs(known) if d is not None else None for d in dims)
        text = format_dims(dims)
        if all(n is None or n.is_const() for n in nums) and nums != dims:
            return f"{text} = {format_dims(nums)}"
        return text


def constraint_problem(constraints: tuple[str, ...], value: Any) -> str | None:
    if not constraints or value.numel() == 0:
        return None
    import torch

    x = value.detach()
    checks = {
        "binary": lambda: bool(((x == 0) | (x == 1)).all()),
        "finite": lambda: bool(torch.isfinite(x).all()) if x.is_floating_point() else True,
        "nonpositive": lambda: bool((x <= 1e-6).all()),
        "nonnegative": lambda: bool((x >= -1e-6).all()),
        "probability": lambda: bool(((x >= 0) & (x <= 1)).all()),
    }
    # `finite` first: a NaN would otherwise be reported as breaking `nonpositive`.
    for name in sorted(constraints, key=lambda c: c != "finite"):
        if not checks[name]():
            return f"values break `{name}` (min {x.min().item():.4g}, max {x.max().item():.4g})"
    return None
