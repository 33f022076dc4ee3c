"""Params that name code: a function (`ParamSpec.functions`) — a built-in name, a
function of a plugin the graph lists, `rewards.py:compute_score`, or a Python callable —
or an entry of a registry (`ParamSpec.names`: `policy_loss`) with its own params in
`<param>_params`. The plugins were imported by then, so a function or a loss that is not
there, a function the node cannot call (by the style its signature picks, `ParamSpec.
calls`), or a loss param it does not take, is found before launch. `called_functions`
gives the functions found to `check --data`, which holds them against the datasets'
columns (`flowgraph.checker.data`)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from flowgraph.checker.structure import Resolved, param_problem
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.document import did_you_mean
from flowgraph.ir import Graph, NodeSpec, Param, Params
from flowgraph.objects import PyObject
from flowgraph.registry import ParamSpec, Registry, loss_names, loss_spec
from flowgraph.runtime.reward_call import CallStyle, CallStyleError, call_style, function_name
from flowgraph.source import SourcePos
from flowgraph.spelling import wiring


def check_functions(graph: Graph, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    listed = {p.module for p in graph.plugins}
    for r in table.values():
        if r.kind is None or not isinstance(r.spec, NodeSpec):
            continue
        specs = [s for s in r.kind.params if s.functions is not None and s.agent is None]
        given = [(s, p) for s in specs if (p := r.spec.params.find(s.name)) is not None
                 and p.value is not None]
        needed = [s for s in specs if s.replaces is None]
        if needed and not given:
            names = " or ".join(f"`{s.name}`" for s in needed)
            out.append(error("FG112", f"`{r.name}` (kind {r.kind.name}) needs {names}",
                             r.spec.pos, node=r.name, hint=_hint(needed[0])))
        for spec, param in given:
            _check_replaced(r.spec, spec, param, out)
        styles = [(ref, _check_ref(r.spec, spec, ref, where, listed, out))
                  for spec, param in given for ref, where in _refs(param)]
        _check_reads(r.spec, styles, out)
        for spec in r.kind.params:
            if spec.one_per is not None:
                _check_one_per(r.spec, spec, out)
        for spec in r.kind.params:
            if spec.names == "policy_loss":
                _check_loss(r.name, spec, r.spec, out)


@dataclass(frozen=True, slots=True)
class Called:
    """A function a node's param names, as this process holds it."""

    node: NodeSpec
    label: str
    """How the graph names it: `rewards.py:correct`, `__main__:correct`."""
    fn: Callable[..., object]
    style: CallStyle
    """How the node calls it (`ParamSpec.calls`, by its signature)."""
    pos: SourcePos
    """Its `def` line, else the param's."""


def called_functions(graph: Graph, registry: Registry) -> list[Called]:
    """Every function the nodes' params name that this process holds (a function given as
    itself, `file.py:fn` or `module:fn` of a plugin the check imported) and that a node
    calls in a style its signature picks; built-in names and functions the check refused
    are left out."""
    listed = {p.module for p in graph.plugins}
    found = []
    for node in graph.nodes:
        kind = registry.get(node.kind)
        for spec in kind.params if kind is not None else ():
            param = node.params.find(spec.name)
            if not spec.calls or param is None or param.value is None:
                continue
            for ref, where in _refs(param):
                label, fn = _loaded(ref, listed)
                if fn is None:
                    continue
                try:
                    style = call_style(fn, spec.calls)
                except CallStyleError:
                    continue
                found.append(Called(node, label, fn, style, _own_line(fn, where)))
    return found


def _loaded(ref: object, listed: set[str]) -> tuple[str, Callable[..., object] | None]:
    """(label, the function a reference names, when this process holds it)."""
    if isinstance(ref, PyObject):
        return ref.ref, ref.obj if callable(ref.obj) else None
    if callable(ref) and not isinstance(ref, str):
        return function_name(ref), ref
    module, colon, name = str(ref).partition(":")
    if not colon or module not in listed:
        return str(ref), None
    fn = getattr(plugin_module(module), name, None)
    return str(ref), fn if callable(fn) else None


def plugin_module(module: str) -> ModuleType | None:
    """The module a listed plugin (`rewards.py` or `my_pkg.rewards`) was imported as by
    the check; None when its import failed (FG113 says why)."""
    return sys.modules.get(Path(module).stem if module.endswith(".py") else module)


