"""Property test of a kind's implementation against its declared contract.

    from flowgraph.testing import assert_honours_contract

    def test_my_kind():
        assert_honours_contract("my_kind")                 # a registered name, or a KindSpec
        assert_honours_contract(MY_KIND, fn=my_impl, model=tiny_model, max_examples=10)

For each hypothesis example it draws dim sizes (b in 1..6, T in 1..8 or 9..32 — a
hard-coded `[:, :8]` meets a T it cuts —, P in 1..6; a group size n dividing b for kinds
with an `index` input, and N = n for `generate`), builds well-formed values for every
required input (optional inputs at random) from each port's `TensorSpec` — int tokens
in [0, vocab) (the model config's vocabulary, else 32), binary masks (`masks`: response
masks right-padded, in some examples with all-zero rows as an agent rollout's failed
episodes give — a division by a row's mask sum meets a zero —, prompt masks left-padded
with at least one valid token per row), finite floats (<= 0 for `nonpositive`, >= 0 for
`nonnegative` ports), `index` group ids in groups of equal size, lists of digit
strings for `str` ports — and calls the implementation through the calling convention
of `flowgraph.runtime.context` with the kind's default params (and `params`
overrides). Every returned output must then honour its declared dims (resolved with
the drawn sizes), dtype family and constraints, and float outputs must be finite (the
executor stops a run on a NaN); an update kind (a sink) must return an `Update` whose
loss on its whole batch is a finite scalar with finite metrics, held out too (they go
into `ctx.metrics`; the update loop's own params are not passed to it). A failure
raises `AssertionError` naming the kind, the port, expected vs actual and the drawn
sizes.

hypothesis (and torch) are imported when the check runs, not on import.

Notation: b batch of the node, n samples per prompt (group size), P prompt length,
T response length; the context's dims are Bp = b // n, N = n, P and T.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from flowgraph.contracts import TensorSpec
from flowgraph.dims import Poly
from flowgraph.objects import TAG
from flowgraph.registry import (
    KindSpec,
    PortSpec,
    Registry,
    declared_function,
    declared_kind,
    session_losses,
    with_loss_implementations,
)
from flowgraph.runtime.context import Impl, NodeContext, named_outputs
from flowgraph.runtime.update import LOOP_PARAMS, Update

__all__ = ["T_SIZES", "assert_honours_contract", "default_context", "masks", "output_problem"]

DEFAULT_VOCAB = 32
"""Token ids are drawn below this when no model (with a config) is given."""

T_SIZES = ((1, 8), (9, 32))
"""The response lengths drawn, as ranges: short ones, and ones past 8 (a node that
hard-codes a length, `[:, :8]`, breaks there)."""


def default_context(kind: KindSpec | str, dims: Mapping[str, int], *, model: Any = None,
                    tokenizer: Any = None) -> NodeContext:
    """A `NodeContext` for one call: seed 0, step 0, the given global dims."""
    name = kind if isinstance(kind, str) else kind.name
    return NodeContext(node=name, kind=name, step=0, seed=0, model=model,
                       tokenizer=tokenizer, dims=dict(dims))


def _kind_spec(kind: KindSpec | str | Callable[..., Any]) -> KindSpec:
    """A kind by spec, by name (built in, declared in this process with `@node_kind` or
    `register_kind`, or an installed entry point), or by its `@node_kind` function."""
    if isinstance(kind, KindSpec):
        return kind
    if callable(kind):
        declared = getattr(kind, "__flowgraph_kind__", None)
        if not isinstance(declared, KindSpec):
            raise ValueError(f"{getattr(kind, '__qualname__', kind)} is not a kind: decorate "
                             "it with @node_kind, or pass its KindSpec or kind name")
        return declared
    spec = Registry.default().get(kind) or declared_kind(kind)
    if spec is None:
        raise ValueError(f"unknown kind `{kind}`: not built in, not declared with "
                         "@node_kind in this process (import its module first), not an "
                         "installed entry point")
    return spec


def _vocab(model: Any) -> int:
    for m in (model, getattr(model, "backbone", None), getattr(model, "base_model", None)):
        size = getattr(getattr(m, "config", None), "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return DEFAULT_VOCAB


def _shape(spec: TensorSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The port's fixed axes as ints; `_` axes take size 1 (inputs) or any (outputs: -1)."""
    values = {k: Poly.const(v) for k, v in sizes.items()}
    out = []
    for axis in spec.shape.fixed_axes():
        if axis.size is None:
            out.append(-1)
            continue
        p = axis.size.subs(values)
        if not p.is_const():
            raise ValueError(f"dims `{spec.dims}`: cannot resolve {axis} with sizes {dict(sizes)}")
        out.append(p.const_value())
    return tuple(out)


