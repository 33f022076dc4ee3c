"""A stand-in for `flowgraph.agent.tools` while it is written in another branch.

Installed only where the module is missing, with just what `flowgraph.agent.adapters`
uses (`Tool` with its fields and `schema()`, `as_tool` of a bound method, schemas from
`transformers.utils.get_json_schema`); the real module (branch `tools`) replaces it when
it lands, and these tests pass on it too.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _install_stand_in() -> None:
    import flowgraph.agent

    @dataclass(frozen=True)
    class Tool:
        name: str
        description: str
        parameters: dict[str, Any]
        fn: Callable[..., Any]
        timeout_s: float | None = None
        returns: dict[str, Any] | None = None

        def schema(self) -> dict[str, Any]:
            function = {"name": self.name, "description": self.description,
                        "parameters": self.parameters}
            return {"type": "function", "function": {
                **function, **({"return": self.returns} if self.returns else {})}}

        @property
        def is_async(self) -> bool:
            return inspect.iscoroutinefunction(self.fn)

    def as_tool(obj: Any) -> Tool:
        from transformers.utils import get_json_schema

        function = get_json_schema(obj)["function"]
        return Tool(function["name"], function.get("description", ""),
                    function["parameters"], obj, None, function.get("return"))

    module = types.ModuleType("flowgraph.agent.tools")
    module.Tool, module.as_tool = Tool, as_tool  # type: ignore[attr-defined]
    sys.modules["flowgraph.agent.tools"] = module
    flowgraph.agent.tools = module  # type: ignore[attr-defined]


if importlib.util.find_spec("flowgraph.agent.tools") is None:
    _install_stand_in()
