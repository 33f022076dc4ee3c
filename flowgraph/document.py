"""Reading YAML safely into a located document tree.

PyYAML parses the file into events (libyaml's C parser when present); we compose
them into `YMap` / `YSeq` / `YScalar`, which keep the line and column of every key
and value. Only the plain YAML types are accepted: any other tag (`!!python/object`,
`!custom`) is reported, never constructed, so a graph file cannot run code.
Duplicate keys, alias cycles and alias bombs are reported too. Command-line
overrides (`nodes.adv.params.lam=0.9`) are applied to this tree before the IR is built.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

import yaml
from yaml.composer import ComposerError
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from flowgraph.diagnostics import Diagnostic, error
from flowgraph.ir import Scalar
from flowgraph.source import SourcePos

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STD = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_STD}{t}" for t in ("str", "int", "float", "bool", "null", "timestamp")}
_STR_TAG, _MAP_TAG, _SEQ_TAG, _MERGE_TAG = (f"{_STD}{t}" for t in ("str", "map", "seq", "merge"))
EXP_FLOAT = re.compile(r"^[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+$")
MAX_NODES = 200_000
"""Nodes one document may expand to (aliases counted at every use)."""
MAX_DEPTH = 64
"""Nesting depth a graph document may have; real graphs use fewer than 8."""


class YScalar(NamedTuple):
    """A scalar and where it was written. The located tree's nodes are named tuples,
    not frozen dataclasses: a 10,000-node graph file has 350,000 of them, and a tuple
    is made in half the time."""

    value: Scalar
    pos: SourcePos


class YSeq(NamedTuple):
    items: tuple[YNode, ...]
    pos: SourcePos


class YMap(NamedTuple):
    items: tuple[tuple[YScalar, YNode], ...]
    pos: SourcePos

    def get(self, key: str) -> YNode | None:
        return next((v for k, v in self.items if k.value == key), None)

    def key(self, key: str) -> YScalar | None:
        return next((k for k, _ in self.items if k.value == key), None)

    def keys(self) -> list[str]:
        return [str(k.value) for k, _ in self.items]


YNode: TypeAlias = YScalar | YSeq | YMap


def plain(node: YNode) -> object:
    """The plain Python value of a node (dicts, lists, scalars)."""
    if isinstance(node, YScalar):
        return node.value
    if isinstance(node, YSeq):
        return [plain(i) for i in node.items]
    return {str(k.value): plain(v) for k, v in node.items}


def did_you_mean(word: str, options: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else f"expected one of: {', '.join(options)}"


class _Merge:
    """The `<<` merge key, as a mapping's key."""


_MERGE = _Merge()
_resolve: Callable[[type[yaml.Node], str, tuple[bool, bool]], str] = Resolver().resolve


@dataclass(slots=True)
class _Open:
    """A mapping or list whose events are still arriving."""

    is_map: bool
    tag: str
    pos: SourcePos
    anchor: str | None
    start: int
    """Values counted before it: its expanded size is the count at its end minus this."""
    items: list[YNode | _Merge | None] = field(default_factory=list)
    """Values; for a mapping, keys and values alternate. None: a value that was refused."""
    height: int = 0
    """Levels of nesting below it, as far as nested collections and aliases tell so far
    (`close` counts scalars: any item is one level below)."""


@dataclass(frozen=True, slots=True)
class _Anchor:
    node: YNode | None
    size: int
    """Values it expands to; -1 while it is still open."""
    height: int
    pos: SourcePos
    mark: Any
    """Its `yaml.Mark`, for a duplicate-anchor error."""


