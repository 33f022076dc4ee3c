"""How a message names what the user changes: in the words of the entry point they came
through. `flowgraph run g.yaml` reads `continue it with --resume`; `flowgraph.run(g)` (a
script, a notebook) reads `continue it with resume=True`. The words are chosen here, once,
from `OPTIONS`; a message says *which* option, never how it is spelt.

    with python_entry():                 flowgraph.run / compile / check / export: the
        ...                              messages of their work speak Python
    option("resume")                     `--resume`                | `resume=True`
    option("allow_changed", ["dims.Bp"]) `--allow-changed dims.Bp` | `allow_changed=['dims.Bp']`
    option("run_dir", "runs/new")        `trainer.run_dir=runs/new`| `run_dir='runs/new'`
    command("run", "g.yaml", [("resume", True)])
                                         `flowgraph run g.yaml --resume`
                                         | `flowgraph.run('g.yaml', resume=True)`

The entry point is an environment variable (`ENTRY_ENV`), so that every process of a run
(fsdp ranks, Ray workers) speaks as the one that started it; the command line is the
default.

A hint that says what to change *in the graph* speaks as the graph was written, whatever
the entry point: a graph file's YAML, or `GraphBuilder`'s keywords for a graph built in
Python (`graph_written_in`, set by the checker for the graph it checks):

    wiring("row", "gen.row")             `inputs: {row: gen.row}`  | `row=gen.row`
    param_setting("old", "temperature", 0.7)
                                         `nodes.old.params.temperature: 0.7`
                                         | `params={'temperature': 0.7}` on node `old`
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any

ENTRY_ENV = "FLOWGRAPH_ENTRY"
"""`python` while `flowgraph.run` (or another function of the Python API) works; unset:
the command line."""

OPTIONS: dict[str, str] = {
    "resume": "--resume",
    "overwrite": "--overwrite",
    "allow_changed": "--allow-changed",
    "target": "--target",
    "nproc": "--nproc",
    "disable": "--disable-pass",
    "debug": "--debug",
    "data": "--data",
    "force": "--force",
    "step": "--step",
    "adapter_only": "--adapter-only",
    "metrics_port": "--metrics-port",
    "address": "--address",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "rdzv_endpoint": "--rdzv-endpoint",
    "rdzv_timeout": "--rdzv-timeout",
    "model": "--model",
    "out": "-o",
    "run_dir": "trainer.run_dir=",
    "overrides": "",
}
"""Each argument of the Python API -> its command-line spelling: a flag (a list value
repeats it), `trainer.run_dir=` (an override), or `` (the overrides themselves). Not
read off the parser (`flowgraph.cli.build_parser`, the entry layer, above every module
that speaks): `tests/core/test_spelling.py` holds each flag to the parser's and each name
to the API's arguments."""


PYTHON_SOURCE = "<python>"
"""`Graph.source` of a graph `GraphBuilder` built (no file)."""

_GRAPH_IN_PYTHON: ContextVar[bool] = ContextVar("graph_in_python", default=False)


class Word(str):
    """A value written as it is in both voices (a placeholder: `step=N`, `--step N`)."""


def from_python() -> bool:
    return os.environ.get(ENTRY_ENV) == "python"


@contextmanager
def inherited(name: str, value: str) -> Iterator[None]:
    """Environment variable `name` set to `value` in the body: a setting of this process
    that the processes it starts (fsdp ranks, Ray workers, the producer) inherit."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def python_entry() -> AbstractContextManager[None]:
    """Messages raised in the body (in this process and those it starts) speak Python."""
    return inherited(ENTRY_ENV, "python")


def option(name: str, value: Any = True) -> str:
    """Option `name` set to `value`, as the entry point spells it."""
    if from_python():
        return _python(name, value)
    tokens = _tokens(name, value)
    return " ".join(tokens if isinstance(value, Word) else map(shlex.quote, tokens))


def command(verb: str, subject: str, options: Sequence[tuple[str, Any]]) -> str:
    """A whole call: `flowgraph VERB SUBJECT OPTIONS` or `flowgraph.VERB(SUBJECT, OPTIONS)`;
    an option whose value is empty (False, [], None) is left out."""
    given = [(n, v) for n, v in options if v not in (False, None, (), [])]
    if from_python():
        first = subject if isinstance(subject, Word) else repr(subject)
        return f"flowgraph.{verb}({', '.join([first, *(_python(n, v) for n, v in given)])})"
    return shlex.join(["flowgraph", verb, subject,
                       *(t for n, v in given for t in _tokens(n, v))])


def _python(name: str, value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return f"{name}={value if isinstance(value, Word) else repr(value)}"


def _tokens(name: str, value: Any) -> list[str]:
    flag = OPTIONS[name]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not flag:
        return [str(v) for v in values]
    if flag.endswith("="):
        return [f"{flag}{v}" for v in values]
    if value is True:
        return [flag]
    return [t for v in values for t in (flag, str(v))]


@contextmanager
def graph_written_in(source: str) -> Iterator[None]:
    """Hints made in the body spell the graph as the front end it came from wrote it:
    `source` is the graph's `Graph.source` (`PYTHON_SOURCE`: GraphBuilder)."""
    token = _GRAPH_IN_PYTHON.set(source == PYTHON_SOURCE)
    try:
        yield
    finally:
        _GRAPH_IN_PYTHON.reset(token)


def wiring(port: str, ref: str) -> str:
    """Input `port` wired to `ref` (`node.port`), as the graph is written."""
    if _GRAPH_IN_PYTHON.get():
        return f"`{port}={ref}`"
    return f"`inputs: {{{port}: {ref}}}`"


def param_setting(node: str, name: str, value: Any) -> str:
    """Param `name` of node `node` set to `value`, as the graph is written."""
    if _GRAPH_IN_PYTHON.get():
        return f"`params={{{name!r}: {value!r}}}` on node `{node}`"
    return f"`nodes.{node}.params.{name}: {value}`"