def _is_prompt(port: PortSpec) -> bool:
    return "P" in port.spec.shape.symbols()


def _make_input(port: PortSpec, shape: tuple[int, ...], *, vocab: int, group: int,
                gen: Any, shuffle_groups: bool, empty_rows: bool) -> Any:
    import torch

    spec = port.spec
    shape = tuple(1 if s < 0 else s for s in shape)
    if spec.dtype in ("str", "object"):
        n = shape[0] if shape else 1
        values = [str(int(d)) for d in torch.randint(0, 19, (n,), generator=gen)]
        # an `object` port carries any per-row value: verl's extra_info is a dict
        return values if spec.dtype == "str" else [{"index": i, "text": v}
                                                   for i, v in enumerate(values)]
    if port.name == "index" and len(shape) == 1:
        b = shape[0]
        groups = max(b // group, 1)
        base = int(torch.randint(0, 100, (1,), generator=gen))
        labels = base + torch.randperm(groups, generator=gen)
        ids = labels.repeat_interleave(group)[:b]
        if shuffle_groups:
            ids = ids[torch.randperm(b, generator=gen)]
        return ids.long()
    if port.name == "episode" and len(shape) == 1:  # an agent_rollout's: rows of one
        ids = torch.arange(shape[0])                 # episode share its score, so each
        unused = torch.rand(shape, generator=gen) < 0.25  # row is its own here; -1 unused
        return torch.where(unused, -1, ids).long()
    if spec.dtype == "mask" or "binary" in spec.constraints:
        return masks(shape, prompt=_is_prompt(port), gen=gen, empty_rows=empty_rows)
    if all(d.startswith(("int", "uint")) for d in spec.dtypes):
        return torch.randint(0, vocab, shape, generator=gen, dtype=torch.long)
    x = torch.randn(shape, generator=gen) * 2.0
    if "nonpositive" in spec.constraints:
        x = -x.abs()
    elif "nonnegative" in spec.constraints or "probability" in spec.constraints:
        x = x.abs()
    if "probability" in spec.constraints:
        x = x.clamp(max=1.0)
    return x.float()


def masks(shape: tuple[int, ...], *, prompt: bool, gen: Any, empty_rows: bool = False
          ) -> Any:
    """0/1 rows (int64, as every built-in gives a mask): left-padded for a prompt, each
    with >= 1 valid token; right-padded for a response, where `empty_rows` makes the
    first row and about a third of the others all zero — an agent rollout's episode that
    failed (`on_error: mask`) trains no token — and keeps the last valid (a batch with
    no token at all is refused by the built-ins that whiten, by design)."""
    import torch

    if len(shape) != 2:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.long)
    b, t = shape
    if t == 0:
        return torch.zeros(shape, dtype=torch.long)
    lengths = torch.randint(1, t + 1, (b, 1), generator=gen)
    if empty_rows and not prompt:
        empty = torch.rand((b, 1), generator=gen) < 1 / 3
        empty[0], empty[-1] = True, False
        lengths = torch.where(empty, 0, lengths)
    pos = torch.arange(t).unsqueeze(0)
    valid = pos >= t - lengths if prompt else pos < lengths
    return valid.long()


def output_problem(spec: TensorSpec, value: Any, sizes: Mapping[str, int]) -> str | None:
    """Why `value` breaks `spec` with its dims resolved by `sizes`; None if it honours it."""
    return _output_problem(spec, value, _shape(spec, sizes))


def _actual_shape(spec: TensorSpec, value: Any) -> tuple[int, ...] | str:
    """The value's shape, or why it is not of the port's dtype family."""
    import torch

    if spec.dtype in ("str", "object") or ({"str", "object"} & spec.dtypes
                                           and isinstance(value, list)):
        what = "strings" if spec.dtype == "str" else "values, one per row"
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            return f"expected a list of {what}, got {type(value).__name__}"
        if spec.dtype == "str" and not all(isinstance(v, str) for v in value):
            return "expected a list of strings, got non-string items"
        return (len(value),)
    if not isinstance(value, torch.Tensor):
        return f"expected a tensor, got {type(value).__name__}"
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in spec.dtypes:
        return f"dtype is {dtype}, expected {spec.dtype} ({', '.join(sorted(spec.dtypes))})"
    return tuple(int(s) for s in value.shape)


