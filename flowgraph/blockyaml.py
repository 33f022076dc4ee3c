"""The short way to read the plain block YAML that graph files are written in.

A graph file is mostly `key: value` lines. Reading one through libyaml's events costs
an event object and two marks per scalar, then composing them in Python: 0.65 s CPU for
the 10,000-node graph of benchmarks/bench_check.py on the 2-core dev VM. This reader
takes the file a line at a time and builds the same located tree (`YMap` / `YSeq` /
`YScalar`, same values, same line and column) in 0.49 s, or declines: at the first
thing outside the subset below it returns None and `read_document` reads the file the
long way. So it never reports a problem: a file with one always goes to the reader
that reports it (and a file it declines is read exactly as before).
tests/core/test_fast_paths.py holds it to the long way.

The subset: ASCII text without tabs, CR or other control characters; `#` comments;
block mappings whose keys are plain names; block lists of one-line items; values on
the key's line that are plain scalars (`gen.responses`, `1.0e-5`, `true`,
`builtin:tiny-lm`), quoted strings without escapes, or one-line flow mappings and
lists of the same. Not: anchors, aliases, tags, block scalars, multi-line values,
`---`, directives, empty values, keys that are not names, duplicate keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from flowgraph.document import MAX_DEPTH, MAX_NODES, YMap, YNode, YScalar, YSeq, plain_value
from flowgraph.ir import Scalar
from flowgraph.source import SourcePos

_S = r"A-Za-z0-9_./+~$()=^"
"""Characters a plain scalar may hold anywhere (a `-` too, except first: see below);
anything else (`:`, `#`, `,`, quotes, brackets, indicators) sends the file the long
way, where they have their full YAML meaning."""
_FIRST = rf"(?:[{_S}]|-(?=[0-9.]))"
_BLOCK_PLAIN = re.compile(rf"{_FIRST}(?:[{_S}-]|:(?=[{_S}-])| +(?=[{_S}-]))*")
"""A plain scalar in a block: `:` only inside (before a character that is not a space)."""
_FLOW_PLAIN = re.compile(rf"{_FIRST}(?:[{_S}-]| +(?=[{_S}-]))*")
"""A plain scalar inside `{}` or `[]`: no `:` at all."""
_ENTRY = re.compile(r"(?:(-)|([A-Za-z_][A-Za-z0-9_-]*):)(?: +|$)")
"""What starts a line: a list item's `- ` or a mapping's `key:`."""
_PAIR = re.compile(rf"( *)([A-Za-z_][A-Za-z0-9_-]*):(?: +({_BLOCK_PLAIN.pattern}))?"
                   r"(?: +(?:#.*)?)?$")
"""A whole `key: plain-value` line, or a whole `key:` line (no group 3: its value is on
the lines below): most lines of a graph file."""
_FLOW_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*): +")
_QUOTED = {'"': re.compile(r'"([^"\\]*)"'), "'": re.compile(r"'([^']*)'")}
_TAIL = re.compile(r"(?: +(?:#.*)?)?$")
"""What may follow a value on its line: spaces, then a comment."""
_SPACES = re.compile(r" *")
_UNREAD = re.compile(r"[^\n -~]")
"""Anything but printable ASCII, space and newline: tabs, CR, control characters."""


_new = tuple.__new__
"""Makes a named tuple from a tuple of its fields without the Python-level `__new__`
the named tuple's own constructor calls: twice as fast, for the 350,000 positions and
scalars of a 10,000-node graph."""


class _Decline(Exception):
    """The text is outside the subset: read it the long way."""


@dataclass(slots=True)
class _Block:
    """A block mapping or list whose lines are still arriving."""

    indent: int
    is_map: bool
    pos: SourcePos
    items: list[YNode] = field(default_factory=list)
    """A list's items."""
    pairs: list[tuple[YScalar, YNode]] = field(default_factory=list)
    """A mapping's entries."""
    key: YScalar | None = None
    """The key whose value is the block that starts on the next line."""

    def close(self) -> YNode:
        if not self.is_map:
            return YSeq(tuple(self.items), self.pos)
        return _mapping(self.pairs, self.pos)


