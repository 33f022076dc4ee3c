"""The reader's and the checker's short ways, each against the long way it stands for.

`read_document` reads plain block YAML line by line (`flowgraph/blockyaml.py`) and
anything else through libyaml's events, where it takes most scalars without resolving
them (a memo by text, and plain text no other type can start with), builds most
mappings without the duplicate-key walk; the checker settles most edges in `_fits`
without `_unify_edge`. Each short way must give exactly what the long way
gives: the same document with the same positions, the same diagnostics (codes,
positions, messages), the same inferred dims. Checked on every file under graphs/, on
texts built to hit the corners, and on random graphs and their mutations.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flowgraph.blockyaml as blockyaml
import flowgraph.check.shapes as shapes
import flowgraph.document as document
from flowgraph.check import CheckResult, check_graph
from flowgraph.diagnostics import Diagnostic
from flowgraph.document import YNode, paused_gc, read_document
from flowgraph.frontend import load_graph
from flowgraph.testing.strategies import graph_texts, mutate

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = sorted((ROOT / "graphs").glob("**/*.yaml"))
EXAMPLES = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "graphs").glob("*.yaml"))]
CI = settings(max_examples=40, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])

CORNERS = {
    "exponent floats": "a: 1e-5\nb: [1e-5, '1e-5', 1E5, +2e3, 1e-5]\nc: {1e-5: x}\n",
    "a date that is not one, twice": "a: 2001-13-45\nb: [2001-13-45, 2001-12-14]\n",
    "merge key, and `<<` as a value": "d: &d {x: 1}\ne: {y: <<, <<: *d}\nf: {<<: *d, z: <<}\n",
    "duplicate keys": "a: 1\nb: {k: 1, k: 2, 1: x, 1: y, true: t}\na: 3\n",
    "keys that are not names": "? [a, b]\n: 1\n1.5: x\nnull: y\n~: z\n",
    "YAML 1.1 booleans and nulls": "a: [yes, no, on, off, y, n, ~, null, Null, '', \"\"]\n",
    "tags among plain values": "a: !!str 1\nb: !custom 3\nc: [!!int 7, 7, !!float 7]\n",
    "anchored scalars": "a: &x 1e-5\nb: *x\nc: &y gen.responses\nd: [*y, *y]\n",
    "numbers of every form": "a: [0x1F, 0o17, 1_000, 1:30, .inf, -.inf, .nan, 12, -3, +4]\n",
    "block scalars and quotes": "a: |\n  text\nb: >\n  folded\nc: 'single'\nd: \"double\"\n",
    "an empty mapping and list": "a: {}\nb: []\nc:\nd: [{}, [], {e: []}]\n",
    "a scalar at the top": "just text\n",
    "a list at the top": "- 1e-5\n- yes\n- [a, 1]\n",
    "two documents": "a: 1\n---\nb: 2\n",
    "deep, within the limit": "a: " + "[" * 60 + "1" + "]" * 60 + "\n",
    "deep, past the limit": "a: " + "[" * 70 + "1" + "]" * 70 + "\n",
    # Near the edge of what blockyaml reads: each is read the same either way.
    "a key with nothing under it": "a:\nb: 1\nc:   # nothing\n",
    "keys YAML 1.1 reads as bool and null": "on: 1\nnull: 2\nOff: {Yes: 3}\n",
    "a colon in a value": "a: b: c\nd: e:f\ng: {h: i:j}\nk: builtin:tiny-lm\n",
    "comments and hashes": "a: b #c\nd: e#f\ng: 'h' # i\nj: \"k#l\"#m\nn: {o: p} # q\n",
    "lists written three ways":
        "a:\n- 1\n- x\nb:\n    - [1, 2]\n    - {c: d}\ne: [f, [g, {h: i}]]\n",
    "lists holding blocks": "a:\n  - b: 1\n  -\n    c\n  - - d\n",
    "a list item that is a key": "a:\n  - x\n  b: 1\n",
    "bad indentation": "a:\n    b: 1\n  c: 2\nd: 3\n",
    "a value on its own line": "a:\n  plain\nb: two\n  lines\n",
    "tabs and carriage returns": "a:\t1\r\nb: 2\r\n",
    "a key written twice, deep": "a:\n  b: 1\n  b: 2\nc: {d: 1, d: 2}\n",
    "flow oddities": "a: {b:1}\nc: [d, ]\ne: {f: 1,}\ng: {h, i: j}\nk: [l\n  , m]\n",
    "unusual plain values": "a: =\nb: <<\nc: -\nd: -.5\ne: 1_000\nf: 2001-13-45\ng: ~\n",
    "quotes with escapes": "a: \"b\\\"c\"\nd: 'it''s'\ne: \"f\\tg\"\n",
    "not ASCII": "a: caf\u00e9\n# \u2014 a dash\nb: 1\n",
    "a document marker": "---\na: 1\n",
    "indented root": "  a: 1\n  b: {c: 2}\n",
    "an indented list at the root, then less": " - 0\n- \n",
    "a mapping, then less indented": "  a: 1\nb: 2\n",
}


def _long_way(self: Any, events: Iterator[Any]) -> None:
    """`_Composer.run` without its short ways: every scalar through the general
    `tagged` (resolved, constructed), every event by an `isinstance` chain."""
    for event in events:
        if isinstance(event, yaml.ScalarEvent):
            self.tagged(event)
        elif isinstance(event, yaml.CollectionStartEvent):
            self.open(event)
        elif isinstance(event, yaml.CollectionEndEvent):
            self.close(event)
        elif isinstance(event, yaml.AliasEvent):
            self.alias(event)
        elif isinstance(event, yaml.DocumentStartEvent):
            self.document(event)


@contextmanager
def long_way() -> Iterator[None]:
    """Read and check without any short way."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blockyaml, "read_block", lambda text, file: None)
        mp.setattr(document._Composer, "run", _long_way)
        mp.setattr(document._Composer, "mapping", document._Composer.checked_mapping)
        mp.setattr(shapes, "_fits", lambda *args: None)
        yield