def _check_replaced(node: NodeSpec, spec: ParamSpec, given: Param,
                    out: list[Diagnostic]) -> None:
    """A function param that stands in for another (`filter`'s `fn` for `metric`) is not
    set beside it: one of the two would be ignored."""
    other = node.params.find(spec.replaces or "")
    if other is None or other.value is None:
        return
    out.append(error("FG112", f"`{node.name}` sets both `{spec.name}` and `{other.name}`; "
                     f"`{spec.name}` replaces `{other.name}`, which would be ignored",
                     other.pos, node=node.name,
                     hint=f"remove `{other.name}: {other.value}` (or `{spec.name}`), "
                          f"{given.pos}"))


def _check_one_per(node: NodeSpec, spec: ParamSpec, out: list[Diagnostic]) -> None:
    """A list of numbers with one entry per entry of the list param `spec.one_per`
    (`weights` of `fn`: TRL's reward_weights, one per reward function)."""
    given, of = node.params.find(spec.name), node.params.find(spec.one_per or "")
    if given is None or not isinstance(given.value, tuple):
        return
    bad = [v for v in given.value if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        problem = f"holds {bad[0]!r}, not a number"
    elif of is None or not isinstance(of.value, tuple):
        problem = f"needs `{spec.one_per}` to be a list"
    elif len(of.value) != len(given.value):
        problem = f"has {len(given.value)} entries for {len(of.value)} in `{spec.one_per}`"
    else:
        return
    out.append(error("FG112", f"parameter `{spec.name}` of `{node.name}` {problem}",
                     given.pos, node=node.name,
                     hint=f"one number per entry of `{spec.one_per}`, in its order "
                          "(TRL's reward_weights)"))


def _check_reads(node: NodeSpec, styles: list[tuple[object, CallStyle | None]],
                 out: list[Diagnostic]) -> None:
    """The input a function's call style reads (TRL's: `row`, the dataset's columns) is
    wired; one error naming every function that reads it."""
    reading: dict[str, list[str]] = {}
    for ref, style in styles:
        if style is not None and style.reads and node.input(style.reads) is None:
            reading.setdefault(style.reads, []).append(f"`{_label(ref)}`")
    for port, fns in reading.items():
        out.append(error(
            "FG104", f"`{node.name}` calls {' and '.join(fns)} as TRL calls reward "
            f"functions (their signatures name completions, prompts or completion_ids), "
            f"with the prompts and the dataset's columns of the input `{port}`, which it "
            f"does not wire", node.pos, node=node.name,
            hint=f"wire {wiring(port, f'gen.{port}')} (generate passes on the data's "
                 f"`{port}`: {wiring(port, f'train.{port}')})"))


def _check_loss(node: str, spec: ParamSpec, owner: NodeSpec, out: list[Diagnostic]) -> None:
    """The loss a param names exists, and `<param>_params` are params it takes."""
    given = owner.params.find(spec.name)
    name = given.value if given is not None else spec.default
    where = given.pos if given is not None else owner.pos
    loss = loss_spec(name) if isinstance(name, str) else None
    if loss is None:
        out.append(error("FG112", f"parameter `{spec.name}` of `{node}`: no policy loss "
                         f"`{name}`", where, node=node,
                         hint=did_you_mean(str(name), loss_names()) + " (or declare it "
                         "with @policy_loss in a plugin)"))
        return
    own = owner.params.find(f"{spec.name}_params")
    if own is None or not isinstance(own.value, Params):
        return
    for p in own.value.items:
        param = next((q for q in loss.params if q.name == p.name), None)
        problem = (param_problem(param, p.value) if param is not None else
                   f"policy loss `{loss.name}` takes no param `{p.name}` (its params: "
                   f"{', '.join(q.name for q in loss.params) or 'none'})")
        if problem:
            out.append(error("FG112", f"`{spec.name}_params` of `{node}`: {problem}", p.pos,
                             node=node, hint="the clip ratios are the update's own params"))


def _refs(param: Param) -> list[tuple[object, Param]]:
    """Each function reference in a param: its value, each value of a mapping, or each
    entry of a list (TRL's reward_funcs)."""
    if isinstance(param.value, Params):
        return [(p.value, p) for p in param.value.items]
    if isinstance(param.value, tuple):
        return [(v, param) for v in param.value]
    return [(param.value, param)]


def _label(ref: object) -> str:
    if isinstance(ref, PyObject):
        return ref.ref
    return function_name(ref) if callable(ref) and not isinstance(ref, str) else str(ref)


def _check_ref(node: NodeSpec, spec: ParamSpec, ref: object, where: Param, listed: set[str],
               out: list[Diagnostic]) -> CallStyle | None:
    """Problems of one function reference; the style the node will call it in, when the
    function is known here."""
    assert spec.functions is not None
    if isinstance(ref, PyObject):  # the function itself (`flowgraph.objects`)
        if not ref.resolved:
            return None  # one FG113 for it, from the structure check
        ref = ref.obj
    if callable(ref) and not isinstance(ref, str):  # a Python function given as it is
        return _check_signature(node, spec, function_name(ref), ref, where, out)
    if not isinstance(ref, str):
        out.append(error("FG112", f"parameter `{spec.name}` of `{node.name}` names a "
                         f"function as a string or a callable, got {ref!r}", where.pos,
                         node=node.name, hint=_hint(spec)))
        return None
    module, colon, name = ref.partition(":")
    if not colon:
        if ref not in spec.functions:
            out.append(error("FG112", f"parameter `{spec.name}` of `{node.name}`: no "
                             f"built-in function `{ref}`", where.pos, node=node.name,
                             hint=_hint(spec)))
        return None
    if module not in listed:
        out.append(error("FG113", f"parameter `{spec.name}` of `{node.name}` names `{ref}`, "
                         f"but `{module}` is not listed under plugins:", where.pos,
                         node=node.name,
                         hint=f"add it: `plugins: [{module}]` (every file or module a graph "
                              "runs is listed there)"))
        return None
    loaded = plugin_module(module)
    if loaded is None:
        return None
    fn = getattr(loaded, name, None)
    if not callable(fn):
        out.append(error("FG112", f"parameter `{spec.name}` of `{node.name}`: `{module}` has "
                         f"no function `{name}`", where.pos, node=node.name,
                         hint=_hint(spec)))
        return None
    return _check_signature(node, spec, ref, fn, where, out) if module.endswith(".py") \
        else None


def _own_line(fn: Callable[..., object], where: Param) -> SourcePos:
    """The function's own definition line, else the param's."""
    try:
        file, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return where.pos
    return SourcePos(file, line, 1) if file else where.pos


def _check_signature(node: NodeSpec, spec: ParamSpec, ref: str, fn: Callable[..., object],
                     where: Param, out: list[Diagnostic]) -> CallStyle | None:
    """The function can be called as the node will call it, in the style its signature
    picks (`ParamSpec.calls`: TRL's batch call for `completions`, verl's per-row call for
    `solution_str`), which it returns; the error sits on the function's own line."""
    if not spec.calls:
        return None
    label = f"`{ref}` (parameter `{spec.name}` of `{node.name}`, {where.pos})"
    try:
        style = call_style(fn, spec.calls)
    except CallStyleError as exc:
        out.append(error(
            "FG112", f"{label}: {exc}", _own_line(fn, where), node=node.name,
            hint="name `completions` to be called as TRL calls reward_funcs, or "
                 "`solution_str` as verl calls compute_score"))
        return None
    try:
        signature = inspect.signature(fn)
    except ValueError:  # no signature to read (a builtin): it is called as it is
        return style
    if style.per_batch:  # TRL's calls add dataset columns, known when the data loads
        return style
    try:
        if style.positional:
            signature.bind(*[None] * len(style.keywords))
        else:
            signature.bind(**dict.fromkeys(style.keywords))
    except TypeError as exc:
        wanted = ", ".join(style.keywords)
        if style.positional:
            out.append(error(
                "FG112", f"{label} cannot be called as `{function_name(fn)}({wanted})`, "
                f"one positional argument each: {exc}", _own_line(fn, where),
                node=node.name, hint=f"take them: `{style.signature}` (more parameters "
                                     "with defaults are fine)"))
            return None
        out.append(error(
            "FG112", f"{label} cannot be called with the keywords {wanted}: {exc}",
            _own_line(fn, where), node=node.name,
            hint=f"take them all: `def {function_name(fn)}({wanted}=None)` ({style.name}'s "
                 "signature; more keywords with defaults, or **kwargs, are fine)"))
    return style


def _hint(spec: ParamSpec) -> str:
    builtins = ", ".join(spec.functions or ())
    return ((f"a built-in ({builtins}), " if builtins else "") + "`file.py:function` / "
            "`module:function` of a plugin listed under plugins:, or the Python function "
            "itself")
