"""Tensor contracts: what a port promises or requires.

A `TensorSpec` is a shape in jaxtyping's dim grammar, a dtype family and value
constraints. Built-in kinds declare them as plain strings, so checking a graph never
imports torch. A custom node annotated with jaxtyping (`Float[Tensor, "b T"]`) gets
its spec from the annotation (`spec_from_annotation`), read by duck typing.

Notation: B sequences, Bp prompts, N samples per prompt, P prompt length,
T response length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowgraph.dims import Shape
from flowgraph.errors import RegistryError

DTYPE_FAMILIES: dict[str, frozenset[str]] = {
    "float": frozenset({"float16", "bfloat16", "float32", "float64"}),
    "int": frozenset({"int8", "int16", "int32", "int64", "uint8"}),
    "bool": frozenset({"bool"}),
    "str": frozenset({"str"}),
    "object": frozenset({"object"}),
    "mask": frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "float32"}),
}
"""Families a port may name; a concrete dtype (`int64`) names just itself. `str` and
`object` ports carry a Python list with one value per row (a string; any value, such as
verl's `extra_info` dicts) instead of a tensor."""

MASK_DTYPE = "int"
"""The one dtype a mask is given in: every built-in's mask output (the data's, generate's,
an agent's, a filter's) is an int64 0/1 tensor, `int {binary}`. A built-in takes one as
`mask {binary}` (any 0/1 tensor); a custom kind annotates it `Int[Tensor, "b T"]`, or
`Bool[Tensor, "b T"]` to get it as bool (`TensorSpec.converts`)."""

ROW_DTYPES = frozenset({"str", "object"})
"""Dtypes of ports that carry a Python list, one value per row."""

ALL_DTYPES: frozenset[str] = frozenset().union(*DTYPE_FAMILIES.values())

CONSTRAINTS: dict[str, str] = {
    "binary": "every value is 0 or 1 (a mask)",
    "finite": "no NaN or infinity",
    "nonpositive": "every value is <= 0 (a log-probability)",
    "nonnegative": "every value is >= 0",
    "probability": "every value is in [0, 1]",
}
"""Value constraints, checked on real tensors by the runtime's strict mode."""


def dtype_set(name: str) -> frozenset[str]:
    """The concrete dtypes a dtype name admits; `any` admits all."""
    if name == "any":
        return ALL_DTYPES
    if name in DTYPE_FAMILIES:
        return DTYPE_FAMILIES[name]
    if name in ALL_DTYPES:
        return frozenset({name})
    known = ", ".join(sorted({"any", *DTYPE_FAMILIES, *ALL_DTYPES}))
    raise RegistryError(f"unknown dtype `{name}`; known: {known}")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """The contract of one port."""

    dims: str
    """Dim string in jaxtyping grammar, e.g. `"b T"`; `""` is a scalar."""
    dtype: str = "float"
    """A family (`float`, `int`, `bool`, `str`, `object`, `mask`), a concrete dtype, or
    `any`."""
    constraints: tuple[str, ...] = ()
    """Names from `CONSTRAINTS` that every value satisfies (outputs) or must (inputs)."""
    shape: Shape = field(init=False, compare=False, repr=False)
    """The parsed dim string."""

    def __post_init__(self) -> None:
        dtype_set(self.dtype)
        unknown = [c for c in self.constraints if c not in CONSTRAINTS]
        if unknown:
            raise RegistryError(
                f"unknown constraint(s) {unknown}; known: {', '.join(CONSTRAINTS)}"
            )
        object.__setattr__(self, "shape", Shape.parse(self.dims))

    @property
    def dtypes(self) -> frozenset[str]:
        return dtype_set(self.dtype)

    def accepts_dtype(self, produced: TensorSpec) -> bool:
        """Every dtype the producer may give is one this port takes. Per-row values
        (`str`, `object`) meet each other: what a dataset's column holds is known when
        it is read, and strict mode checks a `str` port's every value then."""
        if produced.dtypes | self.dtypes <= ROW_DTYPES:
            return True
        return produced.dtypes <= self.dtypes or self.converts(produced)

    def converts(self, produced: TensorSpec) -> bool:
        """A 0/1 mask (`binary`) reaching a port that takes bool: the node gets it as bool
        (the executor converts it; every value is 0 or 1, so nothing is lost)."""
        return "binary" in produced.constraints and self.dtype == "bool"

    def describe(self) -> str:
        extra = f" {{{', '.join(self.constraints)}}}" if self.constraints else ""
        return f"{self.dtype}[{self.dims}]{extra}"


def spec_from_annotation(annotation: Any, constraints: tuple[str, ...] = ()) -> TensorSpec | None:
    """Read a jaxtyping annotation (`Float[Tensor, "b T"]`); None if it is not one.

    jaxtyping array types carry `dim_str` and `dtypes`; reading them by name keeps
    this module free of a jaxtyping import.
    """
    dim_str = getattr(annotation, "dim_str", None)
    dtypes = getattr(annotation, "dtypes", None)
    if not isinstance(dim_str, str) or dtypes is None:
        return None
    try:
        names = frozenset(str(d) for d in dtypes)
    except TypeError:  # jaxtyping's Shaped carries a non-iterable "any dtype" marker
        names = frozenset()
    return TensorSpec(dim_str, _family(names), constraints)


def _family(dtypes: frozenset[str]) -> str:
    """The narrowest dtype family covering jaxtyping's dtype names."""
    if not dtypes:
        return "any"
    if all(d in ("bool", "bool_") for d in dtypes):
        return "bool"
    if all(d.startswith(("int", "uint")) for d in dtypes):
        return "int"
    if all(d.startswith(("float", "bfloat")) for d in dtypes):
        return "float"
    return "any"
