"""`flowgraph viz`: draw a graph as Mermaid, Graphviz DOT or SVG.

The drawing is what the checker knows about the graph: data sources (cylinders),
nodes (boxes) and update nodes (double-bordered), each labelled with its name, kind
and model; one edge per wired input, labelled `out → in` and with the shape the
checker inferred for it, e.g. `(Bp*N, T) = (16, 8)`. An edge that breaks its contract
is red. A graph with errors is still drawn — every edge whose two ends exist — and
`write_viz` returns 1 after writing it.

    flowgraph viz graphs/ppo.yaml -o ppo.mmd      # paste into a Markdown ```mermaid block
    flowgraph viz graphs/ppo.yaml -o ppo.dot      # dot -Tpng ppo.dot > ppo.png
    flowgraph viz graphs/ppo.yaml -o ppo.svg      # needs Graphviz's `dot` on PATH

A compiled plan (`flowgraph compile -o plan.json`) is drawn as it will run: its nodes
and data sources, each labelled with its pool and stage as well, and one edge per wired
input with the shape the plan records and how the tensor moves when it is not `local`
(`split`, `gather`, ...):

    flowgraph viz plan.json -o plan.mmd

The output depends only on the graph (or the plan): nodes in file order (data sources
first), edges in the order the inputs are written.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flowgraph.checker import CheckResult, check_graph
from flowgraph.diagnostics import Diagnostic
from flowgraph.errors import FlowgraphError
from flowgraph.frontend import load_graph
from flowgraph.ir import DataSpec, NodeSpec, PortRef
from flowgraph.plan import ExecutionPlan, plan_from_json

__all__ = ["Drawing", "VizEdge", "VizNode", "drawing", "plan_drawing", "to_dot", "to_mermaid",
           "write_viz"]

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2
FORMATS = ("mmd", "dot", "svg")
_EXTENSIONS = {".mmd": "mmd", ".mermaid": "mmd", ".dot": "dot", ".gv": "dot", ".svg": "svg"}
USAGE = "usage: flowgraph viz FILE [KEY=VALUE...] -o OUT.{mmd,dot,svg} [--format mmd|dot|svg]"
NO_GRAPHVIZ = (
    "flowgraph: error: SVG output needs Graphviz's `dot`, which is not installed "
    "(apt-get install graphviz, or brew install graphviz); or write .dot or .mmd instead"
)


@dataclass(frozen=True, slots=True)
class VizNode:
    """A data source or node as drawn."""

    name: str
    kind: str
    model: str | None
    role: str
    """`data`, `node`, `update`, or `unknown` (a kind the registry does not know here)."""
    where: str = ""
    """Where a plan runs it (`pool main, step.2`); empty for a graph."""


@dataclass(frozen=True, slots=True)
class VizEdge:
    """One wired input as drawn."""

    src: PortRef
    dst: str
    port: str
    shape: str | None
    """The checker's label for the tensor on the edge; None when it inferred none."""
    failing: bool
    """The edge breaks its contract or is named by an error."""
    dispatch: str = ""
    """How a plan moves the tensor when not `local` (`split`, `gather`, ...)."""

    @property
    def text(self) -> str:
        return f"{self.src} -> {self.dst}.{self.port}"


@dataclass(frozen=True, slots=True)
class Drawing:
    """Everything both renderers need, in drawing order."""

    name: str
    nodes: tuple[VizNode, ...]
    edges: tuple[VizEdge, ...]


def drawing(result: CheckResult) -> Drawing:
    """What to draw: the first producer of each name, every edge whose ends exist."""
    nodes = tuple(_viz_node(r.spec, r.kind is None, bool(r.kind and r.kind.trains))
                  for r in result.table.values())
    infos = {(str(e.src), e.dst, e.port): e for e in result.shapes.edges}
    bad = {d.edge for d in result.diagnostics if d.is_error and d.edge}
    edges = []
    for r in result.table.values():
        if not isinstance(r.spec, NodeSpec):
            continue
        for port, ref in r.spec.inputs:
            if ref.node not in result.table:
                continue
            info = infos.get((str(ref), r.name, port))
            failing = (info is not None and not info.ok) or f"{ref} -> {r.name}.{port}" in bad
            edges.append(VizEdge(ref, r.name, port, info.label if info else None, failing))
    return Drawing(result.graph.name, nodes, tuple(edges))


def plan_drawing(plan: ExecutionPlan) -> Drawing:
    """What to draw of a compiled plan: its nodes where they run, its edges as they move."""
    nodes = tuple(VizNode(n.name, n.kind, n.model,
                          "data" if n.category == "data" else "update" if n.trains else "node",
                          f"pool {n.pool}, {n.stage}" + (" (data-parallel)" if n.data_parallel
                                                          else ""))
                  for n in plan.nodes)
    moves = {(e.src, e.dst): e.dispatch for e in plan.edges}
    edges = tuple(VizEdge(PortRef(*i.ref), n.name, i.port, i.shape or None, False,
                          moves.get((i.src, f"{n.name}.{i.port}"), "").replace("local", ""))
                  for n in plan.nodes for i in n.inputs)
    return Drawing(f"{plan.name} (plan, target {plan.target})", nodes, edges)


