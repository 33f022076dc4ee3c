"""Tool-call parsers: hermes reads `<tool_call>{json}</tool_call>` blocks (edge cases as
vLLM's and verl's Hermes parsers meet them, each noted where we differ), never raises on
what a model wrote, and the registry takes new parsers by name."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from flowgraph.agent import PARSERS, ToolCall, ToolCallParser, get_parser, hermes, register_parser
from flowgraph.agent.parsers import HermesParser
from flowgraph.errors import RegistryError

FIX = 'write each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("The answer is 4.", "The answer is 4.", []),
        # Qwen 2.5 / 3 write the JSON on its own line.
        ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>',
         "Let me compute.", [("calc", {"x": 1})]),
        # Several calls, ids in order; the text between them is kept.
        ('a <tool_call>{"name": "f", "arguments": {}}</tool_call> b '
         '<tool_call>{"name": "g", "arguments": {"y": [1, 2]}}</tool_call>\n',
         "a  b", [("f", {}), ("g", {"y": [1, 2]})]),
        # Arguments as a JSON string (OpenAI's form, which some models copy).
        ('<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>', "",
         [("f", {"q": "x"})]),
        # No arguments, null arguments, an empty string: a call with none (vLLM and verl
        # drop a call without `arguments`).
        ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
        ('<tool_call>{"name": "now", "arguments": null}</tool_call>', "", [("now", {})]),
        ('<tool_call>{"name": "now", "arguments": ""}</tool_call>', "", [("now", {})]),
        # Other keys are ignored, in any order.
        ('<tool_call>{"arguments": {"a": 1}, "id": "x", "name": "f"}</tool_call>', "",
         [("f", {"a": 1})]),
        # A closing tag inside an argument does not end the call (a regex up to the first
        # `</tool_call>`, as vLLM's and verl's, cuts it there).
        ('<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call> ok',
         "ok", [("echo", {"s": "</tool_call>"})]),
        # A last call cut before its closing tag, whole JSON: a call (as vLLM reads it).
        ('Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}', "Sure.", [("f", {"a": 1})]),
        # Non-ASCII survives.
        ('<tool_call>{"name": "translate", "arguments": {"text": "café ☕"}}</tool_call>', "",
         [("translate", {"text": "café ☕"})]),
    ],
)
def test_hermes_reads_calls(text: str, content: str,
                            calls: list[tuple[str, dict[str, object]]]) -> None:
    got_content, got = hermes.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert [c.id for c in got] == [f"call_{i}" for i in range(len(calls))]
    assert all(c.error is None for c in got)


@pytest.mark.parametrize(
    ("text", "name", "error"),
    [
        ("<tool_call>{name: calc}</tool_call>", "",
         "this tool call is not valid JSON (Expecting property name enclosed in double quotes: "
         f"line 1 column 2 (char 1)); {FIX}"),
        ('<tool_call>{"name": "f"} trailing</tool_call>', "",
         f"this tool call is not valid JSON (Extra data: line 1 column 15 (char 14)); {FIX}"),
        ('<tool_call>{"name": "f", "argu', "",
         "this tool call has no </tool_call> and is not a whole JSON object (Unterminated "
         f"string starting at: line 1 column 15 (char 14)); {FIX}"),
        ('<tool_call>{"arguments": {}}</tool_call>', "",
         f'this tool call has no "name" (a string); {FIX}'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "",
         f'this tool call has no "name" (a string); {FIX}'),
        ('<tool_call>["calc", {"x": 1}]</tool_call>', "",
         f'this tool call has no "name" (a string); {FIX}'),
        ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "calc",
         f"the arguments of `calc` must be a JSON object, got list; {FIX}"),
        ('<tool_call>{"name": "calc", "arguments": "x=1"}</tool_call>', "calc",
         f"the arguments of `calc` are a string that is not JSON (Expecting value); {FIX}"),
        ('<tool_call>{"name": "calc", "arguments": "[1]"}</tool_call>', "calc",
         f"the arguments of `calc` must be a JSON object, got list; {FIX}"),
        ("<tool_call></tool_call>", "",
         f"this tool call is not valid JSON (Expecting value: line 1 column 1 (char 0)); {FIX}"),
    ],
)
def test_a_malformed_call_is_a_call_with_an_error(text: str, name: str, error: str) -> None:
    content, calls = hermes.parse(text)
    assert content == ""
    assert calls == [ToolCall(name, {}, "call_0", error)]


def test_a_malformed_call_does_not_hide_the_others() -> None:
    # vLLM returns no call at all when one block fails; verl drops the bad one silently.
    content, calls = hermes.parse(
        'x <tool_call>{"name": "a",</tool_call> y '
        '<tool_call>{"name": "b", "arguments": {"k": 2}}</tool_call> z')
    assert content == "x  y  z"
    assert [(c.id, c.name, c.error is None) for c in calls] == [
        ("call_0", "", False), ("call_1", "b", True)]


def test_an_unclosed_call_ends_where_the_next_one_starts() -> None:
    content, calls = hermes.parse(
        '<tool_call>{"name": "a", <tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert content == ""
    assert [c.name for c in calls] == ["", "b"]
    assert calls[0].error is not None and "has no </tool_call>" in calls[0].error


def test_ids_are_per_turn_and_deterministic() -> None:
    turn = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 3
    assert hermes.parse(turn) == hermes.parse(turn)
    assert [c.id for c in hermes.parse(turn)[1]] == ["call_0", "call_1", "call_2"]


def test_a_call_as_a_message_entry() -> None:
    call = hermes.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')[1][0]
    assert call.as_dict() == {"id": "call_0", "type": "function",
                              "function": {"name": "f", "arguments": {"a": 1}}}


def test_other_tags() -> None:
    parser = HermesParser("<function_call>", "</function_call>")
    assert parser.parse('hi <function_call>{"name": "f"}</function_call>') == (
        "hi", [ToolCall("f", {}, "call_0")])
    _, calls = parser.parse("<function_call>oops</function_call>")
    assert calls[0].error is not None and calls[0].error.endswith(
        'write each call as <function_call>{"name": ..., "arguments": {...}}</function_call>')


# --- the registry ---------------------------------------------------------------------------

@pytest.fixture
def registry() -> Iterator[dict[str, ToolCallParser]]:
    saved = dict(PARSERS)
    yield PARSERS
    PARSERS.clear()
    PARSERS.update(saved)


def upper(text: str) -> tuple[str, list[ToolCall]]:
    """A toy parser: a line `CALL name` is a call."""
    calls = [ToolCall(line[5:], {}, f"call_{i}") for i, line in
             enumerate(x for x in text.splitlines() if x.startswith("CALL "))]
    return "\n".join(x for x in text.splitlines() if not x.startswith("CALL ")), calls


def test_hermes_is_built_in() -> None:
    assert get_parser("hermes") is hermes and isinstance(hermes, ToolCallParser)


def test_register_a_function_or_an_object(registry: dict[str, ToolCallParser]) -> None:
    parser = register_parser("upper", upper)
    assert get_parser("upper") is parser
    assert parser.parse("hi\nCALL now") == ("hi", [ToolCall("now", {}, "call_0")])
    # The same parser again, as a reimported plugin registers it: accepted.
    register_parser("upper", upper)
    source, line = inspect.getsourcelines(upper)
    reimported = compile("\n" * (line - 1) + "".join(source), __file__, "exec")
    namespace: dict[str, object] = {"ToolCall": ToolCall, "__name__": __name__}
    exec(reimported, namespace)
    again = register_parser("upper", namespace["upper"])  # type: ignore[arg-type]
    assert get_parser("upper") is again and again is not parser
    square = HermesParser("[[", "]]")
    assert register_parser("square", square) is square
    assert get_parser("square").parse('[[{"name": "f"}]]')[1][0].name == "f"


@pytest.mark.parametrize(
    ("name", "parser", "expected"),
    [
        ("hermes", HermesParser("<call>", "</call>"),
         "tool-call parser `hermes` is built in; register flowgraph.agent.parsers.HermesParser"),
        ("upper", HermesParser(), f"tool-call parser `upper` is taken by {__name__}.upper ("),
        ("square", HermesParser("{{", "}}"), "tool-call parser `square` is taken by "
                                             "flowgraph.agent.parsers.HermesParser ("),
        ("", upper, "a tool-call parser's name is a non-empty string, got ''"),
        ("mine", 42, "tool-call parser `mine`: 42 has no parse(text) -> (content, calls) and "
                     "is not such a function"),
    ],
)
def test_registration_refused(registry: dict[str, ToolCallParser], name: str, parser: object,
                              expected: str) -> None:
    register_parser("upper", upper)
    register_parser("square", HermesParser("[[", "]]"))
    with pytest.raises(RegistryError) as e:
        register_parser(name, parser)  # type: ignore[arg-type]
    assert expected in str(e.value)


def test_an_unknown_parser_lists_the_known_ones() -> None:
    with pytest.raises(RegistryError) as e:
        get_parser("qwen_xml")
    assert str(e.value) == ("unknown tool-call parser 'qwen_xml'; the known ones: hermes "
                            "(add one with flowgraph.agent.register_parser(name, parser))")
