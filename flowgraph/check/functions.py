"""Params that name code: a function (`ParamSpec.functions`) — a built-in name, or a
function of a plugin the graph lists, `rewards.py:compute_score` — or an entry of a
registry (`ParamSpec.names`: `policy_loss`) with its own params in `<param>_params`. The
plugins were imported by then, so a function or a loss that is not there, or a loss
param it does not take, is found before launch."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from flowgraph.check.structure import Resolved, param_problem
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.document import did_you_mean
from flowgraph.ir import Graph, NodeSpec, Param, Params
from flowgraph.objects import PyObject
from flowgraph.registry import ParamSpec, loss_names, loss_spec
from flowgraph.source import SourcePos


def check_functions(graph: Graph, table: dict[str, Resolved], out: list[Diagnostic]) -> None:
    listed = {p.module for p in graph.plugins}
    for r in table.values():
        if r.kind is None or not isinstance(r.spec, NodeSpec):
            continue
        specs = [s for s in r.kind.params if s.functions is not None]
        given = [(s, p) for s in specs if (p := r.spec.params.find(s.name)) is not None
                 and p.value is not None]
        if specs and not given:
            names = " or ".join(f"`{s.name}`" for s in specs)
            out.append(error("FG112", f"`{r.name}` (kind {r.kind.name}) needs {names}",
                             r.spec.pos, node=r.name, hint=_hint(specs[0])))
        for spec, param in given:
            for ref, where in _refs(param):
                _check_ref(r.name, spec, ref, where, listed, out)
        for spec in r.kind.params:
            if spec.names == "policy_loss":
                _check_loss(r.name, spec, r.spec, out)


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
    """Each function reference in a param: its value, or each value of a mapping."""
    if isinstance(param.value, Params):
        return [(p.value, p) for p in param.value.items]
    return [(param.value, param)]


def _check_ref(node: str, spec: ParamSpec, ref: object, where: Param, listed: set[str],
               out: list[Diagnostic]) -> None:
    assert spec.functions is not None
    if isinstance(ref, PyObject):  # the function itself (`flowgraph.objects`): no lookup
        return
    if not isinstance(ref, str):
        out.append(error("FG112", f"parameter `{spec.name}` of `{node}` names a function as "
                         f"a string, got {ref!r}", where.pos, node=node, hint=_hint(spec)))
        return
    module, colon, name = ref.partition(":")
    if not colon:
        if ref not in spec.functions:
            out.append(error("FG112", f"parameter `{spec.name}` of `{node}`: no built-in "
                             f"function `{ref}`", where.pos, node=node, hint=_hint(spec)))
        return
    if module not in listed:
        out.append(error("FG113", f"parameter `{spec.name}` of `{node}` names `{ref}`, but "
                         f"`{module}` is not listed under plugins:", where.pos, node=node,
                         hint=f"add it: `plugins: [{module}]` (every file or module a graph "
                              "runs is listed there)"))
        return
    loaded = sys.modules.get(Path(module).stem if module.endswith(".py") else module)
    if loaded is None:
        return
    fn = getattr(loaded, name, None)
    if not callable(fn):
        out.append(error("FG112", f"parameter `{spec.name}` of `{node}`: `{module}` has no "
                         f"function `{name}`", where.pos, node=node, hint=_hint(spec)))
        return
    if module.endswith(".py") and spec.call_with:
        _check_signature(node, spec, ref, fn, where, out)


def _check_signature(node: str, spec: ParamSpec, ref: str, fn: Callable[..., object],
                     where: Param, out: list[Diagnostic]) -> None:
    """A plugin file's function can be called as the node calls it (`ParamSpec.call_with`:
    verl's `data_source=, solution_str=, ground_truth=, extra_info=`); the error sits on
    the function's own line."""
    try:
        inspect.signature(fn).bind(**dict.fromkeys(spec.call_with))
    except TypeError as exc:
        file, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
        pos = SourcePos(file, line, 1) if file else where.pos
        wanted = ", ".join(spec.call_with)
        out.append(error(
            "FG112", f"`{ref}` (parameter `{spec.name}` of `{node}`, {where.pos}) cannot be "
            f"called with the keywords {wanted}: {exc}", pos, node=node,
            hint=f"take them all: `def {fn.__name__}({wanted}=None)` (verl's signature; "
                 "more keywords with defaults, or **kwargs, are fine)"))
    except ValueError:  # no signature to read (a builtin): it is called as it is
        return


def _hint(spec: ParamSpec) -> str:
    builtins = ", ".join(spec.functions or ())
    return (f"a built-in ({builtins}), or `file.py:function` / `module:function` of a plugin "
            "listed under plugins:")