def _viz_node(spec: NodeSpec | DataSpec, unknown: bool, trains: bool) -> VizNode:
    if unknown:
        role = "unknown"
    elif isinstance(spec, DataSpec):
        role = "data"
    else:
        role = "update" if trains else "node"
    model = spec.model if isinstance(spec, NodeSpec) else None
    return VizNode(spec.name, spec.kind, model, role)


def _label_lines(n: VizNode) -> list[str]:
    lines = [n.name, n.kind if n.role != "unknown" else f"{n.kind} (unknown kind)"]
    if n.model is not None:
        lines.append(f"{'trains' if n.role == 'update' else 'model'}: {n.model}")
    return lines + ([n.where] if n.where else [])


def _edge_lines(e: VizEdge) -> list[str]:
    return [f"{e.src.port} → {e.port}", *([e.shape] if e.shape else []),
            *([e.dispatch] if e.dispatch else [])]


# --- Mermaid ---------------------------------------------------------------------------

# Inside a quoted Mermaid label these would end the label, open a shape, or be read
# as HTML; Mermaid decodes `#name;` and `#123;` entity codes back to the character.
_MERMAID_ESCAPES = {
    '"': "#quot;", "#": "#35;", "&": "#amp;", "<": "#lt;", ">": "#gt;", "|": "#124;",
    "[": "#91;", "]": "#93;", "{": "#123;", "}": "#125;", "`": "#96;",
    "\n": " ", "\r": " ", "\t": " ",
}
_MERMAID_SHAPES = {"data": '[("{}")]', "node": '["{}"]', "update": '[["{}"]]',
                   "unknown": '["{}"]'}
# Mermaid gives every drawn node the CSS class `node`, so roles get other class names.
_MERMAID_CLASSES = {
    "data": "source fill:#e8f1fb,stroke:#4a78b5",
    "node": "compute fill:#ffffff,stroke:#555555",
    "update": "update fill:#fde9d9,stroke:#c0504d,stroke-width:3px",
    "unknown": "unknown fill:#ffffff,stroke:red,stroke-dasharray:5 5",
}


def mermaid_escape(text: str) -> str:
    return "".join(_MERMAID_ESCAPES.get(c, c) for c in text)


def _mermaid_label(lines: list[str]) -> str:
    return "<br/>".join(mermaid_escape(line) for line in lines)


def _mermaid_id(name: str) -> str:
    # A prefix keeps node names clear of Mermaid keywords (`end`, `graph`, `style`).
    return f"n_{name}"


def to_mermaid(d: Drawing) -> str:
    """A `flowchart LR`; failing edges get `linkStyle N stroke:red`."""
    out = [f"%% flowgraph: {mermaid_escape(d.name)}", "flowchart LR"]
    out += [f"  classDef {style}" for style in _MERMAID_CLASSES.values()]
    for n in d.nodes:
        shape = _MERMAID_SHAPES[n.role].format(_mermaid_label(_label_lines(n)))
        css = _MERMAID_CLASSES[n.role].split()[0]
        out.append(f"  {_mermaid_id(n.name)}{shape}:::{css}")
    for e in d.edges:
        label = _mermaid_label(_edge_lines(e))
        out.append(f'  {_mermaid_id(e.src.node)} -->|"{label}"| {_mermaid_id(e.dst)}')
    out += [f"  linkStyle {i} stroke:red,stroke-width:3px,color:red"
            for i, e in enumerate(d.edges) if e.failing]
    return "\n".join(out) + "\n"


# --- Graphviz DOT ----------------------------------------------------------------------

_DOT_STYLES = {
    "data": 'shape=cylinder, style=filled, fillcolor="#e8f1fb", color="#4a78b5"',
    "node": 'shape=box, style="rounded,filled", fillcolor="#ffffff", color="#555555"',
    "update": 'shape=box, style="filled,bold", peripheries=2, fillcolor="#fde9d9", '
              'color="#c0504d"',
    "unknown": 'shape=box, style="dashed", color=red',
}


def dot_quote(text: str) -> str:
    """A DOT double-quoted string; `<`, `>`, `|`, `{` are literal in non-record shapes."""
    for char in "\r\n\t":
        text = text.replace(char, " ")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot_label(lines: list[str]) -> str:
    # Join after quoting each line, so the `\n` escapes are the only ones left raw.
    return "\\n".join(dot_quote(line)[1:-1] for line in lines).join('""')


