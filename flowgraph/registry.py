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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from flowgraph.contracts import TensorSpec, spec_from_annotation
from flowgraph.errors import PluginError, RegistryError
from flowgraph.ir import NAME_RE, ParamValue
from flowgraph.runtime.context import RESOURCE_ARGS

PARAM_TYPES = ("float", "int", "bool", "str", "list", "mapping", "any", "null")
HOISTABLE_CATEGORIES = ("model", "reward", "transform")
"""Deterministic, row-wise categories: a node of one whose inputs come from data and
whose model is frozen computes the same rows at every step (pass `hoist`). Not
`rollout` (sampling), not `update` (changes weights), not `advantage` (batch
statistics such as whitening would change if computed over the whole dataset), not
`custom` (nothing is known about it)."""
HEADS = ("lm", "scalar", "tokenizer")
"""What a kind uses its model as: `KindSpec.head`."""
CATEGORIES = ("data", "rollout", "model", "reward", "transform", "advantage", "update", "custom",
              "filter")
"""`filter`: keeps some sample groups of a generation batch; the executor repeats the
stages before it (data, generate, reward) until enough groups are kept (`ResamplePlan`)."""
ENTRY_POINT_GROUP = "flowgraph.nodes"


@dataclass(frozen=True, slots=True)
class PortSpec:
    """A named input or output and its contract."""

    name: str
    spec: TensorSpec
    optional: bool = False
    """Inputs: may stay unwired. Outputs: computed only when consumed."""
    doc: str = ""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of a kind."""

    name: str
    types: tuple[str, ...]
    """Allowed value types from `PARAM_TYPES`; an int is also a float."""
    default: ParamValue = None
    required: bool = False
    choices: tuple[str, ...] = ()
    doc: str = ""
    dim: str | None = None
    """A dim this param's value binds (`n` -> the node's group size, `max_new_tokens` -> T)."""
    minimum: float | None = None

    def __post_init__(self) -> None:
        bad = [t for t in self.types if t not in PARAM_TYPES]
        if bad:
            raise RegistryError(f"param `{self.name}`: unknown type(s) {bad}; known {PARAM_TYPES}")


@dataclass(frozen=True, slots=True)
class KindSpec:
    """Everything the checker and the executors need to know about a kind."""

    name: str
    category: str
    doc: str
    inputs: tuple[PortSpec, ...] = ()
    outputs: tuple[PortSpec, ...] = ()
    params: tuple[ParamSpec, ...] = ()
    model: str = "none"
    """`none`, `required` or `optional` model binding."""
    head: str = "lm"
    """What the node uses its model as, when it has one: `lm`, a causal LM (its logits
    over the vocabulary); `scalar`, a backbone with a scalar head, one number per token
    (a critic, a reward model); `tokenizer`, its tokenizer only (no weights load)."""
    sequences_per_row: int = 1
    """Sequences the model runs per batch row (DPO: the chosen and the rejected one)."""
    trains: bool = False
    """An update node: its model must be trainable, and it is a sink."""
    grouped: bool = False
    """Needs whole sample groups (GRPO, RLOO): its batch is split only group-aligned."""
    impl: str = ""
    """`module:function`, imported lazily by executors only."""
    required_when: tuple[tuple[str, str, str], ...] = ()
    """(optional input, param, value): the input is required when the param has the value
    (`reward` needs `ground_truth` when `fn` is `exact_match`)."""
    dim_defaults: tuple[tuple[str, str], ...] = ()
    """Node-local dims and the global expression they take when no param binds them."""
    source: str = "builtin"
    """`builtin`, the plugin module, or the entry point that declared the kind."""

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise RegistryError(f"kind name {self.name!r} is not an identifier")
        if self.category not in CATEGORIES:
            raise RegistryError(
                f"kind `{self.name}`: category {self.category!r} not in {CATEGORIES}"
            )
        if self.model not in ("none", "required", "optional"):
            raise RegistryError(f"kind `{self.name}`: model must be none/required/optional")
        if self.head not in HEADS:
            raise RegistryError(f"kind `{self.name}`: head must be one of {HEADS}")
        if self.sequences_per_row < 1:
            raise RegistryError(f"kind `{self.name}`: sequences_per_row must be >= 1")
        for group in (self.inputs, self.outputs, self.params):
            names = [p.name for p in group]
            if len(names) != len(set(names)):
                raise RegistryError(f"kind `{self.name}` declares a name twice: {names}")

    @property
    def sink(self) -> bool:
        return self.trains

    def input(self, name: str) -> PortSpec | None:
        return next((p for p in self.inputs if p.name == name), None)

    def output(self, name: str) -> PortSpec | None:
        return next((p for p in self.outputs if p.name == name), None)

    def param(self, name: str) -> ParamSpec | None:
        return next((p for p in self.params if p.name == name), None)

    def param_values(self, given: Mapping[str, object]) -> dict[str, object]:
        """Every param's value: `given` where set, else the kind's default."""
        return {**{p.name: p.default for p in self.params}, **given}

    def needs(self, port: PortSpec, params: Mapping[str, object]) -> str | None:
        """Why `port` must be wired with these params (defaults filled in), or None."""
        if not port.optional:
            return "it is required"
        for name, param, value in self.required_when:
            if name == port.name and params.get(param) == value:
                return f"`{param}` is `{value}`"
        return None


_DECLARED: dict[str, KindSpec] = {}
"""Kinds declared by imported plugin modules and entry points."""


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

    Tensor-annotated parameters are input ports; the others are params (their
    defaults become param defaults). The return annotation is one array type or a
    `tuple[...]` of them, named by `outputs`. A kind with a model (`model="required"`)
    uses it as a causal LM unless `head` says `scalar` (a critic: the checker, the
    memory estimate and the executors treat it as the built-in `values`) or `tokenizer`.

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
        spec = spec_from_annotation(hints.get(pname), constraints.get(pname, ()))
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
    single = spec_from_annotation(ret)
    parts = (ret,) if single is not None else tuple(getattr(ret, "__args__", ()))
    specs = [spec_from_annotation(a) for a in parts]
    if len(specs) != len(names) or any(s is None for s in specs):
        raise RegistryError(
            f"{fn.__qualname__}: the return annotation must be {len(names)} jaxtyping array "
            f"type(s) for outputs {list(names)}, got {ret!r}"
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
        from flowgraph.kinds import BUILTIN_KINDS

        return Registry(dict(BUILTIN_KINDS))

    def get(self, name: str) -> KindSpec | None:
        kind = self.kinds.get(name)
        if kind is None and name not in self._missing:
            kind = self._from_entry_point(name)
        return kind

    def names(self) -> list[str]:
        return sorted(self.kinds)

    def load_plugins(self, modules: Iterable[str]) -> None:
        """Import each module; the kinds it (or its submodules) declares join this registry."""
        for module in modules:
            before = set(_DECLARED)
            try:
                importlib.import_module(module)
            except Exception as exc:
                raise PluginError(
                    f"plugin module `{module}` could not be imported: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
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
