"""Tools an episode may call: a typed function with a Google-style docstring, as a `Tool`.

    @flowgraph.tool
    def multiply(a: int, b: int) -> int:
        '''Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        '''
        return a * b

The policy sees `multiply.schema()` (the dict `transformers.utils.get_json_schema` gives,
in the chat template's tools list) and calls it by name with JSON arguments; the rollout
checks them (`Tool.check_arguments`) and runs `fn`: a sync one in a thread pool, an
async one on the episode's event loop, each under its timeout (`timeout_s`, else the
node's `tool_timeout_s`).

A `@tool` on a method of an `Env` subclass is bound per episode: `tools_of(env)` gives
it with `self` the episode's env (its sandbox, its counter); `self` is not in the schema.

No torch and no transformers here: `flowgraph check` imports environments and tools to
build their schemas (`flowgraph.agent.schema`).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, overload

from flowgraph.agent.schema import argument_problem, function_schema, json_type
from flowgraph.errors import ToolSchemaError
from flowgraph.objects import by_value, defined_at

__all__ = ["Tool", "ToolSchemaError", "as_tool", "tool", "tools_of"]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a tool may be called: the function-name rule of the OpenAI tools API, which chat
templates and parsers assume (a space or a quote would break a Hermes call)."""


@dataclass(frozen=True)
class Tool:
    """A function the policy may call, with the JSON schema it is shown.

    Like a `functools.wraps` wrapper, a Tool carries its function's `__module__`,
    `__qualname__`, `__name__`, `__doc__` and `__wrapped__` (hence no slots): a graph
    holds a decorated function by its `module:qualname`, as it holds a plain one
    (`flowgraph.objects`)."""

    name: str
    """What the policy calls it (the function's name, unless given)."""
    description: str
    """What it does: the docstring's text before `Args:`."""
    parameters: dict[str, Any] = field(hash=False)
    """A JSON schema object: `{"type": "object", "properties": {...}, "required": [...]}`."""
    fn: Callable[..., Any]
    """What runs: sync or async; called with the arguments as keywords."""
    timeout_s: float | None = None
    """Seconds one call may take; None: the rollout node's `tool_timeout_s`."""
    returns: dict[str, Any] | None = field(default=None, hash=False)
    """The schema's `return` entry (transformers writes it for an annotated return; most
    chat templates ignore it); None when fn's return is not annotated."""
    receiver: bool = False
    """fn is a method whose `self` is not bound yet: `bind` it (tools_of does, per episode)."""

    def __post_init__(self) -> None:
        where = self._where()
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ToolSchemaError(f"tool {self.name!r}{where}: a tool's name is 1 to 64 "
                                  "letters, digits, `_`, `.` or `-`; give one "
                                  "(@tool(name=...))")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ToolSchemaError(f"tool `{self.name}`{where}: parameters must be a JSON "
                                  'schema object ({"type": "object", "properties": ...}), '
                                  f"got {self.parameters!r}")
        if not callable(self.fn):
            raise ToolSchemaError(f"tool `{self.name}`{where}: fn {self.fn!r} is not callable")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)
                              or not math.isfinite(t) or t <= 0):
            raise ToolSchemaError(f"tool `{self.name}`{where}: timeout_s={t!r} is not a "
                                  "positive, finite number of seconds; give one "
                                  "(timeout_s=10) or leave it None for the node's "
                                  "tool_timeout_s")
        for attr in ("__module__", "__qualname__", "__name__", "__doc__"):
            if hasattr(self.fn, attr):
                object.__setattr__(self, attr, getattr(self.fn, attr))
        object.__setattr__(self, "__wrapped__", self.fn)

    def _where(self) -> str:
        at = defined_at(self.fn)
        return f" ({at})" if at else ""

    def schema(self) -> dict[str, Any]:
        """`{"type": "function", "function": {"name", "description", "parameters"}}`, as
        `transformers.utils.get_json_schema` gives it and chat templates take it."""
        out: dict[str, Any] = {"name": self.name, "description": self.description,
                               "parameters": _copied(self.parameters)}
        if self.returns is not None:
            out["return"] = _copied(self.returns)
        return {"type": "function", "function": out}

    @property
    def is_async(self) -> bool:
        """fn is a coroutine function: the rollout awaits it instead of using a thread."""
        return inspect.iscoroutinefunction(self.fn)

    def bind(self, instance: object) -> Tool:
        """This tool with `self` bound to `instance` (a method tool; others as they are)."""
        if not self.receiver:
            return self
        return replace(self, fn=types.MethodType(self.fn, instance), receiver=False)

    def __get__(self, instance: object, owner: type | None = None) -> Tool:
        # `env.guess` is the tool bound to env, as a plain method would be.
        return self if instance is None else self.bind(instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call fn (a coroutine for an async tool): a decorated function still works."""
        if self.receiver:
            raise TypeError(f"tool `{self.name}`{self._where()} is a method: call it on an "
                            f"instance (env.{self.name}(...)) or bind it first")
        return self.fn(*args, **kwargs)

    def check_arguments(self, arguments: object) -> str | None:
        """What is wrong with a call's arguments, as the model will read it in the tool's
        reply (a required one missing, an unknown key, a wrong JSON type); None if nothing."""
        if not isinstance(arguments, Mapping):
            return (f"the arguments of `{self.name}` must be a JSON object, got "
                    f"{json_type(arguments)}; call it as {self.signature()}")
        properties = self.parameters.get("properties") or {}
        missing = [k for k in self.parameters.get("required", ()) if k not in arguments]
        if missing:
            return (f"`{self.name}` is missing the argument "
                    f"{', '.join(f'`{k}`' for k in missing)}; call it as {self.signature()}")
        if self.parameters.get("additionalProperties") is not True:
            unknown = [k for k in arguments if k not in properties]
            if unknown:
                return (f"`{self.name}` has no argument "
                        f"{', '.join(f'`{k}`' for k in unknown)}; call it as "
                        f"{self.signature()}")
        for key, value in arguments.items():
            problem = argument_problem(properties.get(key) or {}, value)
            if problem:
                return f"the argument `{key}` of `{self.name}` {problem}"
        return None

    def signature(self) -> str:
        """`multiply(a: integer, b: integer, unit?: string)`: the call, for messages."""
        required = self.parameters.get("required", ())
        parts = [f"{k}{'' if k in required else '?'}: {_type_word(s)}"
                 for k, s in (self.parameters.get("properties") or {}).items()]
        return f"{self.name}({', '.join(parts)})"

    def __reduce__(self) -> tuple[Any, ...]:
        # A decorated function's module attribute is this Tool, so pickle cannot take fn by
        # reference; the Tool itself is, where its module holds it under fn's name.
        module, qualname = getattr(self.fn, "__module__", None), \
            getattr(self.fn, "__qualname__", "")
        if module and not by_value(f"{module}:{qualname}") and \
                _lookup(module, qualname) is self:
            return (_lookup, (module, qualname))
        return (Tool, (self.name, self.description, self.parameters, self.fn,
                       self.timeout_s, self.returns, self.receiver))


def _lookup(module: str, qualname: str) -> Any:
    """What `module:qualname` names (None where nothing does)."""
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _copied(value: Any) -> Any:
    """A deep copy of JSON data (so that a caller's edit never reaches the tool)."""
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def _type_word(schema: Mapping[str, Any]) -> str:
    """`integer`, `fast|exact` (an enum), `integer|array` (a union)."""
    names = schema.get("type")
    if "anyOf" in schema:
        return "|".join(_type_word(s) for s in schema["anyOf"])
    if "enum" in schema:
        return "|".join(str(v) for v in schema["enum"])
    if isinstance(names, list):
        return "|".join(names)
    return names if isinstance(names, str) else "any"


@overload
def tool(fn: Callable[..., Any]) -> Tool: ...


@overload
def tool(*, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None,
         timeout_s: float | None = None) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a function (sync or async, or a method of an `Env`) a tool: bare `@tool`, or
    `@tool(name=..., description=..., timeout_s=...)`. Its schema is built here, so a
    missing hint or argument description fails when the file is imported, naming it."""

    def make(f: Callable[..., Any]) -> Tool:
        return _made(f, name=name, description=description, timeout_s=timeout_s)

    return make if fn is None else make(fn)


def _made(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
          timeout_s: float | None = None) -> Tool:
    if isinstance(fn, Tool):
        return replace(fn, name=fn.name if name is None else name,
                       description=fn.description if description is None else description,
                       timeout_s=fn.timeout_s if timeout_s is None else timeout_s)
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise ToolSchemaError(f"{fn!r} is not a function: a tool is a function (typed, with "
                              "a Google-style docstring), a method or a flowgraph.tool")
    spec = function_schema(fn, description)["function"]
    params = inspect.signature(fn).parameters
    first = next(iter(params.values()), None)
    receiver = inspect.isfunction(fn) and first is not None and first.name == "self" \
        and first.annotation is inspect.Parameter.empty
    return Tool(spec["name"] if name is None else name, spec["description"], spec["parameters"], fn,
                timeout_s, spec.get("return"), receiver)


def as_tool(obj: object) -> Tool:
    """`obj` as a Tool: a Tool as it is; a function or a bound method, its schema built
    from its hints and docstring (ToolSchemaError naming it where that fails)."""
    if isinstance(obj, Tool):
        return obj
    return _made(obj)  # type: ignore[arg-type]


def tools_of(env: object) -> list[Tool]:
    """The tools of an environment: its class's `tools` (functions or Tools), then its
    methods decorated with `@tool`, in the order the classes define them (bases first).
    Given an instance, the methods are bound to it (one episode's tools); given the class,
    they stay unbound (their schemas, for the checker). Two tools with one name are refused."""
    cls = env if isinstance(env, type) else type(env)
    listed = getattr(env, "tools", None) or ()
    if isinstance(listed, str | bytes | Mapping) or not hasattr(listed, "__iter__"):
        raise ToolSchemaError(f"{cls.__qualname__} ({defined_at(cls)}): `tools` is "
                              f"{listed!r}; list the functions or tools an episode may call")
    found = [(as_tool(t), f"{cls.__qualname__}.tools[{i}]") for i, t in enumerate(listed)]
    found += [(t, f"the method {cls.__qualname__}.{attr}") for attr, t in _tool_methods(cls)]
    seen: dict[str, str] = {}
    for t, origin in found:
        here = f"{origin} ({defined_at(t.fn)})"
        if t.name in seen:
            raise ToolSchemaError(
                f"{cls.__qualname__} ({defined_at(cls)}): two tools are named `{t.name}`: "
                f"{seen[t.name]} and {here}; rename one (@tool(name=...)) or list it once")
        seen[t.name] = here
    return [t if env is cls else t.bind(env) for t, _ in found]


def _tool_methods(cls: type) -> list[tuple[str, Tool]]:
    """(attribute, Tool) for every `@tool` attribute of cls, bases first; an attribute a
    subclass redefines is the subclass's (a plain method there hides a base's tool)."""
    names = dict.fromkeys(attr for klass in reversed(cls.__mro__) for attr in vars(klass))
    out = []
    for attr in names:
        value = inspect.getattr_static(cls, attr)
        if isinstance(value, Tool):
            out.append((attr, value))
    return out