def to_dot(d: Drawing) -> str:
    """A `digraph`; failing edges are `color=red, fontcolor=red`."""
    out = [
        f"digraph {dot_quote(d.name)} {{",
        f"  graph [rankdir=LR, label={dot_quote(d.name)}, labelloc=t, fontname=Helvetica];",
        "  node [fontname=Helvetica, fontsize=11];",
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    for n in d.nodes:
        out.append(f"  {dot_quote(n.name)} [label={_dot_label(_label_lines(n))}, "
                   f"{_DOT_STYLES[n.role]}];")
    for e in d.edges:
        red = ", color=red, fontcolor=red, penwidth=2" if e.failing else ""
        out.append(f"  {dot_quote(e.src.node)} -> {dot_quote(e.dst)} "
                   f"[label={_dot_label(_edge_lines(e))}{red}];")
    out.append("}")
    return "\n".join(out) + "\n"


# --- the command -----------------------------------------------------------------------


def format_of(output: str, fmt: str | None) -> str | None:
    """The explicit format, else the one the output's extension names, else None."""
    if fmt is not None:
        return fmt if fmt in FORMATS else None
    return _EXTENSIONS.get(Path(output).suffix.lower())


def write_viz(file: str | Path, output: str | Path, *, overrides: Sequence[str] = (),
              fmt: str | None = None) -> int:
    """Draw `file` into `output`; the exit code: 0, 1 (drawn, with errors; or not drawn:
    no Graphviz, or `output` cannot be written) or 2 (a wrong format, an unreadable
    graph file)."""
    chosen = format_of(str(output), fmt)
    if chosen is None:
        why = (f"unknown format `{fmt}`" if fmt is not None
               else f"cannot tell the format of `{output}` from its extension")
        print(USAGE, file=sys.stderr)
        print(f"flowgraph viz: error: {why}: use an .mmd, .dot or .svg file name, or pass "
              "--format mmd|dot|svg", file=sys.stderr)
        return EXIT_USAGE
    dot_exe = shutil.which("dot") if chosen == "svg" else None
    if chosen == "svg" and dot_exe is None:
        print(NO_GRAPHVIZ, file=sys.stderr)
        return EXIT_ERRORS
    if str(file).endswith(".json"):  # a compiled plan, as `flowgraph run` tells one
        return _write_plan_viz(file, output, chosen, dot_exe, overrides)
    graph, diags = load_graph(file, overrides)
    if graph is None:
        _print_errors(diags)
        return EXIT_USAGE
    result = check_graph(graph)
    d = drawing(result)
    if not _render(d, output, chosen, dot_exe):
        return EXIT_ERRORS
    failing = sum(e.failing for e in d.edges)
    print(f"{output}: {len(d.nodes)} nodes, {len(d.edges)} edges, {failing} failing")
    errors = [x for x in (*diags, *result.diagnostics) if x.is_error]
    _print_errors(errors)
    return EXIT_ERRORS if errors else EXIT_OK


def _write_plan_viz(file: str | Path, output: str | Path, chosen: str, dot_exe: str | None,
                    overrides: Sequence[str]) -> int:
    """Draw the plan file `file` (read and verified as `flowgraph run` reads it; its kinds
    and Python objects are not needed to draw it)."""
    if overrides:
        print(f"flowgraph viz: error: a compiled plan is drawn as it is: "
              f"{', '.join(overrides)} would change it; compile the graph again with them",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        plan = plan_from_json(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, FlowgraphError) as exc:
        print(f"flowgraph: error: cannot draw the plan `{file}`: {exc}", file=sys.stderr)
        return EXIT_USAGE
    d = plan_drawing(plan)
    if not _render(d, output, chosen, dot_exe):
        return EXIT_ERRORS
    print(f"{output}: {len(d.nodes)} nodes, {len(d.edges)} edges (the plan for target "
          f"{plan.target})")
    return EXIT_OK


def _render(d: Drawing, output: str | Path, chosen: str, dot_exe: str | None) -> bool:
    """`d` written to `output` in the format `chosen`; False (said on stderr) when not."""
    try:
        content = to_mermaid(d).encode() if chosen == "mmd" else to_dot(d).encode()
        if dot_exe is not None:
            content = _svg(content, dot_exe)
    except _GraphvizFailed as exc:
        print(f"flowgraph: error: {exc}", file=sys.stderr)
        return False
    return _write(output, content)


class _GraphvizFailed(Exception):
    """`dot` could not be run or rejected its input."""


def _svg(dot_text: bytes, dot_exe: str) -> bytes:
    try:
        done = subprocess.run([dot_exe, "-Tsvg"], input=dot_text, capture_output=True,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _GraphvizFailed(f"running Graphviz's `{dot_exe}` failed: {exc}") from exc
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise _GraphvizFailed(f"Graphviz's `dot` exited with status {done.returncode}: "
                              f"{why[0] if why else 'no message'}")
    return bytes(done.stdout)


def _write(output: str | Path, content: bytes) -> bool:
    try:
        Path(output).write_bytes(content)
    except OSError as exc:
        print(f"flowgraph: error: cannot write `{output}`: {exc.strerror or exc}",
              file=sys.stderr)
        return False
    return True


def _print_errors(diags: Sequence[Diagnostic]) -> None:
    for d in diags:
        if d.is_error:
            print(d.one_line(), file=sys.stderr)
