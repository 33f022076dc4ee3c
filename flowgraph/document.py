"""Reading YAML safely into a located document tree.

PyYAML composes the file into nodes (libyaml's C parser when present); we convert
them into `YMap` / `YSeq` / `YScalar`, which keep the line and column of every key
and value. Only the plain YAML types are accepted: any other tag (`!!python/object`,
`!custom`) is reported, never constructed, so a graph file cannot run code.
Duplicate keys, alias cycles and alias bombs are reported too. Command-line
overrides (`nodes.adv.params.lam=0.9`) are applied to this tree before the IR is built.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import TypeAlias

import yaml
from yaml.constructor import SafeConstructor

from flowgraph.diagnostics import Diagnostic, error
from flowgraph.ir import Scalar
from flowgraph.source import SourcePos

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STD = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_STD}{t}" for t in ("str", "int", "float", "bool", "null", "timestamp")}
_EXP_FLOAT = re.compile(r"^[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+$")
MAX_NODES = 200_000
"""Nodes one document may expand to (aliases counted at every use)."""
MAX_DEPTH = 64
"""Nesting depth a graph document may have; real graphs use fewer than 8."""


@dataclass(frozen=True, slots=True)
class YScalar:
    value: Scalar
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class YSeq:
    items: tuple[YNode, ...]
    pos: SourcePos


@dataclass(frozen=True, slots=True)
class YMap:
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


class _Converter:
    """yaml.Node -> YNode, collecting problems instead of stopping at the first."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.diags: list[Diagnostic] = []
        self.count = 0
        self.active: set[int] = set()
        self.constructor = SafeConstructor()

    def pos(self, node: yaml.Node) -> SourcePos:
        m = node.start_mark
        return SourcePos(self.file, m.line + 1, m.column + 1)

    def convert(self, node: yaml.Node, depth: int = 0) -> YNode | None:
        self.count += 1
        if self.count > MAX_NODES:
            raise _TooLarge(f"the document expands to more than {MAX_NODES} values "
                            "(an alias bomb?)", self.pos(node))
        if depth > MAX_DEPTH:
            raise _TooLarge(f"the document is nested more than {MAX_DEPTH} levels deep",
                            self.pos(node))
        if id(node) in self.active:
            raise _TooLarge("an alias refers to the mapping or list that contains it",
                            self.pos(node))
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node)
        self.active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                return self.sequence(node, depth)
            assert isinstance(node, yaml.MappingNode)
            return self.mapping(node, depth)
        finally:
            self.active.discard(id(node))

    def bad_tag(self, node: yaml.Node) -> None:
        self.diags.append(error(
            "FG002", f"YAML tag `{node.tag}` is not allowed in a graph file",
            self.pos(node),
            hint="graph files hold plain data only: strings, numbers, booleans, null, "
                 "lists and mappings; remove the tag",
        ))

    def scalar(self, node: yaml.ScalarNode) -> YScalar | None:
        if node.tag not in _SCALAR_TAGS:
            self.bad_tag(node)
            return None
        pos = self.pos(node)
        try:
            value = self.constructor.construct_object(node, deep=True)
        except (ValueError, yaml.YAMLError, OverflowError) as exc:
            self.diags.append(error("FG004", f"cannot read the value `{node.value[:40]}`: {exc}",
                                    pos))
            return None
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            value = str(node.value)  # a timestamp: keep the text
        elif isinstance(value, str) and not node.style and _EXP_FLOAT.match(value):
            # YAML 1.1 reads `1e-5` as a string; everyone means a number. A plain scalar's
            # style is None from PyYAML's parser but '' from libyaml's.
            value = float(value)
        return YScalar(value, pos)

    def sequence(self, node: yaml.SequenceNode, depth: int) -> YSeq | None:
        if node.tag != f"{_STD}seq":
            self.bad_tag(node)
            return None
        items = [self.convert(i, depth + 1) for i in node.value]
        return YSeq(tuple(i for i in items if i is not None), self.pos(node))

    def mapping(self, node: yaml.MappingNode, depth: int) -> YMap | None:
        if node.tag != f"{_STD}map":
            self.bad_tag(node)
            return None
        out: dict[object, tuple[YScalar, YNode]] = {}
        merged: dict[object, tuple[YScalar, YNode]] = {}
        for knode, vnode in node.value:
            if knode.tag == f"{_STD}merge":
                self.merge_into(merged, vnode, depth)
                continue
            key = self.convert(knode, depth + 1)
            value = self.convert(vnode, depth + 1)
            if key is None or value is None:
                continue
            if not isinstance(key, YScalar) or isinstance(key.value, (float, bool)) \
                    or key.value is None:
                self.diags.append(error("FG004", "a mapping key must be a name",
                                        self.pos(knode)))
                continue
            if key.value in out:
                first = out[key.value][0].pos
                self.diags.append(error(
                    "FG005", f"key `{key.value}` is written twice in this mapping",
                    key.pos, notes=(f"first written at {first}",),
                    hint="YAML keeps only the last value; remove one of them"))
                continue
            out[key.value] = (YScalar(str(key.value), key.pos), value)
        items = {**merged, **out}
        return YMap(tuple(items.values()), self.pos(node))

    def merge_into(self, merged: dict[object, tuple[YScalar, YNode]], vnode: yaml.Node,
                   depth: int) -> None:
        """`<<: *defaults` (or a list of them): keys written beside it win."""
        sources = vnode.value if isinstance(vnode, yaml.SequenceNode) else [vnode]
        for src in sources:
            value = self.convert(src, depth + 1)
            if not isinstance(value, YMap):
                self.diags.append(error("FG004", "`<<` merges mappings only", self.pos(src)))
                continue
            for k, v in value.items:
                merged.setdefault(k.value, (k, v))


class _TooLarge(Exception):
    def __init__(self, message: str, pos: SourcePos) -> None:
        super().__init__(message)
        self.pos = pos


def read_document(text: str, file: str) -> tuple[YNode | None, list[Diagnostic]]:
    """Parse YAML text into a located tree; problems come back as diagnostics."""
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        return None, [_syntax_error(exc, file)]
    except yaml.YAMLError as exc:
        return None, [error("FG001", f"not valid YAML: {exc}", SourcePos(file, 0, 0))]
    except RecursionError:
        return None, [error("FG008", f"the document is nested more than {MAX_DEPTH} levels deep",
                            SourcePos(file, 0, 0))]
    if root is None:
        return None, [error("FG007", "the graph file is empty", SourcePos(file, 1, 1),
                            hint="a graph file needs at least `nodes:`; see graphs/ppo.yaml")]
    conv = _Converter(file)
    try:
        doc = conv.convert(root)
    except (_TooLarge, RecursionError) as exc:
        pos = exc.pos if isinstance(exc, _TooLarge) else SourcePos(file, 0, 0)
        return None, [*conv.diags, error("FG008", str(exc) or "nested too deeply", pos)]
    return doc, conv.diags


def _syntax_error(exc: yaml.MarkedYAMLError, file: str) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    pos = SourcePos(file, mark.line + 1, mark.column + 1) if mark else SourcePos(file, 0, 0)
    problem = exc.problem or "syntax error"
    context = f" ({exc.context})" if exc.context else ""
    return error("FG001", f"not valid YAML: {problem}{context}", pos,
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