def _output_problem(spec: TensorSpec, value: Any, want: tuple[int, ...]) -> str | None:
    import torch

    from flowgraph.runtime.strict import constraint_problem

    actual = _actual_shape(spec, value)
    if isinstance(actual, str):
        return actual
    variadic = spec.shape.variadic
    if len(actual) != len(want) and not (variadic and len(actual) >= len(want)):
        return f"shape is {actual}, expected {len(want)} axes {want}"
    tail = actual[len(actual) - len(want):] if want else ()
    if any(w >= 0 and w != a for w, a in zip(want, tail, strict=True)):
        return f"shape is {actual}, expected {want}"
    if isinstance(value, list):  # per-row values (`str`, `object`): no value constraints
        return None
    problem = constraint_problem(spec.constraints, value)
    if problem is None and value.is_floating_point() and value.numel() \
            and not bool(torch.isfinite(value).all()):
        problem = "values are not finite (the executor stops a run on a NaN/inf float output)"
    return problem


def _update_metrics(result: object, model: Any, ctx: Any) -> dict[str, Any]:
    """An update kind's `Update`: its loss on the whole batch (no step), whose metrics
    and held-out metrics go into `ctx.metrics`; no outputs."""
    import torch

    if not isinstance(result, Update):
        raise TypeError(f"returned {type(result).__name__}; an update kind returns "
                        "flowgraph.runtime.update.Update(batch=..., loss=...)")
    loss, metrics = result.loss(model, result.batch)
    if loss.dim() != 0 or not bool(torch.isfinite(loss)):
        raise ValueError(f"its loss on the whole batch is {loss}, not a finite scalar")
    with torch.no_grad():
        ctx.metrics.update(metrics | result.loss.held_out(model, result.batch))
    return {}


def _check_outputs(spec: KindSpec, outputs: dict[str, Any], ctx: Any,
                   sizes: Mapping[str, int], where: str) -> None:
    if spec.sink:
        assert not outputs, (f"{where}: a sink (update kind) returns no outputs, "
                             f"got {sorted(outputs)}")
        bad = {k: v for k, v in ctx.metrics.items()
               if not isinstance(v, (int, float)) or not math.isfinite(v)}
        assert not bad, f"{where}: ctx.metrics are not finite: {bad}"
        return
    for port in spec.outputs:
        if port.name not in outputs:
            assert port.optional, f"{where}: returned no output `{port.name}`"
            continue
        want = _shape(port.spec, sizes)
        problem = _output_problem(port.spec, outputs[port.name], want)
        assert problem is None, (
            f"{where}: output `{port.name}`: {problem}; the kind declares "
            f"{port.spec.describe()} = {tuple('_' if w < 0 else w for w in want)}")


def _output_sizes(spec: KindSpec, params: Mapping[str, Any], sizes: Mapping[str, int]
                  ) -> dict[str, int]:
    """Sizes for output dims: params that bind a dim (`n`, `max_new_tokens`) win."""
    out = dict(sizes)
    for p in spec.params:
        value = params.get(p.name)
        if p.dim is not None and isinstance(value, int) and not isinstance(value, bool):
            out[p.dim] = value
    return out