def read(text: str) -> tuple[YNode | None, list[Diagnostic]]:
    return read_document(text, "f.yaml")


def checked(text: str) -> tuple[object, ...]:
    """Everything loading and checking `text` tells: diagnostics, IR and inferred facts."""
    graph, diags = load_graph("f.yaml", text=text)
    if graph is None:
        return (graph, diags)
    result: CheckResult = check_graph(graph)
    s = result.shapes
    return (graph, diags, result.diagnostics, s.edges, s.outputs, s.batch, s.env.values,
            s.env.locals_, s.env.why)


def both_ways(text: str) -> None:
    short = (read(text), checked(text))
    with long_way():
        long = (read(text), checked(text))
    assert short == long


@pytest.mark.parametrize("path", GRAPHS, ids=[str(p.relative_to(ROOT)) for p in GRAPHS])
def test_every_graph_file_reads_and_checks_the_same_both_ways(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two broken graphs use plugin kinds from tests/plugins (see test_graphs_dir.py).
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins"))
    both_ways(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(CORNERS))
def test_corner_cases_read_the_same_both_ways(name: str) -> None:
    both_ways(CORNERS[name])


def test_the_scalar_memo_reports_every_bad_value_where_it_is() -> None:
    # Values that fail are never remembered: each occurrence has its own FG004.
    doc, diags = read(CORNERS["a date that is not one, twice"])
    assert [(d.code, d.pos.line, d.pos.col) for d in diags if d.pos] == [
        ("FG004", 1, 4), ("FG004", 2, 5)]
    assert document.plain(doc) == {"b": ["2001-12-14"]}


def test_the_scalar_memo_keeps_each_position_and_type() -> None:
    doc, diags = read(CORNERS["exponent floats"])
    assert [(d.code, d.pos.line, d.pos.col) for d in diags if d.pos] == [("FG004", 3, 5)]
    assert isinstance(doc, document.YMap)
    b = doc.get("b")
    assert isinstance(b, document.YSeq)
    assert [(i.value, i.pos.col) for i in b.items if isinstance(i, document.YScalar)] == [
        (1e-5, 5), ("1e-5", 11), (1e5, 19), (2e3, 24), (1e-5, 30)]


def test_a_merge_key_is_never_taken_for_a_value() -> None:
    _, diags = read(CORNERS["merge key, and `<<` as a value"])
    assert [(d.code, d.pos.line, d.pos.col) for d in diags if d.pos] == [
        ("FG002", 2, 8), ("FG002", 3, 16)]


@pytest.mark.parametrize("path", GRAPHS, ids=[str(p.relative_to(ROOT)) for p in GRAPHS])
def test_libyaml_and_the_pure_python_parser_read_the_same(path: Path) -> None:
    # Syntax errors are worded by each parser in its own way; code and place agree.
    text = path.read_text(encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(document, "_Loader", yaml.SafeLoader)
        pure = read(text)
    fast = read(text)
    assert fast[0] == pure[0]
    assert [(d.code, d.pos) for d in fast[1]] == [(d.code, d.pos) for d in pure[1]]
    if not any(d.code == "FG001" for d in fast[1]):
        assert fast[1] == pure[1]


@CI
@given(graph_texts())
def test_random_graphs_read_and_check_the_same_both_ways(text: str) -> None:
    both_ways(text)


@CI
@given(st.one_of(graph_texts(), st.sampled_from(EXAMPLES)).flatmap(mutate))
def test_mutated_graphs_read_and_check_the_same_both_ways(m: Any) -> None:
    both_ways(m.text)


YAMLISH = st.text(alphabet="ab:-{}[],. \n#&*!'\"0123456789eE_<>|~?", max_size=300)
"""Near-YAML noise: anchors, aliases, tags, merge keys, flow and block collections."""


@settings(CI, max_examples=100)
@given(st.one_of(YAMLISH, st.sampled_from(list(CORNERS.values()))))
def test_yaml_noise_reads_the_same_both_ways(text: str) -> None:
    both_ways(text)


def test_paused_gc_resumes_and_still_collects_cycles() -> None:
    class Node:
        other: object = None

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
    assert gc.isenabled()
    gc.collect()
    assert alive() is None


def test_paused_gc_leaves_objects_the_program_froze_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with paused_gc():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


# --- blockyaml: the subset it reads, written every way it may be written ----------------

_NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,5}", fullmatch=True).filter(
    lambda s: document.plain_value(s) == (s,))  # not `on`, `null`, `No`: YAML 1.1 reads those