class _Composer:
    """YAML events -> YNode, collecting problems instead of stopping at the first.

    Built straight from the parser's events (PyYAML's own composer, in C, recurses
    once per level: `[[[[...` 30,000 deep overflows the C stack and kills the process).
    An alias reuses the anchored YNode; its expanded size and depth are counted at every
    use, so an alias bomb stops at `MAX_NODES` without being expanded.
    """

    def __init__(self, file: str) -> None:
        self.file = file
        self.diags: list[Diagnostic] = []
        self.count = 0
        self.stack: list[_Open] = []
        self.roots: list[YNode | _Merge | None] = []
        """The document's top level: the root node, once it is complete."""
        self.anchors: dict[str, _Anchor] = {}
        self.first: Any = None
        """The first document's start event."""

    def pos(self, event: yaml.Event) -> SourcePos:
        m: Any = event.start_mark
        return SourcePos(self.file, m.line + 1, m.column + 1)

    def compose(self, text: str) -> tuple[bool, YNode | None]:
        """(whether the stream holds a document, its root)."""
        loader = _Loader(text)
        try:
            for event in iter(loader.get_event, None):
                self.event(event)
        finally:
            loader.dispose()
        root = self.roots[-1] if self.roots else None
        return self.first is not None, root if isinstance(root, (YScalar, YSeq, YMap)) else None

    def event(self, event: yaml.Event) -> None:
        """One event; the stream's start and end and a document's end compose nothing."""
        if isinstance(event, yaml.ScalarEvent):
            self.enter(event, 0, 1)
            self.add(self.scalar(event), 0)
        elif isinstance(event, yaml.CollectionStartEvent):
            self.open(event)
        elif isinstance(event, yaml.CollectionEndEvent):
            self.close()
        elif isinstance(event, yaml.AliasEvent):
            self.alias(event)
        elif isinstance(event, yaml.DocumentStartEvent):
            self.document(event)

    def document(self, event: yaml.DocumentStartEvent) -> None:
        if self.first is not None:
            again: Any = event.start_mark
            raise ComposerError("expected a single document in the stream",
                                self.first.start_mark, "but found another document", again)
        self.first = event

    def add(self, node: YNode | _Merge | None, height: int) -> None:
        """A complete node, `height` levels deep, into the open collection."""
        (self.stack[-1].items if self.stack else self.roots).append(node)
        if self.stack and height >= self.stack[-1].height:
            self.stack[-1].height = height + 1

    def enter(self, event: yaml.Event, height: int, size: int) -> None:
        """Count a node `size` values large reaching `height` levels below this one."""
        self.count += size
        self.limits(event, height)

    def limits(self, event: yaml.Event, height: int) -> None:
        if self.count > MAX_NODES:
            raise _TooLarge(f"the document expands to more than {MAX_NODES} values "
                            "(an alias bomb?)", self.pos(event))
        if len(self.stack) + height > MAX_DEPTH:
            raise _TooLarge(f"the document is nested more than {MAX_DEPTH} levels deep",
                            self.pos(event))

    def remember(self, event: yaml.NodeEvent, node: YNode | None, size: int, height: int
                 ) -> None:
        if event.anchor is not None:
            self.anchors[event.anchor] = _Anchor(node, size, height, self.pos(event),
                                                 event.start_mark)

    def check_anchor(self, event: yaml.NodeEvent) -> None:
        old = self.anchors.get(event.anchor) if event.anchor is not None else None
        if old is not None:
            mark: Any = event.start_mark
            raise ComposerError(f"found duplicate anchor {event.anchor!r}; first occurrence",
                                old.mark, "second occurrence", mark)

    def bad_tag(self, tag: str, pos: SourcePos) -> None:
        self.diags.append(error(
            "FG002", f"YAML tag `{tag}` is not allowed in a graph file", pos,
            hint="graph files hold plain data only: strings, numbers, booleans, null, "
                 "lists and mappings; remove the tag",
        ))

    def expects_key(self) -> bool:
        top = self.stack[-1] if self.stack else None
        return top is not None and top.is_map and len(top.items) % 2 == 0

    def scalar(self, event: yaml.ScalarEvent) -> YScalar | _Merge | None:
        tag = event.tag
        if tag is None or tag == "!":
            tag = _resolve(yaml.ScalarNode, event.value, event.implicit)
        if event.anchor is None:
            return self.scalar_value(event, tag, self.pos(event))
        self.check_anchor(event)
        node = self.scalar_value(event, tag, self.pos(event))
        if isinstance(node, _Merge):
            return node
        self.remember(event, node, 1, 0)
        return node

    def scalar_value(self, event: yaml.ScalarEvent, tag: str, pos: SourcePos
                     ) -> YScalar | _Merge | None:
        if tag == _MERGE_TAG and self.expects_key():
            return _MERGE
        if tag not in _SCALAR_TAGS:
            self.bad_tag(tag, pos)
            return None
        try:
            return YScalar(_construct(tag, event), pos)
        except _UNREADABLE as exc:
            self.diags.append(error("FG004", f"cannot read the value `{event.value[:40]}`: "
                                    f"{exc}", pos))
            return None

    def open(self, event: yaml.CollectionStartEvent) -> None:
        self.enter(event, 0, 1)
        if event.anchor is not None:
            self.check_anchor(event)
        is_map = isinstance(event, yaml.MappingStartEvent)
        tag = event.tag
        if tag is None or tag == "!":
            tag = _MAP_TAG if is_map else _SEQ_TAG
        self.stack.append(_Open(is_map, tag, self.pos(event), event.anchor, self.count - 1))
        if event.anchor is not None:
            # Known but not complete: an alias to it from inside is a cycle.
            self.anchors[event.anchor] = _Anchor(None, -1, 0, self.pos(event),
                                                 event.start_mark)

    def close(self) -> None:
        top = self.stack.pop()
        # `add` raised the height for nested collections and aliases; any item at all,
        # a scalar too, is one level below.
        height = max(top.height, 1) if top.items else 0
        node: YNode | None
        if top.tag != (_MAP_TAG if top.is_map else _SEQ_TAG):
            self.bad_tag(top.tag, top.pos)
            node = None
        elif top.is_map:
            node = self.mapping(top)
        else:
            node = YSeq(tuple(i for i in top.items if isinstance(i, (YScalar, YSeq, YMap))),
                        top.pos)
        if top.anchor is not None:
            self.anchors[top.anchor] = _Anchor(node, self.count - top.start, height,
                                               top.pos, self.anchors[top.anchor].mark)
        self.add(node, height)

    def alias(self, event: yaml.AliasEvent) -> None:
        anchor = self.anchors.get(event.anchor or "")
        if anchor is None:
            mark: Any = event.start_mark
            raise ComposerError(None, None, f"found undefined alias {event.anchor!r}", mark)
        if anchor.size < 0:
            raise _TooLarge("an alias refers to the mapping or list that contains it",
                            self.pos(event))
        self.enter(event, anchor.height, anchor.size)
        self.add(anchor.node, anchor.height)

    def mapping(self, top: _Open) -> YMap:
        out: dict[object, tuple[YScalar, YNode]] = {}
        merged: dict[object, tuple[YScalar, YNode]] = {}
        pairs = iter(top.items)
        for key, value in zip(pairs, pairs, strict=False):
            if isinstance(key, _Merge):
                self.merge_into(merged, value)
                continue
            if key is None or value is None or isinstance(value, _Merge):
                continue
            if not isinstance(key, YScalar) or isinstance(key.value, (float, bool)) \
                    or key.value is None:
                self.diags.append(error("FG004", "a mapping key must be a name", key.pos))
                continue
            if key.value in out:
                first = out[key.value][0].pos
                self.diags.append(error(
                    "FG005", f"key `{key.value}` is written twice in this mapping",
                    key.pos, notes=(f"first written at {first}",),
                    hint="YAML keeps only the last value; remove one of them"))
                continue
            name = key if isinstance(key.value, str) else YScalar(str(key.value), key.pos)
            out[key.value] = (name, value)
        items = {**merged, **out}
        return YMap(tuple(items.values()), top.pos)

    def merge_into(self, merged: dict[object, tuple[YScalar, YNode]],
                   value: YNode | _Merge | None) -> None:
        """`<<: *defaults` (or a list of them): keys written beside it win."""
        sources = value.items if isinstance(value, YSeq) else (value,)
        for src in sources:
            if src is None or isinstance(src, _Merge):
                continue  # refused already (a tag), and reported
            if not isinstance(src, YMap):
                self.diags.append(error("FG004", "`<<` merges mappings only", src.pos))
                continue
            for k, v in src.items:
                merged.setdefault(k.value, (k, v))


