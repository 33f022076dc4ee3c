"""PLACEHOLDER until the `tools` branch merges (its version replaces this file)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    timeout_s: float | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description":
                self.description, "parameters": self.parameters}}

    def bind(self, instance: Any) -> Tool:
        return replace(self, fn=self.fn.__get__(instance))

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        return f"missing {missing}" if missing else None


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         timeout_s: float | None = None) -> Any:
    def make(f: Callable[..., Any]) -> Tool:
        from transformers.utils import get_json_schema  # type: ignore[attr-defined]
        schema = get_json_schema(f)["function"]
        return Tool(name or f.__name__, schema.get("description", ""), schema["parameters"], f,
                    timeout_s)
    return make(fn) if fn is not None else make


def as_tool(obj: Any) -> Tool:
    return obj if isinstance(obj, Tool) else tool(obj)


def tools_of(env: Any) -> list[Tool]:
    out = [as_tool(t) for t in getattr(type(env), "tools", ())]
    for k in dir(type(env)):
        v = getattr(type(env), k, None)
        if isinstance(v, Tool):
            out.append(v.bind(env))
    return out