_FLOW_PLAIN = st.one_of(_NAME, st.sampled_from([
    "gen.responses", "1.0e-5", "1e-5", "-3", "+4", "0.95", "-.5", ".inf", "true", "False",
    "~", "null", "0x1F", "1_000", "2001-12-14", "a b  c", "x-y", "$HOME/run", "f(x)=y^2"]))
_BLOCK_PLAIN = st.one_of(_FLOW_PLAIN, st.sampled_from(["builtin:tiny-lm", "1:30", "a:b:c"]))
_QUOTED = st.one_of(
    st.from_regex(r'"[ !#-\[\]-~]{0,8}"', fullmatch=True),  # no `"` or `\` inside
    st.from_regex(r"'[ -&(-~]{0,8}'", fullmatch=True))      # no `'` inside


def _nest(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    sep = st.sampled_from([", ", ",", ",  "])
    entries = st.dictionaries(_NAME, inner, max_size=3).map(lambda d: list(d.items()))
    return st.one_of(
        st.tuples(st.lists(inner, max_size=3), sep).map(lambda t: "[" + t[1].join(t[0]) + "]"),
        st.tuples(entries, sep, st.sampled_from([" ", "  "])).map(
            lambda t: "{" + t[1].join(f"{k}:{t[2]}{v}" for k, v in t[0]) + "}"))


_IN_FLOW = st.recursive(st.one_of(_FLOW_PLAIN, _QUOTED), _nest, max_leaves=6)
_ONE_LINE = st.one_of(_BLOCK_PLAIN, _QUOTED, _nest(_IN_FLOW))
"""What may follow `key: ` or `- `: a scalar, or a flow mapping or list on one line."""


_COMMENT = st.sampled_from(["", "", "  # why", " #", "   "])


@st.composite
def _block(draw: st.DrawFn, indent: int = 0, depth: int = 0) -> list[str]:
    """The lines of a block mapping at `indent`: one-line values, nested mappings and
    lists (indented, or at the key's own indentation), comments and blank lines."""
    lines, pad = [], " " * indent
    for key in draw(st.lists(_NAME, min_size=1, max_size=4, unique=True)):
        lines += draw(st.lists(st.sampled_from(["", "# a comment", "   ", " " * indent + "# c"]),
                               max_size=1))
        shape = draw(st.sampled_from(["value", "value", "map", "list"] if depth < 3
                                     else ["value"]))
        if shape == "value":
            gap = draw(st.sampled_from([" ", "  "]))
            lines.append(f"{pad}{key}:{gap}{draw(_ONE_LINE)}{draw(_COMMENT)}")
        elif shape == "map":
            lines.append(f"{pad}{key}:{draw(_COMMENT)}")
            lines += draw(_block(indent + draw(st.integers(1, 4)), depth + 1))
        else:
            lines.append(f"{pad}{key}:{draw(_COMMENT)}")
            at = " " * (indent + draw(st.integers(0, 3)))
            lines += [f"{at}-{draw(st.sampled_from([' ', '  ']))}{item}"
                      for item in draw(st.lists(_ONE_LINE, min_size=1, max_size=3))]
    return lines


@settings(CI, max_examples=150)
@given(_block(), st.sampled_from(["\n", ""]))
def test_blockyaml_reads_its_subset_as_the_long_way_does(lines: list[str], end: str) -> None:
    text = "\n".join(lines) + end
    quick = blockyaml.read_block(text, "f.yaml")
    assert quick is not None, text  # it reads what it says it reads
    with long_way():
        assert read(text) == (quick, [])


def test_blockyaml_reads_the_benchmark_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    # The 10,000-node benchmark goes the short way (a 700-node cut of it here).
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_check import synthetic_graph

    text = synthetic_graph(700)
    quick = blockyaml.read_block(text, "f.yaml")
    assert quick is not None
    with long_way():
        assert read(text) == (quick, [])
