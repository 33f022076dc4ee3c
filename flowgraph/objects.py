"""Python objects in a graph: functions and classes held by reference where users hold them.

A param may be a function or a class (`params={"fn": reward_len}`), and a `@node_kind`
may be declared in a script's `__main__` or a notebook cell. The graph holds such a
value as a `PyObject`: its `module:qualname` reference, what it is, and the object itself
in this process. A graph document writes it as the tagged mapping `{"$python": ref}` (a
`$` key is no param name); reading one back imports it by reference where that works.

A plan carries what it runs: `ExecutionPlan.objects` lists every object its params and
kinds name. An object a worker cannot import by reference (one of `__main__`, a notebook
cell, a local function or lambda) is *shipped by value*: pickled with cloudpickle (as Ray
does) on the run's own channels to its processes (`pickled` / `unpickled`), never into a
plan file a user writes or reads back, which records the references only. A plan file
whose objects cannot be rebuilt refuses to run (`unresolved_message`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flowgraph.errors import IRError

TAG = "$python"
"""The key of an object's mapping in a graph document: `{"$python": "module:qualname"}`."""
WHATS = ("function", "class")


@dataclass(frozen=True, slots=True)
class PyObject:
    """A function or class a graph names, held by reference (and, in this process, the
    object itself). Equality is the reference's: a graph read back equals the original."""

    ref: str
    """`module:qualname`, e.g. `__main__:reward_len`, `my_rewards:Judge`."""
    what: str = "function"
    """`function` or `class`."""
    obj: Any = field(default=None, compare=False, repr=False)
    """The object in this process; None where it could not be rebuilt from `ref`."""
    where: str = field(default="", compare=False)
    """Where it is defined (`file:line`), for messages and to rebuild a `__main__` one."""

    def __post_init__(self) -> None:
        module, colon, name = self.ref.partition(":")
        if not colon or not module or not name:
            raise IRError(f"Python object reference {self.ref!r} is not `module:qualname`")
        if self.what not in WHATS:
            raise IRError(f"Python object `{self.ref}`: what is {self.what!r}, not one of "
                          f"{', '.join(WHATS)}")

    @property
    def by_value(self) -> bool:
        """A worker cannot import it by reference: it travels pickled by value."""
        return by_value(self.ref)

    @property
    def shipped(self) -> str:
        return "by value" if self.by_value else "by reference"

    @property
    def resolved(self) -> bool:
        return self.obj is not None

    def document(self) -> dict[str, str]:
        """The tagged mapping a graph document holds."""
        return {TAG: self.ref}

    def with_object(self, obj: Any) -> PyObject:
        return PyObject(self.ref, self.what, obj, self.where or defined_at(obj))


def by_value(ref: str) -> bool:
    """Whether only this process can reach what `ref` (`module:qualname`) names: a script's
    or notebook's `__main__`, a local function, a lambda."""
    module, _, qualname = ref.partition(":")
    return module in ("__main__", "__mp_main__") or "<" in qualname


def of(value: object) -> PyObject | None:
    """`value` as a `PyObject` when it is a function or a class, else None."""
    if inspect.isclass(value):
        what = "class"
    elif inspect.isfunction(value) or inspect.isbuiltin(value) or _wraps_a_function(value):
        what = "function"
    else:
        return None
    module = getattr(value, "__module__", None) or "__main__"
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", "?")
    return PyObject(f"{module}:{qualname}", what, value, defined_at(value))


def _wraps_a_function(value: object) -> bool:
    """A callable object standing for the function it wraps, its name included (as a
    `functools.wraps` wrapper, or `flowgraph.tool`'s `Tool`): held as that function is."""
    wrapped = getattr(value, "__wrapped__", None)
    return callable(value) and inspect.isfunction(wrapped) and \
        getattr(value, "__qualname__", None) == wrapped.__qualname__


def defined_at(obj: object) -> str:
    """`file:line` of a function's or class's definition (a wrapper's: its function's),
    or `""` where Python cannot tell (a builtin; a class of a notebook cell)."""
    if not hasattr(obj, "__code__") and _wraps_a_function(obj):
        obj = obj.__wrapped__  # type: ignore[attr-defined]
    code = getattr(obj, "__code__", None)
    if code is not None:
        return f"{code.co_filename}:{code.co_firstlineno}"
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"  # type: ignore[arg-type]
    except (TypeError, OSError):
        return ""


def tagged(value: object) -> str | None:
    """The reference of a document's tagged mapping `{"$python": ref}`, else None."""
    ref = value.get(TAG) if isinstance(value, Mapping) and len(value) == 1 else None
    return ref if isinstance(ref, str) else None


def rebuilt(ref: str, what: str = "function", where: str = "") -> PyObject:
    """The object `ref` names, imported by reference where that works (`obj` None where
    not: see `unresolved_message`). A `__main__` reference is this process's `__main__`
    only when that is the user's session (a script, a notebook), never flowgraph's own
    command line, and the object found is the one named (and defined at `where`, when
    known): never a silent substitute."""
    obj = _find(ref)
    if obj is not None and where and by_value(ref) \
            and defined_at(obj) not in ("", where):
        obj = None
    return PyObject(ref, what, obj, where or (defined_at(obj) if obj is not None else ""))


def _find(ref: str) -> Any:
    module, _, qualname = ref.partition(":")
    if "<" in qualname:
        return None  # a local function or a lambda: no path reaches it
    if module == "__main__" and _main_is_flowgraph():
        return None
    try:
        obj: Any = sys.modules[module] if module == "__main__" else \
            importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, KeyError):
        return None
    except Exception:
        return None
    if module != "__main__":
        return obj  # the import path is the reference, an alias (`os.path:join`) included
    named = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
    return obj if named == ref else None  # another `__main__`'s object of that name: no


def _main_is_flowgraph() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and str(spec.name).startswith("flowgraph")


def unresolved_message(missing: list[tuple[PyObject, str]]) -> str:
    """Why a plan cannot run the objects of `missing` (each with who names it) in this
    process, and what to do."""
    parts = []
    for obj, owner in missing:
        module, _, name = obj.ref.partition(":")
        at = f", defined at {obj.where}" if obj.where else ""
        why = ("defined in the Python session that compiled the plan; a plan file records "
               "only its reference" if obj.by_value
               else f"module `{module}` cannot be imported here or has no `{name}`")
        parts.append(f"the Python {obj.what} `{obj.ref}` ({owner}{at}): {why}")
    return (f"cannot rebuild {'; '.join(parts)}. Run the plan from the Python session that "
            "defines it (`flowgraph.run(graph)` or `flowgraph.run(plan)` there), or move it "
            "into a module the graph lists under `plugins:`")


def pickled(objects: Mapping[str, Any]) -> bytes:
    """`ref -> object`, pickled for the run's own processes (cloudpickle: a `__main__`
    or local function travels by value, an importable one by reference)."""
    import cloudpickle

    return bytes(cloudpickle.dumps(dict(objects)))


def unpickled(data: bytes) -> dict[str, Any]:
    """What `pickled` wrote. Only ever called on bytes the run itself wrote on its own
    channel (its `run_dir/.ranks`, a pipe to its producer, a Ray actor's arguments)."""
    import pickle

    try:
        loaded = pickle.loads(data)  # the run's own channel, see above
    except Exception as exc:  # a module a by-reference object lives in, missing here
        raise IRError(f"the run's Python objects cannot be rebuilt in this process: "
                      f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise IRError(f"the run's Python objects are {type(loaded).__name__}, not a mapping")
    return loaded
