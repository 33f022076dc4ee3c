"""Diagnostics: every problem the front ends, the checker and the passes find.

A `Diagnostic` has a stable code, a severity, a position, the node and edge it is
about, expected vs actual, notes (such as the chain of dim bindings that led there)
and a fix hint. Three renderers: `text` (a compiler-style snippet with a caret),
`json` and `github` (workflow commands that annotate a pull request).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flowgraph.source import SourcePos

CODES: dict[str, str] = {
    # reading the file
    "FG001": "the file cannot be read or is not valid YAML",
    "FG002": "a YAML tag that could execute code or build objects",
    "FG003": "unknown key",
    "FG004": "a value of the wrong type",
    "FG005": "a key written twice in one mapping",
    "FG006": "a command-line override that cannot be applied",
    "FG007": "a required key is missing",
    "FG008": "the document is too large or too deeply nested",
    # structure
    "FG101": "a name used twice",
    "FG102": "unknown node kind",
    "FG103": "unknown input port",
    "FG104": "a required input is not wired",
    "FG105": "reference to a node or data source that does not exist",
    "FG106": "reference to an output port that does not exist",
    "FG107": "a cycle",
    "FG108": "outputs that are never used",
    "FG109": "a model that is not declared",
    "FG110": "a trainable model that no update node trains",
    "FG111": "a model binding the kind does not take, or a missing one",
    "FG112": "unknown or invalid parameter",
    "FG113": "a plugin module that cannot be imported",
    "FG114": "an update node whose model is not trainable",
    "FG115": "a malformed `node.port` reference",
    "FG116": "log-probs scored at another temperature than the rollout sampled at",
    "FG117": "evaluation asked for (`trainer.eval_every`) with no held-out data",
    "FG118": "n held-out responses a prompt asked for with greedy evaluation",
    "FG119": "LoRA adapters on a model that cannot train them",
    "FG120": "asynchronous rollouts (trainer.max_staleness) in a graph without a rollout",
    "FG121": "staleness that compounds: several optimizer steps per asynchronous rollout",
    "FG122": "old log-probs taken from a rollout that reports none (trainer.old_log_prob)",
    "FG123": "a dataset file or model folder that is not on this machine",
    "FG124": "partial rollouts (trainer.partial_rollouts) where no rollout runs ahead or "
             "none can take new weights between turns",
    "FG125": "a model's init_from that names no trained model of a run with a checkpoint, "
             "or one of another head, adapters or base",
    # contracts
    "FG201": "rank mismatch along an edge",
    "FG202": "dim mismatch along an edge",
    "FG203": "dtype mismatch along an edge",
    "FG204": "a dim that cannot be inferred or proved equal",
    "FG205": "a parameter that contradicts a dim binding",
    "FG206": "an invalid dim string or dims entry",
    # batch arithmetic
    "FG301": "batch not divisible by mini-batch x data-parallel size",
    "FG302": "sample groups split across data-parallel ranks",
    "FG303": "mini-batch not divisible by micro-batch",
    "FG304": "a filter node where it cannot work (no group index, too many groups, a node "
             "after it reading one try's tensor)",
    "FG305": "sequences packed for an attention that is not varlen (an N x N mask)",
    # compilation
    "FG401": "the plan does not fit the declared device memory",
    "FG402": "memory cannot be estimated for a model",
    "FG403": "invalid resource pools",
    "FG404": "one model run both as a causal LM and with a scalar head",
    "FG405": "CPU offload of a model that is not sharded, or of a frozen model's optimizer",
    "FG406": "a pool's GPUs that do not fit its device (none on cuda, idle on cpu)",
    # data and model folders (check --data)
    "FG501": "a dataset that cannot be read or lacks a column its kind reads",
    "FG502": "a dataset without the ground truth a node reads, or rows where it is null/NaN",
    "FG503": "rows longer than their length limit (P or T)",
    "FG504": "a chat template applied with a tokenizer that has none, or chat lists as text",
    "FG505": "fewer dataset rows than one batch",
    "FG506": "a model folder whose config or tokenizer cannot be read",
    "FG507": "a tokenizer vocabulary larger than the model's",
    "FG508": "a model folder's vocabulary and embedding tying",
    "FG509": "a hub id or a path not on this machine, not checked",
    "FG510": "a malformed dataset row: no rows, a null, empty or mistyped prompt or "
             "message, an extra_info that is not a dict",
    "FG511": "preference pairs with identical or empty responses (DPO learns nothing)",
    "FG512": "a reward function (called as TRL calls one) that needs a column the dataset "
             "reaching it does not have",
    "FG513": "a flowgraph run dir as a model path: its newest checkpoint's model is loaded",
    # agents (an agent rollout's budgets, timeouts, tools, env and template)
    "FG601": "an agent rollout's turns and tool results that cannot fit the response "
             "length T",
    "FG602": "an agent rollout timeout that is zero (no timeout) or can never fire",
    "FG603": "a tool whose JSON schema cannot be built",
    "FG604": "a sequence-level loss or correction (GSPO, sequence TIS) on multi-turn "
             "episodes: its sequence is the whole episode",
    "FG605": "an env or tool an agent rollout names that cannot be imported",
    "FG606": "a chat template an agent rollout cannot render turn by turn (check --data)",
    "FG607": "a black-box agent program that is not `async def run(task, client)`, or "
             "given with an env or tools",
    "FG608": "an agent rollout whose episodes take several rows (rows_per_episode) where "
             "a row would count as an episode",
    "FG609": "an agent rollout's env per row (`envs`) that cannot route a row: a row "
             "naming an env the node does not declare (check --data), envs beside env",
    "FG610": "an MCP server an agent rollout declares (mcp_servers) that is not a valid "
             "declaration or does not start (check starts it and lists its tools)",
    "FG611": "a judge that cannot run: a template field that does not exist or whose input "
             "is unwired, a policy that is not a model, neither or both of a model and a "
             "url, or a judge model or url that does not answer a probe (check --data)",
}
"""Every diagnostic code and what it means; codes are stable across releases."""


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One problem, located."""

    code: str
    severity: str
    """`error`, `warning` or `note`."""
    message: str
    pos: SourcePos | None = None
    node: str | None = None
    edge: str | None = None
    """`producer.out -> consumer.in`."""
    expected: str | None = None
    actual: str | None = None
    hint: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown diagnostic code {self.code}")
        if self.severity not in ("error", "warning", "note"):
            raise ValueError(f"unknown severity {self.severity}")

    @property
    def is_error(self) -> bool:
        return self.severity == "error"

    def one_line(self) -> str:
        where = f"{self.pos}: " if self.pos else ""
        return f"{where}{self.severity}[{self.code}]: {self.message}"

    def summary(self, indent: str = "") -> str:
        """`one_line`, then its expected and actual values, notes and hint on lines of
        their own: what `flowgraph check` prints, less the source snippet (the message of
        a Python API's error and a printed `CheckResult`, where the file:line is enough)."""
        extra = [*([f"expected: {self.expected}"] if self.expected is not None else []),
                 *([f"actual:   {self.actual}"] if self.actual is not None else []),
                 *(f"note: {n}" for n in self.notes),
                 *([f"hint: {self.hint}"] if self.hint else [])]
        return "\n".join([indent + self.one_line(), *(f"{indent}  = {e}" for e in extra)])

    def to_json(self) -> dict[str, object]:
        pos = self.pos
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "file": pos.file if pos else None,
            "line": pos.line if pos else None,
            "column": pos.col if pos else None,
            "node": self.node,
            "edge": self.edge,
            "expected": self.expected,
            "actual": self.actual,
            "hint": self.hint,
            "notes": list(self.notes),
        }


