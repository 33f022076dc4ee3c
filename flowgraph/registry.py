"""The registry: node kind -> ports with contracts, params schema, implementation.

Built-in kinds are plain data (`flowgraph.kinds`); nothing here imports torch.
Custom kinds come from two places, and only when a graph asks for them:

* modules listed under `plugins:` in the graph file are imported; they declare kinds
  with `@node_kind(...)` or `register_kind(KindSpec(...))`;
* installed packages expose entry points in the group `flowgraph.nodes`, named after
  the kind they provide; one is loaded only when a graph uses an otherwise unknown kind.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from flowgraph.contracts import TensorSpec, spec_from_annotation
from flowgraph.errors import PluginError, RegistryError
from flowgraph.ir import NAME_RE
from flowgraph.kindspec import CATEGORIES as CATEGORIES
from flowgraph.kindspec import HEADS as HEADS
from flowgraph.kindspec import HOISTABLE_CATEGORIES as HOISTABLE_CATEGORIES
from flowgraph.kindspec import PARAM_TYPES as PARAM_TYPES
from flowgraph.kindspec import KindSpec as KindSpec
from flowgraph.kindspec import LossSpec as LossSpec
from flowgraph.kindspec import ParamSpec as ParamSpec
from flowgraph.kindspec import PortSpec as PortSpec
from flowgraph.objects import TAG, by_value
from flowgraph.runtime.context import RESOURCE_ARGS

ENTRY_POINT_GROUP = "flowgraph.nodes"


def plugin_source(entry: str, folder: str | Path) -> Path | None:
    """The absolute file or package folder of plugin `entry` (`rewards.py`, `my_rewards`,
    `pkg.mod`) when it lies in `folder` (a graph file's folder), else None."""
    here = Path(folder)
    if entry.endswith(".py"):
        candidates = [here / entry]
    else:
        top = entry.split(".")[0]
        candidates = [here / f"{top}.py", here / top]
    found = next((c for c in candidates if c.is_file() or (c / "__init__.py").is_file()), None)
    return found.resolve() if found is not None else None


def plugin_folder(entry: str, folder: str | Path) -> str | None:
    """The absolute folder to import plugin `entry` from, when it lies in `folder`."""
    source = plugin_source(entry, folder)
    return str(source.parent) if source is not None else None


def plugin_module(entry: str, folders: Iterable[str]) -> str:
    """The module name to import for plugin `entry`, with the folder that holds it (if
    one of `folders` does) first on `sys.path`: found there before an installed module of
    the same name, in this process and in every worker that calls it. A `.py` file
    must be in one of `folders`, or given by its absolute path (as a plan records it)."""
    if entry.endswith(".py") and Path(entry).is_absolute():
        folders = (str(Path(entry).parent), *folders)
    for folder in folders:
        source = plugin_source(entry, folder)
        if source is None:
            continue
        holder = str(source.parent)
        if holder in sys.path:
            sys.path.remove(holder)
        sys.path.insert(0, holder)
        module = Path(entry).stem if entry.endswith(".py") else entry
        _forget_another(module.split(".")[0], source)
        return module
    if entry.endswith(".py"):
        looked = ", ".join(str(Path(f).resolve()) for f in folders)
        where = f"looked in {looked}" if looked else "the plan names no folder holding it " \
            "(its `plugin_paths`)"
        raise PluginError(f"plugin file `{entry}` not found; {where}: a plugin file is "
                          "relative to the folder of the graph file that lists it, or to the "
                          "working directory for a graph built in a notebook, stdin or "
                          "`python -c`")
    return entry


def import_plugin(entry: str, folders: Iterable[str]) -> str:
    """Import plugin `entry` as `plugin_module` finds it; its module name."""
    module = plugin_module(entry, folders)
    try:
        importlib.import_module(module)
    except Exception as exc:
        raise PluginError(
            f"plugin module `{module}` could not be imported: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _forget_another(top: str, source: Path) -> None:
    """Forget a module named like plugin `top` that this process imported from another
    file (another graph's `rewards.py`, a notebook's earlier folder), so that importing
    the plugin finds this graph's file instead of the first one ever imported."""
    loaded = sys.modules.get(top)
    where = getattr(loaded, "__file__", None)
    mine = source / "__init__.py" if source.is_dir() else source
    if where is None or Path(where).resolve() == mine:
        return
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


_DECLARED: dict[str, KindSpec] = {}
"""Kinds declared by imported plugin modules and entry points."""


LOSS_INPUTS = ("old_log_prob", "log_prob", "advantages", "response_mask")
"""The tensors every policy loss takes first, each (B, T)."""
LOSS_SHARED = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
"""Params a loss may take from the update's own params (not `policy_loss_params`)."""
_LOSSES: dict[str, LossSpec] = {}
"""Policy losses declared by plugins with `@policy_loss`."""


def policy_loss(name: str, *, per_sequence: bool = False) -> Callable[[F], F]:
    """Declare a policy loss for `ppo_actor_update(policy_loss=name)`:

        @policy_loss("my_loss")
        def my_loss(old_log_prob, log_prob, advantages, response_mask,
                    clip_ratio_high: float = 0.2, beta: float = 1.0):
            return per_token_loss, {"my_metric": 0.0}     # (B, T) tensor, floats

    It takes the four (B, T) tensors, then keyword params with defaults: a clip ratio
    (`clip_ratio_low/high/c`) comes from the update's params, any other is the loss's own,
    set in `policy_loss_params` and checked before launch. It returns the per-token loss
    (the update aggregates it by `loss_agg_mode`) and metrics (logged as actor/<name>).
    `per_sequence=True` declares one importance ratio per sequence (as GSPO's): the
    checker warns where the sequences are multi-turn episodes (FG604)."""
    if not NAME_RE.match(name):
        raise RegistryError(f"policy loss name {name!r} is not an identifier")

    def wrap(fn: F) -> F:
        params = list(inspect.signature(fn).parameters.values())
        first = [p.name for p in params[:len(LOSS_INPUTS)]]
        if first != list(LOSS_INPUTS):
            raise RegistryError(f"policy loss `{name}`: the first parameters must be "
                                f"{', '.join(LOSS_INPUTS)}; got {', '.join(first)}")
        hints = _annotations(fn)
        own = tuple(_param_from_signature(p.name, p, hints.get(p.name))
                    for p in params[len(LOSS_INPUTS):] if p.name not in LOSS_SHARED)
        spec = LossSpec(name, own, f"{fn.__module__}:{fn.__qualname__}",
                        (fn.__doc__ or "").strip().split("\n")[0], per_sequence)
        if name in _builtin_losses() or _LOSSES.get(name, spec).impl != spec.impl:
            raise RegistryError(f"policy loss `{name}` is declared twice (built in or by "
                                f"{_LOSSES[name].impl if name in _LOSSES else 'flowgraph'})")
        _LOSSES[name] = spec
        _LOSS_FUNCTIONS[name] = fn
        return fn

    return wrap


_LOSS_FUNCTIONS: dict[str, Callable[..., Any]] = {}


def _builtin_losses() -> dict[str, LossSpec]:
    from flowgraph.kinds import POLICY_LOSSES

    return POLICY_LOSSES


def loss_spec(name: str) -> LossSpec | None:
    """A policy loss by name: built in, or declared by an imported plugin."""
    return _builtin_losses().get(name) or _LOSSES.get(name)


def loss_names() -> list[str]:
    return sorted({*_builtin_losses(), *_LOSSES})


def loss_function(name: str) -> Callable[..., Any] | None:
    """The function a plugin declared `name` from in this process, if any."""
    return _LOSS_FUNCTIONS.get(name)


def with_loss_implementations(kind: KindSpec, values: Mapping[str, object]
                              ) -> dict[str, object]:
    """A node's params with each policy loss they name (`ParamSpec.names`) replaced by the
    loss's implementation, which the compiler writes into the plan so that no node looks
    a name up when it runs: its `module:function`, or, for a function only this process
    reaches (declared in `__main__`, a notebook cell, a function), the tagged reference
    `{"$python": ref}` the plan carries by value (`session_losses`). An unknown name stays
    (the checker reports it)."""
    out = dict(values)
    for p in kind.params:
        name = out.get(p.name)
        spec = loss_spec(name) if p.names == "policy_loss" and isinstance(name, str) else None
        if spec is not None:
            out[p.name] = {TAG: spec.impl} if by_value(spec.impl) else spec.impl
    return out


def session_losses() -> dict[str, Callable[..., Any]]:
    """Implementation reference -> function of the policy losses declared by code of this
    session, which no worker could import by name (see `with_loss_implementations`)."""
    return {spec.impl: _LOSS_FUNCTIONS[name] for name, spec in _LOSSES.items()
            if name in _LOSS_FUNCTIONS and by_value(spec.impl)}


_FUNCTIONS: dict[str, Callable[..., Any]] = {}
"""The functions `@node_kind` declared kinds from, by kind name."""


def declared_kind(name: str) -> KindSpec | None:
    """A kind declared in this process by `@node_kind` or `register_kind`, if any."""
    return _DECLARED.get(name)


def session_kinds() -> dict[str, KindSpec]:
    """The kinds declared by code of this session, which no worker could import by name:
    their implementation is a `__main__` (script, notebook cell) or local function, and
    travels with the plan by value (`flowgraph.objects`)."""
    return {name: kind for name, kind in _DECLARED.items()
            if name in _FUNCTIONS and by_value(kind.impl)}


def declared_function(name: str) -> Callable[..., Any] | None:
    """The function a kind was declared from with `@node_kind` in this process, if any."""
    return _FUNCTIONS.get(name)


def register_kind(kind: KindSpec) -> KindSpec:
    """Declare a custom kind; declaring the same name with another contract is an error."""
    from flowgraph.kinds import BUILTIN_KINDS

    if kind.name in BUILTIN_KINDS:
        raise RegistryError(f"kind `{kind.name}` is built in; pick another name for your kind")
    old = _DECLARED.get(kind.name)
    if old is not None and old != kind:
        raise RegistryError(
            f"kind `{kind.name}` is declared twice with different contracts "
            f"({old.source} and {kind.source})"
        )
    _DECLARED[kind.name] = kind
    return kind


F = TypeVar("F", bound=Callable[..., Any])


def node_kind(
    name: str,
    *,
    outputs: Iterable[str],
    category: str = "custom",
    model: str = "none",
    head: str = "lm",
    constraints: dict[str, tuple[str, ...]] | None = None,
    doc: str | None = None,
) -> Callable[[F], F]:
    """Declare a kind from a function annotated with jaxtyping.

    Tensor-annotated parameters are input ports, and so are plain lists of one value per
    sequence (`ground_truth: list[str]`, `extra_info: list[dict]`: dtype str or object,
    dim b); the others are params (their defaults become param defaults). The return
    annotation is one such type or a `tuple[...]` of them, named by `outputs`. A kind
    with a model (`model="required"`) uses it as a causal LM unless `head` says
    `scalar` (a critic: the checker, the memory estimate and the executors treat it as
    the built-in `values`) or `tokenizer`.

        @node_kind("length_reward", outputs=["scores"])
        def length_reward(response_mask: Float[Tensor, "b T"], scale: float = 0.01
                          ) -> Float[Tensor, "b"]: ...
    """
    out_names = tuple(outputs)

    def wrap(fn: F) -> F:
        kind = kind_from_function(fn, name, out_names, category, model, constraints or {}, doc)
        kind = replace(kind, head=head) if head != kind.head else kind
        register_kind(kind)
        fn.__flowgraph_kind__ = kind  # type: ignore[attr-defined]
        _FUNCTIONS[name] = fn
        return fn

    return wrap


def kind_from_function(
    fn: Callable[..., Any],
    name: str,
    outputs: tuple[str, ...],
    category: str,
    model: str,
    constraints: dict[str, tuple[str, ...]],
    doc: str | None,
) -> KindSpec:
    """Build a `KindSpec` by reading a function's jaxtyping annotations."""
    hints = _annotations(fn)
    inputs: list[PortSpec] = []
    params: list[ParamSpec] = []
    for pname, p in inspect.signature(fn).parameters.items():
        if pname in RESOURCE_ARGS:
            continue  # supplied by the executor, not by the graph
        spec = _port_spec(hints.get(pname), constraints.get(pname, ()))
        if spec is not None:
            inputs.append(PortSpec(pname, spec, optional=p.default is not inspect.Parameter.empty))
            continue
        params.append(_param_from_signature(pname, p, hints.get(pname)))
    out_specs = _output_specs(fn, hints.get("return"), outputs, constraints)
    module = getattr(fn, "__module__", "?")
    return KindSpec(
        name=name,
        category=category,
        doc=doc or (inspect.getdoc(fn) or "").split("\n\n")[0],
        inputs=tuple(inputs),
        outputs=out_specs,
        params=tuple(params),
        model=model,
        impl=f"{module}:{fn.__qualname__}",
        source=module,
    )


def _port_spec(annotation: Any, constraints: tuple[str, ...] = ()) -> TensorSpec | None:
    """A port's contract from its annotation: a jaxtyping array type, or a plain list of
    one value per sequence (`list[str]`: dtype str, as `ground_truth` and `data_source`;
    `list[dict]` or any other `list[...]`: dtype object, as `extra_info`); None for a
    param. `X | None` reads as X (an optional port, given its default None)."""
    args = typing.get_args(annotation)
    if type(None) in args and len(args) == 2:  # `X | None`, `Optional[X]`
        annotation = next(a for a in args if a is not type(None))
    spec = spec_from_annotation(annotation, constraints)
    if spec is not None or typing.get_origin(annotation) is not list:
        return spec
    return TensorSpec("b", "str" if typing.get_args(annotation) == (str,) else "object",
                      constraints)


def _annotations(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return dict(inspect.get_annotations(fn, eval_str=True))
    except Exception as exc:  # a NameError in a string annotation, typically
        raise RegistryError(f"cannot read the annotations of {fn.__qualname__}: {exc}") from exc


_PY_TYPES = {float: ("float",), int: ("int",), bool: ("bool",), str: ("str",)}


def _param_from_signature(name: str, p: inspect.Parameter, hint: Any) -> ParamSpec:
    types = _PY_TYPES.get(hint, ("any",))
    if p.default is inspect.Parameter.empty:
        return ParamSpec(name, types, required=True)
    default = p.default if isinstance(p.default, (str, int, float, bool, type(None))) else None
    return ParamSpec(name, types if default is not None else (*types, "null"), default=default)


def _output_specs(
    fn: Callable[..., Any],
    ret: Any,
    names: tuple[str, ...],
    constraints: dict[str, tuple[str, ...]],
) -> tuple[PortSpec, ...]:
    single = _port_spec(ret)
    parts = (ret,) if single is not None else tuple(getattr(ret, "__args__", ()))
    specs = [_port_spec(a) for a in parts]
    if len(specs) != len(names) or any(s is None for s in specs):
        raise RegistryError(
            f"{fn.__qualname__}: the return annotation must be {len(names)} jaxtyping array "
            f"type(s) or list[...] for outputs {list(names)}, got {ret!r}"
        )
    return tuple(
        PortSpec(n, TensorSpec(s.dims, s.dtype, constraints.get(n, ())))
        for n, s in zip(names, specs, strict=False)
        if s is not None
    )


@dataclass
class Registry:
    """The kinds one graph may use: the built-ins plus what its plugins declared."""

    kinds: dict[str, KindSpec] = field(default_factory=dict)
    _missing: set[str] = field(default_factory=set)
    """Kinds already looked for among entry points, in vain."""

    @staticmethod
    def default() -> Registry:
        """The built-in kinds, and those this Python session declared itself (in a
        script's `__main__`, a notebook cell or a function): no plugin lists them."""
        from flowgraph.kinds import BUILTIN_KINDS

        return Registry(dict(BUILTIN_KINDS) | session_kinds())

    def get(self, name: str) -> KindSpec | None:
        kind = self.kinds.get(name)
        if kind is None and name not in self._missing:
            kind = self._from_entry_point(name)
        return kind

    def names(self) -> list[str]:
        return sorted(self.kinds)

    def load_plugins(self, modules: Iterable[str], folders: Iterable[str] = ()) -> None:
        """Import each plugin — a module name, or a `.py` file — found in `folders` first
        (the graph file's), then among the installed packages; the kinds it (or its
        submodules) declares join this registry."""
        folders = tuple(folders)
        for entry in modules:
            before = set(_DECLARED)
            module = import_plugin(entry, folders)
            for name, kind in _DECLARED.items():
                inside = kind.source == module or kind.source.startswith(module + ".")
                if inside or name not in before:
                    self.kinds[name] = kind

    def _from_entry_point(self, name: str) -> KindSpec | None:
        from importlib.metadata import entry_points

        found = None
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
            try:
                ep.load()
            except Exception as exc:
                raise PluginError(
                    f"entry point `{ep.name} = {ep.value}` (group {ENTRY_POINT_GROUP}) failed "
                    f"to load: {type(exc).__name__}: {exc}"
                ) from exc
            found = _DECLARED.get(name)
        if found is None:
            self._missing.add(name)
        else:
            self.kinds[name] = found
        return found
