"""Reading tool calls out of an assistant turn's text: a registry of parsers, by name.

The `agent_rollout` kind's `parser` param names one of `PARSERS`; `hermes` is built in
(the `<tool_call>{json}</tool_call>` blocks of Hermes, Qwen 2.5 / 3 and other ChatML
models). Add your own with `register_parser(name, parser)`: an object with
`parse(text) -> (content, calls)`, or that function itself.

A parser never raises on what a model wrote: a call it cannot read is a `ToolCall` with
`error` set, which the rollout answers with a tool message saying what was wrong, so the
policy learns the format instead of the episode ending.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from flowgraph.errors import RegistryError
from flowgraph.objects import defined_at

__all__ = ["PARSERS", "HermesParser", "ToolCall", "ToolCallParser", "get_parser", "hermes",
           "register_parser"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call of an assistant turn."""

    name: str
    """The tool called ("" where the call could not be read)."""
    arguments: dict[str, Any] = field(hash=False)
    """Its arguments, decoded ({} for a call with an error)."""
    id: str
    """`call_0`, `call_1`, ... in the order of the turn: the tool message's `tool_call_id`
    (the rollout renumbers them across the episode's turns: `episodes.numbered`)."""
    error: str | None = None
    """Why the call could not be read, for the model (None: a well-formed call)."""

    def as_dict(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry (OpenAI's form, which chat
        templates render): `{"id", "type": "function", "function": {"name", "arguments"}}`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": dict(self.arguments)}}


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads one assistant turn's text: `(content, calls)`, the text without the calls
    (stripped) and the calls in order, ids `call_0`, `call_1`, ...; never raises."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]: ...


@dataclass(frozen=True, slots=True)
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen).

    How it reads what models write (compared with vLLM's `Hermes2ProToolParser` and
    verl's `HermesToolParser`):
    - every block is a call, in order; `arguments` may be an object or a JSON string
      holding one (as some models write, and OpenAI's API sends); missing or null: {}.
      Keys besides `name` and `arguments` are ignored.
    - a block that is not a call (not JSON, no `name`, arguments not an object) is a call
      with `error` set: verl drops it silently and vLLM then drops every call of the
      turn, so the policy never learns what it did wrong.
    - the JSON is read as JSON, not up to the first `</tool_call>`: an argument that holds
      the text `</tool_call>` stays whole.
    - a last `<tool_call>` left open (a turn cut by its token budget, or by a stop string
      that ate the closing tag) is a call when what follows is a whole call, as vLLM
      reads it; else an error call.
    - the content is the text with every block removed, stripped (vLLM keeps only the
      text before the first call; verl keeps the whitespace).
    """

    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        kept: list[str] = []
        pos = 0
        while (start := text.find(self.open_tag, pos)) != -1:
            kept.append(text[pos:start])
            body, end, closed = self._block(text, start + len(self.open_tag))
            calls.append(_call(body, closed, f"call_{len(calls)}", self))
            pos = end
        kept.append(text[pos:])
        return "".join(kept).strip(), calls

    def _block(self, text: str, begin: int) -> tuple[str, int, bool]:
        """The text of the block opened before `begin`, where it ends, whether it is closed."""
        try:
            # Read the JSON itself first: a closing tag inside a string does not end it.
            _, stop = _DECODER.raw_decode(text, _skip_space(text, begin))
        except json.JSONDecodeError:
            stop = -1
        after = _skip_space(text, stop) if stop != -1 else -1
        if after != -1 and text.startswith(self.close_tag, after):
            return text[begin:stop], after + len(self.close_tag), True
        close = text.find(self.close_tag, begin)
        reopened = text.find(self.open_tag, begin)
        if reopened != -1 and (close == -1 or reopened < close):
            return text[begin:reopened], reopened, False  # the next call starts there
        if close == -1:
            return text[begin:], len(text), False
        return text[begin:close], close + len(self.close_tag), True

    def example(self) -> str:
        return f'{self.open_tag}{{"name": ..., "arguments": {{...}}}}{self.close_tag}'


_DECODER = json.JSONDecoder()


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _call(body: str, closed: bool, call_id: str, parser: HermesParser) -> ToolCall:
    """The call one block holds, or a call with the error the model will read."""
    fix = f"write each call as {parser.example()}"
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        what = "is not valid JSON" if closed else \
            f"has no {parser.close_tag} and is not a whole JSON object"
        return ToolCall("", {}, call_id, f"this tool call {what} ({e}); {fix}")
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, call_id, f'this tool call has no "name" (a string); {fix}')
    arguments = data.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, call_id, f"the arguments of `{name}` are a string "
                                               f"that is not JSON ({e.msg}); {fix}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, call_id, f"the arguments of `{name}` must be a JSON "
                                           f"object, got {type(arguments).__name__}; {fix}")
    return ToolCall(name, arguments, call_id)


hermes = HermesParser()
"""The Hermes / Qwen parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

PARSERS: dict[str, ToolCallParser] = {"hermes": hermes}
"""Tool-call parsers by the name the `agent_rollout` kind's `parser` param takes."""
_BUILTIN = frozenset(PARSERS)


@dataclass(frozen=True, slots=True)
class _FunctionParser:
    """A parse function registered as it is."""

    fn: Callable[[str], tuple[str, list[ToolCall]]]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return self.fn(text)


def register_parser(name: str, parser: ToolCallParser | Callable[[str], Any]) -> ToolCallParser:
    """Add a parser under `name`: an object with `parse(text) -> (content, calls)`, or
    that function. A built-in name, or a name taken by another parser, is refused
    (registering the same parser again, as a reimported plugin does, is not)."""
    if not isinstance(name, str) or not name:
        raise RegistryError(f"a tool-call parser's name is a non-empty string, got {name!r}")
    if not isinstance(parser, ToolCallParser):
        if not callable(parser):
            raise RegistryError(f"tool-call parser `{name}`: {parser!r} has no "
                                "parse(text) -> (content, calls) and is not such a function")
        parser = _FunctionParser(parser)
    old = PARSERS.get(name)
    if name in _BUILTIN and parser != old:
        raise RegistryError(f"tool-call parser `{name}` is built in; register "
                            f"{_origin(parser)} under another name")
    if old is not None and old != parser and (
            _definer(old) is _definer(parser) or _origin(old) != _origin(parser)):
        raise RegistryError(f"tool-call parser `{name}` is taken by {_origin(old)}; "
                            f"register {_origin(parser)} under another name")
    PARSERS[name] = parser
    return parser


def _definer(parser: object) -> object:
    """The function or class that makes a parser what it is."""
    return parser.fn if isinstance(parser, _FunctionParser) else type(parser)


def _origin(parser: object) -> str:
    """Where a parser's function or class is defined (`module.name (file:line)`): a
    reimported plugin's parser is another object with the same origin, accepted again;
    another object of the same class (other settings) is not."""
    what: Any = _definer(parser)
    where = defined_at(what)
    label = f"{what.__module__}.{what.__qualname__}"
    return f"{label} ({where})" if where else label


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; RegistryError listing the known ones if none is."""
    parser = PARSERS.get(name)
    if parser is None:
        raise RegistryError(f"unknown tool-call parser {name!r}; the known ones: "
                            f"{', '.join(sorted(PARSERS))} (add one with "
                            "flowgraph.agent.register_parser(name, parser))")
    return parser
