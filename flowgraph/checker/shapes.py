"""Dim and dtype unification along every edge.

Global dims (B, Bp, N, P, T, V and any declared under `dims:`) mean the same thing
everywhere; every other name in a contract is local to one node and is bound by the
first edge (in port order) that reaches it, or by a param (`generate.n`), or by the
kind's default (`n` -> N). Nodes are visited in topological order, so a mismatch is
reported on the edge where two bindings first disagree, with the chain of bindings
that led there.

One module past ~450 lines, on purpose: one algorithm, binding and unifying dims along
the edges, with the explanations of its mismatches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from flowgraph.checker.dtypes import dtype_hint
from flowgraph.checker.structure import Resolved, param_value
from flowgraph.contracts import TensorSpec
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.dims import CANONICAL_DIMS, Poly, format_dims, parse_expr
from flowgraph.ir import Graph, NodeSpec, PortRef

B_DEF = Poly.sym("Bp") * Poly.sym("N")
"""B is always Bp*N."""


@dataclass(frozen=True, slots=True)
class PortShape:
    """An output's contract with its dims resolved to global terms."""

    dims: tuple[Poly | None, ...]
    """Sizes after substituting local bindings; None for `_`."""
    variadic: bool
    spec: TensorSpec


@dataclass(frozen=True, slots=True)
class EdgeInfo:
    """What the checker concluded about one edge (for `viz` and the plan)."""

    src: PortRef
    dst: str
    port: str
    label: str
    """Resolved dims of the tensor on the edge, e.g. `(Bp*N, T) = (16, 32)`."""
    ok: bool


@dataclass
class DimEnv:
    """Global dim values, local bindings and why each was bound."""

    globals_: frozenset[str]
    values: dict[str, int] = field(default_factory=dict)
    locals_: dict[str, Poly] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def is_local(self, sym: str) -> bool:
        return "." in sym

    def qualify(self, poly: Poly, node: str) -> Poly:
        """Name a contract's local symbols after the node, substitute what is bound."""
        local = {s for s in poly.symbols() if s not in self.globals_}
        # A bound local is replaced by its value (already in global terms, B included).
        return poly.subs({"B": B_DEF}).subs({s: self._local(node, s) for s in local})

    def qualify_dims(self, spec: TensorSpec, node: str) -> tuple[Poly | None, ...]:
        """`qualify` on every fixed axis of a contract; `_` stays None."""
        return tuple(self.qualify(a.size, node) if a.size is not None else None
                     for a in spec.shape.fixed_axes())

    def _local(self, node: str, sym: str) -> Poly:
        q = f"{node}.{sym}"
        value = self.locals_.get(q)
        return Poly.sym(q) if value is None else value

    def numeric(self, poly: Poly) -> Poly:
        total = 0
        for mono, coeff in poly.terms:
            for sym, power in mono:
                if sym not in self.values:
                    # Some symbol is open: substitute what is known, keep the rest symbolic.
                    return poly.subs({k: Poly.const(v) for k, v in self.values.items()})
                coeff *= self.values[sym] ** power
            total += coeff
        return Poly.const(total)

    def show(self, poly: Poly | None) -> str:
        if poly is None:
            return "_"
        n = self.numeric(poly)
        return str(poly) if n == poly or not n.is_const() else f"{poly}={n}"

    def value(self, poly: Poly | None) -> int | None:
        if poly is None:
            return None
        n = self.numeric(poly)
        return n.const_value() if n.is_const() else None

    def label(self, dims: tuple[Poly | None, ...], variadic: bool = False) -> str:
        sym = format_dims(dims)
        nums = tuple(self.numeric(d) if d is not None else None for d in dims)
        pre = "(..., " if variadic else ""
        text = pre + sym[1:] if variadic else sym
        if all(n is None or n.is_const() for n in nums) and nums != dims:
            return f"{text} = {format_dims(nums)}"
        return text


@dataclass
class ShapeResult:
    env: DimEnv
    outputs: dict[tuple[str, str], PortShape]
    edges: list[EdgeInfo]
    batch: dict[str, int | None]
    """Per node: the size of the first axis of its first wired input, when known."""