def error(code: str, message: str, pos: SourcePos | None = None, **kw: object) -> Diagnostic:
    return Diagnostic(code, "error", message, pos, **kw)  # type: ignore[arg-type]


def warning(code: str, message: str, pos: SourcePos | None = None, **kw: object) -> Diagnostic:
    return Diagnostic(code, "warning", message, pos, **kw)  # type: ignore[arg-type]


def sort_key(d: Diagnostic) -> tuple[str, int, int, str]:
    p = d.pos
    return (p.file if p else "", p.line if p else 0, p.col if p else 0, d.code)


# --- renderers -------------------------------------------------------------------

SourceLines = Callable[[str], list[str] | None]
"""file -> its lines (None when it cannot be read), for snippets."""

_COLORS = {"error": "\033[31;1m", "warning": "\033[33;1m", "note": "\033[36;1m"}
_BOLD, _RESET, _BLUE = "\033[1m", "\033[0m", "\033[34;1m"


def render_text(diags: Iterable[Diagnostic], lines_of: SourceLines, color: bool = False) -> str:
    """Compiler-style: `file:line:col: error[FG202]: message`, snippet, caret, notes."""
    return "\n".join(_render_one(d, lines_of, color) for d in diags)


def _paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{_RESET}" if color else text


def _render_one(d: Diagnostic, lines_of: SourceLines, color: bool) -> str:
    where = f"{d.pos}: " if d.pos else ""
    head = _paint(f"{d.severity}[{d.code}]", _COLORS[d.severity], color)
    out = [f"{_paint(where, _BOLD, color)}{head}: {_paint(d.message, _BOLD, color)}"]
    out += _snippet(d.pos, lines_of, color)
    bar = _paint("   =", _BLUE, color)
    if d.expected is not None:
        out.append(f"{bar} expected: {d.expected}")
    if d.actual is not None:
        out.append(f"{bar} actual:   {d.actual}")
    out += [f"{bar} note: {n}" for n in d.notes]
    if d.hint:
        out.append(f"{bar} {_paint('hint', _BOLD, color)}: {d.hint}")
    return "\n".join(out) + "\n"