_UNREADABLE = (ValueError, yaml.YAMLError, OverflowError)
"""What the constructor raises for a value it cannot read (`2001-13-45`)."""


def _construct(tag: str, event: yaml.ScalarEvent) -> Scalar:
    """The value of a scalar whose tag is one of `_SCALAR_TAGS`; raises one of
    `_UNREADABLE` when it cannot be read."""
    text = event.value
    if tag == _STR_TAG:
        if not event.style and EXP_FLOAT.match(text):
            # YAML 1.1 reads `1e-5` as a string; everyone means a number. A plain
            # scalar's style is None from PyYAML's parser but '' from libyaml's.
            return float(text)
        return text
    start: Any = event.start_mark
    end: Any = event.end_mark
    node = yaml.ScalarNode(tag, text, start, end, event.style)
    value = SafeConstructor().construct_object(node, deep=True)
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        return text  # a timestamp: keep the text
    return value


class _TooLarge(Exception):
    def __init__(self, message: str, pos: SourcePos) -> None:
        super().__init__(message)
        self.pos = pos


def read_document(text: str, file: str) -> tuple[YNode | None, list[Diagnostic]]:
    """Parse YAML text into a located tree; problems come back as diagnostics."""
    composer = _Composer(file)
    try:
        found, doc = composer.compose(text)
    except yaml.MarkedYAMLError as exc:
        return None, [_syntax_error(exc, file)]
    except yaml.YAMLError as exc:
        return None, [error("FG001", f"not valid YAML: {exc}", SourcePos(file, 0, 0))]
    except _TooLarge as exc:
        return None, [*composer.diags, error("FG008", str(exc), exc.pos)]
    if not found:
        return None, [error("FG007", "the graph file is empty", SourcePos(file, 1, 1),
                            hint="a graph file needs at least `nodes:`; see graphs/ppo.yaml")]
    return doc, composer.diags