# --- global dims -------------------------------------------------------------------


def build_env(graph: Graph, table: dict[str, Resolved], out: list[Diagnostic]) -> DimEnv:
    env = DimEnv(frozenset(CANONICAL_DIMS) | {d.name for d in graph.dims})
    for d in graph.dims:
        if d.value is not None:
            env.values[d.name] = d.value
            env.why[d.name] = f"{d.name} = {d.value} from dims ({d.pos})"
    _derive_b(graph, env, out)
    _bind_global_params(table, env, out)
    return env


def _derive_b(graph: Graph, env: DimEnv, out: list[Diagnostic]) -> None:
    """B = Bp*N: accept B alone (N = 1), or B with one of Bp, N; check all three."""
    if "B" not in env.values:
        return
    pos = next(d.pos for d in graph.dims if d.name == "B")
    b = env.values.pop("B")
    bp, n = env.values.get("Bp"), env.values.get("N")
    if bp is None and n is None:
        bp, n = b, 1
    elif bp is None:
        assert n is not None
        bp = b // n if b % n == 0 else None
    elif n is None:
        n = b // bp if b % bp == 0 else None
    if bp is None or n is None or bp * n != b:
        out.append(error("FG206", f"dims: B = {b} is not Bp*N", pos,
                         expected="B = Bp*N", actual=f"B={b}, Bp={env.values.get('Bp')}, "
                         f"N={env.values.get('N')}",
                         hint="B is derived as Bp*N; give Bp and N (or B alone, meaning N=1)"))
        return
    for name, v in (("Bp", bp), ("N", n)):
        if name not in env.values:
            env.values[name] = v
            env.why[name] = f"{name} = {v} derived from B = {b} ({pos})"


def _bind_global_params(table: dict[str, Resolved], env: DimEnv, out: list[Diagnostic]) -> None:
    """`max_new_tokens: 32` binds T: it must agree with `dims:` and with other nodes."""
    for r in table.values():
        if r.kind is None:
            continue
        for spec in r.kind.params:
            p = r.spec.params.find(spec.name)
            if spec.dim is None or spec.dim not in env.globals_ or p is None:
                continue
            if not isinstance(p.value, int) or isinstance(p.value, bool) or p.value < 1:
                continue
            where = f"{r.name}.params.{spec.name} ({p.pos})"
            have = env.values.get(spec.dim)
            if have is not None and have != p.value:
                out.append(error("FG205", f"`{r.name}.params.{spec.name}` = {p.value}, but "
                                 f"{spec.dim} = {have}", p.pos, node=r.name,
                                 expected=f"{spec.dim} = {have}", actual=str(p.value),
                                 notes=(env.why.get(spec.dim, ""),),
                                 hint=f"make them agree, or drop one: `{spec.name}` binds "
                                      f"{spec.dim} when `dims:` leaves it open"))
            elif have is None:
                env.values[spec.dim] = p.value
                env.why[spec.dim] = f"{spec.dim} = {p.value} from {where}"


# --- per node ------------------------------------------------------------------------


def topo_order(graph: Graph, skip: set[str]) -> list[NodeSpec]:
    """Kahn's algorithm in file order; nodes in `skip` (on cycles) are left out. A name
    that several nodes share (FG101) is one node, the last of them."""
    names = {n.name for n in graph.nodes} - skip
    indeg = dict.fromkeys(names, 0)
    succ: dict[str, list[str]] = {n: [] for n in names}
    for node in graph.nodes:
        if node.name not in names:
            continue
        for _, ref in node.inputs:
            if ref.node in names:
                indeg[node.name] += 1
                succ[ref.node].append(node.name)
    ready = deque(n.name for n in graph.nodes if n.name in names and indeg[n.name] == 0)
    order: list[str] = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for s in succ[name]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    by_name = {n.name: n for n in graph.nodes}
    return [by_name[n] for n in order]


