"""One declaration per graph-file setting, read by everything that needs it.

The IR records of the graph file's sections (`ModelSpec`, `OptimizerSpec`, `LoraSpec`,
`TrainerSpec`, `ResourceSpec`, `PoolSpec`) declare each field once, with its type,
default, doc, choices and bounds:

    grad_clip: float = setting(1.0, "Max global gradient norm; 0 disables clipping.",
                               minimum=0)

From that declaration come the YAML reader's key table and value checks
(`flowgraph.frontend`), the records' own invariants (`check_settings`, for records built
in Python), and the JSON Schema with its hover docs (`flowgraph schema`), as `KindSpec`
does for node kinds' params.
"""

from __future__ import annotations

import types
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

from flowgraph.errors import IRError

_KEY = "flowgraph.setting"
Written = tuple[type, ...]
"""The value types a graph file may write for a setting (int is not a float here)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """What a record field declares besides its name, type and default."""

    doc: str
    """Help text: the JSON Schema's description, shown by editors on hover."""
    choices: tuple[str, ...] = ()
    """The values it may take (each item's, for a list)."""
    minimum: float | None = None
    """The lowest value allowed."""
    above: float | None = None
    """A value must be greater than this."""
    below: float | None = None
    """A value must be less than this."""
    hint: str | None = None
    """The fix said under a value out of bounds."""
    written: Written = ()
    """The types a graph file writes it as, where they are not the field type's own
    (`resources.pools`: a mapping of names; `lora.target_modules`: a name or a list)."""

    def problem(self, value: object) -> str | None:
        """What is wrong with `value`, to follow its key (`is 0; it must be >= 1`); None if
        nothing is."""
        if self.choices:
            items = value if isinstance(value, tuple) else (value,)
            wrong = [v for v in items if v not in self.choices]
            if wrong:
                return f"is `{wrong[0]}`; it must be one of {', '.join(self.choices)}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if self.minimum is not None and value < self.minimum:
            return f"is {value}; it must be >= {_number(self.minimum)}"
        if self.above is not None and value <= self.above:
            return f"is {value}; it must be > {_number(self.above)}"
        if self.below is not None and value >= self.below:
            return f"is {value}; it must be < {_number(self.below)}"
        return None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def setting(default: Any = MISSING, doc: str = "", **facts: Any) -> Any:
    """A record field declared with its `Setting` (`doc`, `choices`, bounds, ...)."""
    metadata = {_KEY: Setting(doc, **facts)}
    if default is MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


@cache
def declared(record: type) -> tuple[tuple[Field[Any], Setting], ...]:
    """The record's settings, in declaration order (`name` and `pos` are not settings)."""
    return tuple((f, f.metadata[_KEY]) for f in fields(record) if _KEY in f.metadata)


@cache
def written_types(record: type) -> dict[str, Written]:
    """Each setting's key -> the value types a graph file may write for it."""
    hints = get_type_hints(record)
    return {f.name: s.written or _written(hints[f.name]) for f, s in declared(record)}


def _written(hint: Any) -> Written:
    """A mapping for a record or `Params`, a list for a tuple, null where None is allowed
    (but a missing record is written by leaving its key out)."""
    if get_origin(hint) in (Union, types.UnionType):
        inner = _written(next(a for a in get_args(hint) if a is not type(None)))
        return inner if inner == (dict,) else (*inner, type(None))
    if get_origin(hint) is tuple:
        return (list,)
    return (hint,) if hint in (int, float, str, bool) else (dict,)


def check_settings(record: object, where: str) -> None:
    """Raise `IRError` listing every setting of `record` (the section `where`) that its
    declaration does not allow: what the YAML reader reports at the value's line."""
    cls: type = type(record)
    problems = [f"{where}.{f.name} {problem}" for f, s in declared(cls)
                if (problem := s.problem(getattr(record, f.name))) is not None]
    if problems:
        raise IRError("; ".join(problems))
