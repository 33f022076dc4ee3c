"""PLACEHOLDER until the `tools` branch merges (its version replaces this file)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str
    error: str | None = None


class ToolCallParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall]]: ...


class Hermes:
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for i, m in enumerate(re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.S)):
            try:
                d = json.loads(m.group(1))
                calls.append(ToolCall(d["name"], d.get("arguments", {}), f"call_{i}"))
            except Exception as exc:
                calls.append(ToolCall("", {}, f"call_{i}", f"error: {exc}"))
        return re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip(), calls


PARSERS: dict[str, ToolCallParser] = {"hermes": Hermes()}


def get_parser(name: str) -> ToolCallParser:
    return PARSERS[name]