def infer_shapes(graph: Graph, table: dict[str, Resolved], skip: set[str],
                 out: list[Diagnostic]) -> ShapeResult:
    env = build_env(graph, table, out)
    res = ShapeResult(env, {}, [], {})
    for d in graph.data:
        r = table.get(d.name)
        if r is not None and r.spec is d and r.kind is not None:
            _outputs(r, env, res)
    for node in topo_order(graph, skip):
        r = table.get(node.name)
        if r is None or r.spec is not node or r.kind is None:
            continue
        _bind_param_locals(r, env)
        if _unify_inputs(node, r, env, res, out):
            _apply_defaults(r, env)
            _outputs(r, env, res)
    return res


def _bind_param_locals(r: Resolved, env: DimEnv) -> None:
    assert r.kind is not None
    for spec in r.kind.params:
        p = r.spec.params.find(spec.name)
        if spec.dim is None or spec.dim in env.globals_ or p is None:
            continue
        if isinstance(p.value, int) and not isinstance(p.value, bool) and p.value >= 1:
            q = f"{r.name}.{spec.dim}"
            env.locals_[q] = Poly.const(p.value)
            env.why[q] = f"`{spec.dim}` of `{r.name}` = {p.value} from params.{spec.name} ({p.pos})"


def _apply_defaults(r: Resolved, env: DimEnv) -> None:
    assert r.kind is not None
    for var, expr in r.kind.dim_defaults:
        q = f"{r.name}.{var}"
        if q not in env.locals_:
            env.locals_[q] = parse_expr(expr).subs({"B": B_DEF})
            env.why[q] = f"`{var}` of `{r.name}` = {expr} (the kind's default)"


def _outputs(r: Resolved, env: DimEnv, res: ShapeResult) -> None:
    assert r.kind is not None
    carried = _carried_dtype(r, res)
    for p in r.kind.outputs:
        dims = env.qualify_dims(p.spec, r.name)
        spec = replace(p.spec, dtype=carried) if p.spec.dtype == "any" and carried else p.spec
        res.outputs[(r.name, p.name)] = PortShape(dims, p.spec.shape.variadic, spec)


def _carried_dtype(r: Resolved, res: ShapeResult) -> str | None:
    """What an `any` output carries: the dtype its node's `any` input was given
    (`repeat` of float scores gives float)."""
    if not isinstance(r.spec, NodeSpec) or r.kind is None:
        return None
    for port, ref in r.spec.inputs:
        declared, given = r.kind.input(port), res.outputs.get((ref.node, ref.port))
        if declared is not None and declared.spec.dtype == "any" and given is not None:
            return given.spec.dtype
    return None


def _unify_inputs(node: NodeSpec, r: Resolved, env: DimEnv, res: ShapeResult,
                  out: list[Diagnostic]) -> bool:
    """Unify every wired input; False when an input's source is unknown (no outputs then)."""
    assert r.kind is not None
    known = True
    wired = dict(node.inputs)
    for port in r.kind.wired_inputs(wired):
        ref = wired.get(port.name)
        if ref is None:
            known = known and port.optional
            continue
        shape = res.outputs.get((ref.node, ref.port))
        if shape is None:
            known = False
            continue
        if node.name not in res.batch:
            res.batch[node.name] = env.value(shape.dims[0]) if shape.dims else None
        ok = _unify_edge(ref, node, port.name, port.spec, shape, env, out, res.outputs)
        label = env.label(shape.dims, shape.variadic)
        res.edges.append(EdgeInfo(ref, node.name, port.name, label, ok))
    return known


def has_batch_axis(shapes: ShapeResult, ref: PortRef) -> bool:
    """Every batch axis derives from a data source's Bp (B is Bp*N); an axis still bound
    to a node-local name, or `_`, is taken for a batch axis to be safe: a batch
    broadcast instead of split would silently repeat rows."""
    shape = shapes.outputs.get((ref.node, ref.port))
    if shape is None or shape.variadic:
        return True
    if not shape.dims:
        return False
    first = shape.dims[0]
    return first is None or any(s == "Bp" or "." in s for s in first.symbols())


@dataclass(frozen=True, slots=True)
class _Edge:
    ref: PortRef
    node: str
    port: str
    spec: TensorSpec
    shape: PortShape

    @property
    def text(self) -> str:
        return f"{self.ref} -> {self.node}.{self.port}"