def _mapping(pairs: list[tuple[YScalar, YNode]], pos: SourcePos) -> YMap:
    if len({k.value for k, _ in pairs}) != len(pairs):
        raise _Decline  # a key written twice: the long way reports it
    return YMap(tuple(pairs), pos)


class _Reader:
    def __init__(self, file: str) -> None:
        self.file = file
        self.stack: list[_Block] = []
        self.count = 0
        self.memo: dict[str, tuple[Scalar]] = {}
        """Plain scalars by their text: a graph file repeats a few hundred of them."""
        self.names: dict[str, str] = {}
        """Mapping keys by their text."""
        self.open_key = False
        """Whether the last line was a `key:` whose value starts on a later line."""

    def read(self, lines: list[str]) -> YNode:
        for number, line in enumerate(lines, 1):
            pair = _PAIR.match(line)
            if pair is not None:
                self.pair(pair, number)
            else:
                self.other(line, number)
        if self.open_key or not self.stack or self.count > MAX_NODES:
            raise _Decline
        while len(self.stack) > 1:
            self.pop()
        return self.stack[0].close()

    def pair(self, pair: re.Match[str], number: int) -> None:
        """`key: plain-value` or `key:`, most lines of a graph file: the short way."""
        indent, stack = pair.end(1), self.stack
        self.place(indent, True, number)
        name = self.key(pair.group(2), _new(SourcePos, (self.file, number, indent + 1)))
        text = pair.group(3)
        self.open_key = text is None
        if self.open_key:
            stack[-1].key = name
            return
        pos = _new(SourcePos, (self.file, number, pair.start(3) + 1))
        stack[-1].pairs.append((name, self.scalar(text, pos)))

    def other(self, line: str, number: int) -> None:
        """A blank line, a comment, a list item or a flow value."""
        content = line.lstrip(" ")
        if not content or content[0] == "#":
            return
        indent = len(line) - len(content)
        entry = _ENTRY.match(content)
        if entry is None:
            raise _Decline
        self.place(indent, entry.group(2) is not None, number)
        self.open_key = self.entry(line, number, indent, entry)

    def place(self, indent: int, is_map: bool, number: int) -> None:
        """Open the block this line starts, or close those it is outside of."""
        stack = self.stack
        if self.open_key or not stack:
            self.start(indent, is_map, number)
        elif indent != stack[-1].indent or is_map != stack[-1].is_map:
            self.dedent(indent, is_map)

    def start(self, indent: int, is_map: bool, number: int) -> None:
        """The first line of a block: nested under the open key (deeper, or a list at
        the key's own indentation), or the document's root."""
        top = self.stack[-1] if self.stack else None
        if top is None and not is_map:
            raise _Decline  # the root is a mapping (a list at the top: the long way)
        if top is not None and not (indent > top.indent or (
                indent == top.indent and not is_map)):
            raise _Decline  # `key:` with nothing under it: a null
        if len(self.stack) >= MAX_DEPTH - 2:
            raise _Decline
        self.count += 1
        self.stack.append(_Block(indent, is_map, SourcePos(self.file, number, indent + 1)))

    def dedent(self, indent: int, is_map: bool) -> None:
        """Close the blocks this line is outside of; it must continue the one left."""
        stack = self.stack
        while len(stack) > 1 and (indent < stack[-1].indent or (
                indent == stack[-1].indent and is_map and not stack[-1].is_map
                and stack[-2].indent == indent)):
            self.pop()
        if indent != stack[-1].indent or is_map != stack[-1].is_map:
            raise _Decline

    def pop(self) -> None:
        node = self.stack.pop().close()
        parent = self.stack[-1]  # a mapping: only a `key:` line opens a block
        assert parent.key is not None
        parent.pairs.append((parent.key, node))
        parent.key = None

    def entry(self, line: str, number: int, indent: int, entry: re.Match[str]) -> bool:
        """Read one `key: value` or `- value` line; whether its value is still to come."""
        top, at = self.stack[-1], indent + entry.end()
        name = entry.group(2)
        if name is None:
            if at == len(line):
                raise _Decline  # `-` with the item on later lines
            top.items.append(self.value(line, number, at, 0))
            return False
        key = self.key(name, SourcePos(self.file, number, indent + 1))
        if at == len(line) or line[at] == "#":
            top.key = key
            return True
        top.pairs.append((key, self.value(line, number, at, 0)))
        return False

    def value(self, line: str, number: int, at: int, depth: int) -> YNode:
        """The value that starts at `at` and must end the line (a comment may follow)."""
        node, end = self.node(line, number, at, depth, _BLOCK_PLAIN)
        if _TAIL.match(line, end) is None:
            raise _Decline
        return node

    def node(self, line: str, number: int, at: int, depth: int, plain: re.Pattern[str]
             ) -> tuple[YNode, int]:
        """(node, where it ends) for a scalar or flow collection starting at `at`."""
        if depth + len(self.stack) >= MAX_DEPTH - 2:
            raise _Decline
        pos = SourcePos(self.file, number, at + 1)
        first = line[at] if at < len(line) else ""
        if first == "{" or first == "[":
            return self.flow(line, number, at, depth, pos)
        if first in _QUOTED:
            m = _QUOTED[first].match(line, at)
            if m is None:
                raise _Decline
            self.count += 1
            return YScalar(m.group(1), pos), m.end()
        m = plain.match(line, at)
        if m is None:
            raise _Decline
        return self.scalar(m.group(), pos), m.end()

    def scalar(self, text: str, pos: SourcePos) -> YScalar:
        self.count += 1
        return _new(YScalar, ((self.memo.get(text) or self.plain(text))[0], pos))

    def plain(self, text: str) -> tuple[Scalar]:
        """The value of a plain scalar, read once per text."""
        value = plain_value(text)
        if value is None:
            raise _Decline  # a merge key, `=`, a date that is none: the long way says
        self.memo[text] = value
        return value

    def key(self, text: str, pos: SourcePos) -> YScalar:
        self.count += 1
        return _new(YScalar, (self.names.get(text) or self.name(text), pos))

    def name(self, text: str) -> str:
        """A mapping key, read once per text: it must be read as a string."""
        value = self.plain(text)[0]
        if type(value) is not str:
            raise _Decline  # `on:`, `null:`: YAML 1.1 reads a bool, None; the long way says
        self.names[text] = value
        return value

    def flow(self, line: str, number: int, at: int, depth: int, pos: SourcePos
             ) -> tuple[YNode, int]:
        """`{key: value, ...}` or `[value, ...]` on one line."""
        self.count += 1
        is_map = line[at] == "{"
        close = "}" if is_map else "]"
        at = _SPACES.match(line, at + 1).end()  # type: ignore[union-attr]
        pairs: list[tuple[YScalar, YNode]] = []
        items: list[YNode] = []
        while at < len(line) and line[at] != close:
            if is_map:
                key = _FLOW_KEY.match(line, at)
                if key is None:
                    raise _Decline
                name = self.key(key.group(1), SourcePos(self.file, number, at + 1))
                value, at = self.node(line, number, key.end(), depth + 1, _FLOW_PLAIN)
                pairs.append((name, value))
            else:
                item, at = self.node(line, number, at, depth + 1, _FLOW_PLAIN)
                items.append(item)
            at = self.separator(line, at, close)
        if at >= len(line):
            raise _Decline  # the collection goes on over the next line
        if not is_map:
            return YSeq(tuple(items), pos), at + 1
        return _mapping(pairs, pos), at + 1

    @staticmethod
    def separator(line: str, at: int, close: str) -> int:
        """Past `, ` between two entries; at the closing bracket after the last."""
        at = _SPACES.match(line, at).end()  # type: ignore[union-attr]
        if line.startswith(close, at):
            return at
        if not line.startswith(",", at):
            raise _Decline
        at = _SPACES.match(line, at + 1).end()  # type: ignore[union-attr]
        if at >= len(line) or line[at] == close:
            raise _Decline  # a trailing comma
        return at


def read_block(text: str, file: str) -> YNode | None:
    """The located tree of `text`, or None when it is outside the subset this reads."""
    if _UNREAD.search(text) is not None:
        return None
    try:
        return _Reader(file).read(text.split("\n"))
    except _Decline:
        return None