def _snippet(pos: SourcePos | None, lines_of: SourceLines, color: bool) -> list[str]:
    if pos is None or pos.line <= 0:
        return []
    lines = lines_of(pos.file)
    if not lines or pos.line > len(lines):
        return []
    text = lines[pos.line - 1].rstrip("\n")
    if len(text) > 200:
        return []
    num = str(pos.line)
    pad = " " * len(num)
    start = max(pos.col - 1, 0)
    width = _token_width(text, start)
    caret = " " * start + _paint("^" * width, _COLORS["error"], color)
    gutter = _paint(f"{pad} |", _BLUE, color)
    return [gutter, f"{_paint(num + ' |', _BLUE, color)} {text}", f"{gutter} {caret}"]


def _token_width(text: str, start: int) -> int:
    end = start
    while end < len(text) and not text[end].isspace() and text[end] not in ",}]#":
        end += 1
    return max(end - start, 1)


def render_json(diags: Iterable[Diagnostic]) -> str:
    return json.dumps([d.to_json() for d in diags], indent=2)


def _gh_escape(text: str, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def render_github(diags: Iterable[Diagnostic]) -> str:
    """GitHub Actions workflow commands: `::error file=F,line=L,col=C,title=T::message`."""
    out = []
    for d in diags:
        level = "error" if d.is_error else ("warning" if d.severity == "warning" else "notice")
        props = []
        if d.pos and d.pos.line > 0:
            props += [f"file={_gh_escape(d.pos.file, True)}", f"line={d.pos.line}",
                      f"col={d.pos.col}"]
        props.append(f"title={_gh_escape(d.code + ' ' + CODES[d.code], True)}")
        body = d.message
        if d.expected is not None:
            body += f"\nexpected: {d.expected}\nactual: {d.actual}"
        body += "".join(f"\nnote: {n}" for n in d.notes)
        if d.hint:
            body += f"\nhint: {d.hint}"
        out.append(f"::{level} {','.join(props)}::{_gh_escape(body)}")
    return "\n".join(out)