def _syntax_error(exc: yaml.MarkedYAMLError, file: str) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    pos = SourcePos(file, mark.line + 1, mark.column + 1) if mark else SourcePos(file, 0, 0)
    problem = exc.problem or "syntax error"
    context = f" ({exc.context})" if exc.context else ""
    start = exc.context_mark
    # An unclosed `{` or `[` is noticed lines later; say where it was opened.
    notes = (f"{exc.context} that starts at {SourcePos(file, start.line + 1, start.column + 1)}",
             ) if exc.context and start and mark and start.line != mark.line else ()
    return error("FG001", f"not valid YAML: {problem}{context}", pos, notes=notes,
                 hint="check the indentation and the `key: value` layout on this line")


# --- overrides -------------------------------------------------------------------

NAMED_COLLECTIONS = frozenset({"nodes", "models", "data", "pools"})
"""Mappings whose keys are names: an override may not invent an entry in them."""


def parse_override(text: str, index: int) -> tuple[list[str], YNode] | Diagnostic:
    """`a.b.c=value` -> (path, value node); the value is read as safe YAML."""
    pos = SourcePos("<command line>", 0, index + 1)
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        return error("FG006", f"override `{text}` is not `dotted.key=value`", pos,
                     hint="for example: trainer.steps=20 or nodes.adv.params.lam=0.9")
    value, diags = read_document(raw if raw.strip() else "''", "<command line>")
    if diags or value is None:
        return error("FG006", f"override `{text}`: the value is not plain YAML", pos,
                     notes=tuple(d.message for d in diags))
    return path, _relocate(value, pos)


def _relocate(node: YNode, pos: SourcePos) -> YNode:
    if isinstance(node, YScalar):
        return YScalar(node.value, pos)
    if isinstance(node, YSeq):
        return YSeq(tuple(_relocate(i, pos) for i in node.items), pos)
    return YMap(tuple((YScalar(k.value, pos), _relocate(v, pos)) for k, v in node.items), pos)


def apply_override(doc: YNode | None, path: list[str], value: YNode, text: str
                   ) -> YNode | Diagnostic:
    """A new tree with `path` set to `value`; sections and `params` are created as needed."""
    root = doc if doc is not None else YMap((), value.pos)
    try:
        return _set(root, path, value, (), text)
    except _OverrideError as exc:
        return error("FG006", f"override `{text}`: {exc}", value.pos, hint=exc.hint)


class _OverrideError(Exception):
    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def _set(node: YNode, path: list[str], value: YNode, done: tuple[str, ...], text: str) -> YNode:
    if not path:
        return value
    if not isinstance(node, YMap):
        raise _OverrideError(f"`{'.'.join(done)}` is not a mapping, cannot set `{path[0]}` in it")
    head, rest = path[0], path[1:]
    child = node.get(head)
    if child is None:
        if rest and done and done[-1] in NAMED_COLLECTIONS:
            raise _OverrideError(f"there is no `{head}` under `{'.'.join(done)}`",
                                 did_you_mean(head, node.keys()))
        child = YMap((), value.pos)
    new_child = _set(child, rest, value, (*done, head), text)
    items = [(k, new_child if k.value == head else v) for k, v in node.items]
    if node.get(head) is None:
        items.append((YScalar(head, value.pos), new_child))
    return YMap(tuple(items), node.pos)
