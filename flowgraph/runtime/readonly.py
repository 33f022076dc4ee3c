"""A node's object inputs, read-only: the lists and dicts on an edge (`extra_info`, `row`,
`messages`) are shared by every node that reads them, as tensors are, so a node that
changed one in place would change what the next node sees.

A tensor input's writes are caught after the call (its version counter,
`Worker._unwritten`); a list or dict keeps no such counter, so the node gets it as a
`ReadOnlyList` / `ReadOnlyDict` (`freeze`): a list and a dict to every reader
(`isinstance`, `json`, `==`, `**`), whose writes raise `InputWritten` at the line that
wrote, which the node's error names. A copy is the node's own: `copy.copy`,
`copy.deepcopy`, `dict(x)`, `list(x)` and pickling give plain lists and dicts. What the
node returns is thawed (`thaw`): its outputs hold plain ones (a checkpoint's buffer
loads with `weights_only`).

Only lists and dicts are wrapped; other objects in them (a user's class) are passed as
they are.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn

FIX = "copy it first (`copy.deepcopy(x)`, `dict(x)`, `list(x)`) and change the copy"


class InputWritten(TypeError):
    """A node changed one of its object inputs in place."""


def _refuse(what: str) -> NoReturn:
    raise InputWritten(f"a node's inputs are read-only, and this {what} is one (or part of "
                       f"one): other nodes read the same object; {FIX}")


class ReadOnlyDict(dict[Any, Any]):
    """A dict a node received: reads as any dict; writes raise `InputWritten`."""

    def __setitem__(self, key: Any, value: Any) -> None:
        _refuse(f"dict (setting `{key}`)")

    def __delitem__(self, key: Any) -> None:
        _refuse(f"dict (deleting `{key}`)")

    def __ior__(self, other: Any) -> NoReturn:  # type: ignore[misc]
        _refuse("dict (`|=`)")

    def _write(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse("dict")

    update = setdefault = pop = popitem = clear = _write

    def copy(self) -> dict[Any, Any]:
        return dict(self)

    def __copy__(self) -> dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:
        return {copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


class ReadOnlyList(list[Any]):
    """A list a node received: reads as any list; writes raise `InputWritten`."""

    def __setitem__(self, index: Any, value: Any) -> None:
        _refuse("list (setting an item)")

    def __delitem__(self, index: Any) -> None:
        _refuse("list (deleting an item)")

    def __iadd__(self, other: Any) -> NoReturn:  # type: ignore[misc]
        _refuse("list (`+=`)")

    def __imul__(self, other: Any) -> NoReturn:  # type: ignore[misc]
        _refuse("list (`*=`)")

    def _write(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse("list")

    append = extend = insert = pop = remove = clear = sort = reverse = _write

    def copy(self) -> list[Any]:
        return list(self)

    def __copy__(self) -> list[Any]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return [copy.deepcopy(v, memo) for v in self]

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)


def freeze(value: Any) -> Any:
    """`value` with every list and dict in it read-only (new wrappers; `value` itself is
    left as it is)."""
    if type(value) is list or type(value) is ReadOnlyList:
        return ReadOnlyList(freeze(v) for v in value)
    if type(value) is dict or type(value) is ReadOnlyDict:
        return ReadOnlyDict((k, freeze(v)) for k, v in value.items())
    return value


def thaw(value: Any) -> Any:
    """`value` with every read-only list and dict in it plain again (a node's outputs, which
    may hold what it received)."""
    if isinstance(value, list):
        return [thaw(v) for v in value] if _holds_frozen(value) else value
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()} if _holds_frozen(value) else value
    return value


def _holds_frozen(value: Any) -> bool:
    """Whether `value` (a list or dict) is read-only or holds one, at any depth."""
    if isinstance(value, (ReadOnlyList, ReadOnlyDict)):
        return True
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(v, (list, dict)) and _holds_frozen(v) for v in items)