def _unify_edge(ref: PortRef, node: NodeSpec, port: str, spec: TensorSpec, shape: PortShape,
                env: DimEnv, out: list[Diagnostic],
                outputs: Mapping[tuple[str, str], PortShape]) -> bool:
    e = _Edge(ref, node.name, port, spec, shape)
    ok = True
    if not spec.accepts_dtype(shape.spec):
        ok = False
        out.append(error("FG203", f"edge `{e.text}`: `{port}` takes {spec.dtype}, `{ref}` gives "
                         f"{shape.spec.dtype}", ref.pos, node=node.name, edge=e.text,
                         expected=spec.describe(), actual=shape.spec.describe(),
                         hint=dtype_hint(port, spec, shape.spec, {
                             k: (s.spec, None if s.variadic else len(s.dims))
                             for k, s in outputs.items()})))
    pairs = _align(e, env, out)
    if pairs is None:
        return False
    for i, (axis_size, broadcast, pdim) in enumerate(pairs):
        problem = _unify_axis(e, i, axis_size, broadcast, pdim, env)
        if problem is not None:
            out.append(problem)
            return False
    return ok


def _align(e: _Edge, env: DimEnv, out: list[Diagnostic]
           ) -> list[tuple[Poly | None, bool, Poly | None]] | None:
    """Pair consumer axes with producer dims, trailing-aligned for variadic contracts."""
    cons = e.spec.shape.fixed_axes()
    prod = e.shape.dims
    flexible = e.spec.shape.variadic or e.shape.variadic
    if len(cons) == len(prod) or (flexible and len(prod) >= len(cons)):
        k = len(cons)
        tail = prod[len(prod) - k:] if k else ()
        return [(a.size, a.broadcast, p) for a, p in zip(cons, tail, strict=False)]
    if flexible and e.shape.variadic:
        k = len(prod)
        return [(a.size, a.broadcast, p) for a, p in zip(cons[len(cons) - k:], prod, strict=False)]
    expected = _expected_label(e, env)
    actual = env.label(prod)
    out.append(error("FG201", f"edge `{e.text}`: `{e.port}` takes {len(cons)} axes {expected}, "
                     f"`{e.ref}` gives {len(prod)} {actual}", e.ref.pos, node=e.node,
                     edge=e.text, expected=f"{e.spec.dtype}[{e.spec.dims}] {expected}",
                     actual=f"{e.shape.spec.dtype}[{e.shape.spec.dims}] {actual}",
                     notes=_notes(e, env), hint=_rank_hint(cons, prod, env)))
    return None


def _expected_label(e: _Edge, env: DimEnv) -> str:
    return _unqualify(env.label(env.qualify_dims(e.spec, e.node)), e.node)


def _unqualify(text: str, node: str) -> str:
    return text.replace(f"{node}.", "")


def _unify_axis(e: _Edge, i: int, size: Poly | None, broadcast: bool, pdim: Poly | None,
                env: DimEnv) -> Diagnostic | None:
    if size is None or pdim is None:
        return None
    q = env.qualify(size, e.node)
    if q == pdim:  # the common case; an unbound local of this node never equals pdim
        return None
    unbound = [s for s in q.symbols() if env.is_local(s) and s not in env.locals_]
    if unbound:
        return _bind(e, i, q, unbound, pdim, env)
    diff = env.numeric(q - pdim)
    if diff == Poly.const(0):
        return None
    if broadcast and env.numeric(pdim) == Poly.const(1):
        return None
    code = "FG202" if diff.is_const() else "FG204"
    rule = "differs from" if diff.is_const() else "cannot be proved equal to"
    return error(code, f"edge `{e.text}`: axis {i + 1} is {env.show(pdim)}, which {rule} "
                 f"the expected {_unqualify(env.show(q), e.node)}", e.ref.pos, node=e.node,
                 edge=e.text, expected=f"{e.spec.dtype}[{e.spec.dims}] {_expected_label(e, env)}",
                 actual=f"{e.shape.spec.dtype}[{e.shape.spec.dims}] {env.label(e.shape.dims)}",
                 notes=_notes(e, env), hint=_dim_hint(q, pdim, env, code))