def assert_honours_contract(
    kind: KindSpec | str | Callable[..., Any],
    *,
    fn: Callable[..., Any] | None = None,
    model: Any = None,
    tokenizer: Any = None,
    ctx: Any = None,
    max_examples: int = 20,
    params: Mapping[str, Any] | None = None,
) -> None:
    """Raise `AssertionError` unless `fn` (default: `kind.impl`) honours the kind's contract.

    `ctx` defaults to `default_context(...)` per example; a given one is reused (its
    `dims` are set to the draw and its `metrics` cleared before every call). `params`
    overrides the kind's default params.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    spec = _kind_spec(kind)
    if fn is None and callable(kind) and not isinstance(kind, KindSpec):
        fn = kind  # the decorated function itself, wherever it was defined
    elif fn is None and isinstance(kind, str):
        fn = declared_function(kind)  # None for a built-in: its registry path
    impl = Impl.at(spec.impl, f"kind `{spec.name}`") if fn is None else \
        Impl(fn, frozenset(inspect.signature(fn).parameters))
    unknown = set(params or {}) - {p.name for p in spec.params}
    if unknown:
        raise ValueError(f"kind `{spec.name}` has no param(s) {sorted(unknown)}")
    # as the compiler writes them into a plan: a policy loss named by its implementation
    # (a session's own loss, by value: the function itself here), so the node looks no
    # name up
    losses = session_losses()
    call_params = {k: losses.get(v[TAG], v) if isinstance(v, dict) and TAG in v else v
                   for k, v in with_loss_implementations(
                       spec, spec.call_values(params or {})).items()}
    executor = {p.name for p in spec.params if p.executor}  # `timeout_s`: the executor's
    vocab = _vocab(model)
    grouped = spec.input("index") is not None
    given_ctx = ctx

    @st.composite
    def draws(draw: Any) -> dict[str, Any]:
        b = draw(st.integers(1, 6), label="b")
        if grouped:
            n = draw(st.sampled_from([d for d in range(1, b + 1) if b % d == 0]), label="n")
        else:
            n = draw(st.integers(1, 3), label="n")
        t = st.one_of(*(st.integers(lo, hi) for lo, hi in T_SIZES))
        sizes = {"b": b, "n": n, "T": draw(t, label="T"),
                 "P": draw(st.integers(1, 6), label="P")}
        present = [p.name for p in spec.inputs
                   if spec.needs(p, call_params) or draw(st.booleans(), label=f"wire {p.name}")]
        if spec.terms is not None:  # inputs the graph names: one to three of them
            present += [f"term{i}" for i in range(draw(st.integers(1, 3), label="terms"))]
        seed = draw(st.integers(0, 2**31 - 1), label="seed")
        shuffle = draw(st.booleans(), label="shuffle groups") if grouped else False
        empty = draw(st.booleans(), label="all-zero mask rows")
        return {"sizes": sizes, "present": present, "seed": seed, "shuffle": shuffle,
                "empty": empty}

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(draws())
    def check(d: dict[str, Any]) -> None:
        import torch

        sizes = d["sizes"]
        b, n = sizes["b"], sizes["n"]
        # Global dims for params that default to them: `generate` turns b prompts into
        # b*N sequences; a grouped node sees Bp = b // n groups of N = n.
        glob = {"Bp": b if spec.category == "rollout" else max(b // n, 1), "N": n,
                "P": sizes["P"], "T": sizes["T"]}
        out_sizes = _output_sizes(spec, call_params, {**glob, **sizes})
        gen = torch.Generator().manual_seed(d["seed"])
        inputs = {p.name: _make_input(p, _shape(p.spec, {**glob, **sizes}), vocab=vocab,
                                      group=n, gen=gen, shuffle_groups=d["shuffle"],
                                      empty_rows=d["empty"])
                  for p in spec.wired_inputs(d["present"]) if p.name in d["present"]}
        if given_ctx is None:
            node_ctx = default_context(spec, glob, model=model, tokenizer=tokenizer)
        else:
            node_ctx = given_ctx
            node_ctx.dims = dict(glob)
            node_ctx.metrics.clear()
        resources = {"ctx": node_ctx, "model": model, "critic": model, "tokenizer": tokenizer}
        kwargs = {k: v for k, v in resources.items() if k in impl.accepts}
        kwargs |= inputs | {k: v for k, v in call_params.items()
                            if not (spec.trains and k in LOOP_PARAMS and k not in impl.accepts)
                            and not (k in executor and k not in impl.accepts)}
        where = (f"kind `{spec.name}` (impl {getattr(impl.fn, '__qualname__', impl.fn)}), "
                 f"sizes {out_sizes}, inputs {sorted(inputs)}")
        try:
            result = impl.fn(**kwargs)
            outputs = (_update_metrics(result, model, node_ctx) if spec.trains
                       else named_outputs([p.name for p in spec.outputs], result))
        except Exception as exc:  # a crash on well-formed inputs breaks the contract too
            raise AssertionError(f"{where}: raised {type(exc).__name__}: {exc}") from exc
        _check_outputs(spec, outputs, node_ctx, out_sizes, where)

    check()