def _bind(e: _Edge, i: int, q: Poly, unbound: list[str], pdim: Poly, env: DimEnv
          ) -> Diagnostic | None:
    sol = q.linear_in(unbound[0]) if len(unbound) == 1 else None
    if sol is None or sol[0] not in (1, -1):
        return error("FG204", f"edge `{e.text}`: cannot infer {', '.join(unbound)} from axis "
                     f"{i + 1} ({env.show(pdim)})", e.ref.pos, node=e.node, edge=e.text,
                     hint="write the axis as a single name or name-plus-constant in the "
                          "contract, or bind the dim under `dims:`")
    coef, rest = sol
    value = (pdim - rest) if coef == 1 else (rest - pdim)
    var = unbound[0]
    env.locals_[var] = value
    node, short = var.split(".", 1)
    env.why[var] = f"`{short}` of `{node}` = {env.show(value)}, from edge {e.text} ({e.ref.pos})"
    return None


def _notes(e: _Edge, env: DimEnv) -> tuple[str, ...]:
    """The bindings behind both sides of an edge: producer's, consumer's, then global."""
    keys = [f"{e.ref.node}.{s}" for s in sorted(e.shape.spec.shape.symbols())]
    keys += [f"{e.node}.{s}" for s in sorted(e.spec.shape.symbols())]
    syms: set[str] = set()
    for d in e.shape.dims:
        syms |= d.symbols() if d is not None else set()
    for k in list(keys):
        if k in env.locals_:
            syms |= env.locals_[k].symbols()
    keys += sorted(s for s in syms if s in env.globals_)
    seen: list[str] = []
    for k in keys:
        note = env.why.get(k)
        if note and note not in seen:
            seen.append(note)
    return tuple(seen)


# --- hints ---------------------------------------------------------------------------


def _rank_hint(cons: tuple[object, ...], prod: tuple[Poly | None, ...], env: DimEnv) -> str:
    if len(cons) == 2 and len(prod) == 1:
        return ("this input is per token, the producer gives one value per sequence. Outcome "
                "rewards are per sequence: add a `token_reward` node between them, or use an "
                "outcome-level estimator such as `grpo`")
    if len(cons) == 1 and len(prod) == 2:
        return ("this input takes one value per sequence, the producer gives one per token: "
                "use a per-sequence output (e.g. `sequence_logprob`, a reward's `scores`)")
    if len(prod) == len(cons) + 1:
        last = env.show(prod[-1])
        return (f"the producer has an extra last axis of size {last}: a value or reward head "
                "with several labels? use a scalar head (num_labels=1)")
    return "check that both ends carry the same kind of tensor"


def _dim_hint(want: Poly, got: Poly, env: DimEnv, code: str) -> str:
    diff = env.numeric(want - got)
    gs, ws = got.symbols(), want.symbols()
    if "N" in gs ^ ws and "Bp" in gs | ws:
        return ("one side is per prompt (Bp), the other per sample (Bp*N): take both from the "
                "`generate` node's outputs, which repeat each prompt N times")
    if diff.is_const() and abs(diff.const_value()) == 1 and gs == ws:
        return ("the two sides differ by one position (an off-by-one shift?); per-token "
                "tensors must cover all T response tokens")
    if code == "FG204":
        return "bind the dims involved under `dims:` or make the contracts use the same names"
    return "both ends must agree on this axis"


def group_size(node: NodeSpec, table: dict[str, Resolved], env: DimEnv) -> int | None:
    """Samples per group for a grouped node: the `n` of the generate that made its index."""
    ref = node.input("index")
    src = table.get(ref.node) if ref else None
    if src is None or src.kind is None or src.kind.category != "rollout":
        return None
    n = env.locals_.get(f"{src.name}.n")
    value = env.value(n)
    if value is None and isinstance(param_value(src, "n"), int):
        return param_value(src, "n")  # type: ignore[return-value]
    return value
