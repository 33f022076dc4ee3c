"""Dim and dtype unification along every edge.

Global dims (B, Bp, N, P, T, V and any declared under `dims:`) mean the same thing
everywhere; every other name in a contract is local to one node and is bound by the
first edge (in port order) that reaches it, or by a param (`generate.n`), or by the
kind's default (`n` -> N). Nodes are visited in topological order, so a mismatch is
reported on the edge where two bindings first disagree, with the chain of bindings
that led there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

from flowgraph.check.structure import Resolved, param_value
from flowgraph.contracts import TensorSpec, dtype_set
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.dims import CANONICAL_DIMS, Poly, format_dims, parse_expr
from flowgraph.ir import Graph, NodeSpec, PortRef
from flowgraph.registry import KindSpec, ParamSpec

B_DEF = Poly.sym("Bp") * Poly.sym("N")
"""B is always Bp*N."""


@dataclass(frozen=True, slots=True)
class PortShape:
    """An output's contract with its dims resolved to global terms."""

    dims: tuple[Poly | None, ...]
    """Sizes after substituting local bindings; None for `_`."""
    variadic: bool
    spec: TensorSpec


class EdgeInfo(NamedTuple):
    """What the checker concluded about one edge (for `viz` and the plan).

    A named tuple, not a frozen dataclass: the checker makes one per edge, 44,000 for a
    10,000-node graph, and a tuple is made in about a third of the time.
    """

    src: PortRef
    dst: str
    port: str
    label: str
    """Resolved dims of the tensor on the edge, e.g. `(Bp*N, T) = (16, 32)`."""
    ok: bool


@dataclass(frozen=True, slots=True)
class _Contract:
    """A contract's fixed axes, prepared once for `DimEnv.qualify`."""

    spec: TensorSpec
    """Kept alive: a contract is filed under the id of its spec."""
    bases: tuple[Poly | None, ...]
    """Each axis's size with B substituted; None for `_` and where `names` has the axis."""
    names: tuple[str | None, ...]
    """The local name where an axis's size is just that name (`b`)."""
    simple: bool
    """Every axis is `_`, global dims only, or one local name: no axis needs a local
    substituted into an expression (`b*n`)."""


@dataclass
class DimEnv:
    """Global dim values, local bindings and why each was bound."""

    globals_: frozenset[str]
    values: dict[str, int] = field(default_factory=dict)
    locals_: dict[str, Poly] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    _split: dict[int, tuple[Poly, Poly, tuple[str, ...], bool]] = field(default_factory=dict,
                                                                         repr=False)
    """Memo for `qualify`, by the id of a contract's size (kept alive in the value, so the
    id stays its own): the size, with B substituted, its local names, whether it is just
    one local name."""
    _contracts: dict[int, _Contract] = field(default_factory=dict, repr=False)
    """Memo for `contract`, by the id of the spec."""

    def is_local(self, sym: str) -> bool:
        return "." in sym

    def qualify(self, poly: Poly, node: str) -> Poly:
        """Name a contract's local symbols after the node, substitute what is bound."""
        _, base, local, lone = self._prepared(poly)
        if not local:
            return base
        # A bound local is replaced by its value (already in global terms, B included).
        if lone:
            return self._local(node, local[0])  # the common `b`: no polynomial arithmetic
        return base.subs({s: self._local(node, s) for s in local})

    def qualify_dims(self, spec: TensorSpec, node: str) -> tuple[Poly | None, ...]:
        """`qualify` on every fixed axis of a contract; `_` stays None."""
        c = self.contract(spec)
        if not c.simple:
            return tuple(self.qualify(a.size, node) if a.size is not None else None
                         for a in spec.shape.fixed_axes())
        return tuple(base if name is None else self._local(node, name)
                     for base, name in zip(c.bases, c.names, strict=True))

    def contract(self, spec: TensorSpec) -> _Contract:
        c = self._contracts.get(id(spec))
        if c is None:
            split = [self._prepared(a.size) if a.size is not None else None
                     for a in spec.shape.fixed_axes()]
            names = tuple(x[2][0] if x is not None and x[3] else None for x in split)
            bases = tuple(x[1] if x is not None and not x[3] else None for x in split)
            simple = all(x is None or x[3] or not x[2] for x in split)
            c = self._contracts[id(spec)] = _Contract(spec, bases, names, simple)
        return c

    def _prepared(self, poly: Poly) -> tuple[Poly, Poly, tuple[str, ...], bool]:
        split = self._split.get(id(poly))
        if split is None:
            local = tuple(sorted(s for s in poly.symbols() if s not in self.globals_))
            base = poly.subs({"B": B_DEF})
            lone = len(local) == 1 and base == Poly.sym(local[0])
            split = self._split[id(poly)] = (poly, base, local, lone)
        return split

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
    labels: dict[tuple[tuple[Poly | None, ...], bool], str] = field(default_factory=dict)
    """`EdgeInfo.label` by resolved dims: thousands of edges carry the same few shapes."""
    # Memos by the id of the argument, which the entry keeps alive (so the id stays its
    # own): thousands of edges carry the same few shapes, and hashing their dims cost
    # more than the rest of an edge.
    _label_of: dict[int, tuple[PortShape, str]] = field(default_factory=dict, repr=False)
    _shown: dict[int, tuple[Poly, str]] = field(default_factory=dict, repr=False)
    _value_of: dict[int, tuple[Poly, int | None]] = field(default_factory=dict, repr=False)
    _interned: dict[tuple[int, tuple[Poly | None, ...]], PortShape] = field(default_factory=dict,
                                                                        repr=False)
    """Outputs by the id of their spec and their dims: one object for equal shapes lets
    the nodes they reach share a `_Replay`."""

    def port_shape(self, dims: tuple[Poly | None, ...], spec: TensorSpec) -> PortShape:
        """`PortShape(dims, spec.shape.variadic, spec)`, the first one made."""
        shape = self._interned.get((id(spec), dims))
        if shape is None:
            shape = self._interned[(id(spec), dims)] = PortShape(dims, spec.shape.variadic, spec)
        return shape

    def label(self, shape: PortShape) -> str:
        """`EdgeInfo.label` for an edge carrying `shape`."""
        memo = self._label_of.get(id(shape))
        if memo is None:
            key = (shape.dims, shape.variadic)
            text = self.labels.get(key)
            if text is None:
                text = self.labels[key] = self.env.label(shape.dims, shape.variadic)
            memo = self._label_of[id(shape)] = (shape, text)
        return memo[1]

    def show(self, value: Poly) -> str:
        """`env.show(value)`: a node binds its `b` to one of a few values."""
        memo = self._shown.get(id(value))
        if memo is None:
            memo = self._shown[id(value)] = (value, self.env.show(value))
        return memo[1]

    def value(self, size: Poly) -> int | None:
        """`env.value(size)`."""
        memo = self._value_of.get(id(size))
        if memo is None:
            memo = self._value_of[id(size)] = (size, self.env.value(size))
        return memo[1]


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
    by_kind: dict[int, tuple[KindSpec, tuple[ParamSpec, ...]]] = {}
    for r in table.values():
        if r.kind is None:
            continue
        # By the id of the kind (kept alive in the value): a few kinds, thousands of nodes.
        dim_params = by_kind.get(id(r.kind))
        if dim_params is None:
            dim_params = by_kind[id(r.kind)] = (r.kind, _dim_params(r.kind))
        for spec in dim_params[1]:
            p = r.spec.params.find(spec.name)
            if spec.dim not in env.globals_ or p is None:
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


def _dim_params(kind: KindSpec) -> tuple[ParamSpec, ...]:
    """The params of a kind that bind a dim; most kinds have none, so no node's params
    need searching."""
    return tuple(spec for spec in kind.params if spec.dim is not None)


# --- per node ------------------------------------------------------------------------


def topo_order(graph: Graph, skip: set[str]) -> list[NodeSpec]:
    """Kahn's algorithm in file order; nodes in `skip` (on cycles) are left out. A name
    that several nodes share (FG101) is one node, the last of them."""
    # By number rather than by name: indexing a list costs half of hashing a name.
    index: dict[str, int] = {}
    for n in graph.nodes:
        if n.name not in skip:
            index.setdefault(n.name, len(index))
    last: dict[int, NodeSpec] = {}
    indeg = [0] * len(index)
    succ: list[list[int]] = [[] for _ in index]
    for node in graph.nodes:
        i = index.get(node.name)
        if i is None:
            continue
        last[i] = node
        deg = 0
        for _, ref in node.inputs:
            j = index.get(ref.node)
            if j is not None:
                deg += 1
                succ[j].append(i)
        indeg[i] += deg
    ready = [i for i in map(index.get, (n.name for n in graph.nodes))
             if i is not None and indeg[i] == 0]
    return [last[i] for i in _kahn(ready, succ, indeg)]


def _kahn(order: list[int], succ: list[list[int]], indeg: list[int]) -> list[int]:
    """Kahn's algorithm from the nodes `order` starts with; `indeg` is used up."""
    for i in order:  # grows while walked: the queue
        for j in succ[i]:
            left = indeg[j] - 1
            indeg[j] = left
            if not left:
                order.append(j)
    return order


@dataclass(slots=True)
class _KindPlan:
    """What unifying a node of one kind asks of the kind, gathered once per check, and
    the `_Replay`s of its nodes so far."""

    kind: KindSpec
    dim_params: tuple[ParamSpec, ...]
    locals_: tuple[str, ...]
    """Every local dim a node's unification reads: in its contracts or its defaults."""
    memo: dict[tuple[object, ...], _Replay] = field(default_factory=dict)
    """By the key `_unify_node` makes."""

    @staticmethod
    def of(kind: KindSpec, globals_: frozenset[str]) -> _KindPlan:
        syms: set[str] = {var for var, _ in kind.dim_defaults}
        for p in (*kind.inputs, *kind.outputs):
            syms |= p.spec.shape.symbols()
        return _KindPlan(kind, _dim_params(kind), tuple(sorted(syms - globals_)))

    def recall(self, key: tuple[object, ...]) -> _Replay | None:
        return self.memo.get(key)


@dataclass(frozen=True, slots=True)
class _Replay:
    """What unifying one node did, in terms that hold for every node of its kind with the
    same key: the same inputs, in the same order, from the same producer shapes, and the
    same locals bound before (by params)."""

    shapes: tuple[PortShape, ...]
    """Kept alive: the key holds their ids."""
    edges: tuple[tuple[int, str, str], ...]
    """(index in `NodeSpec.inputs`, input port, label) of each edge, in order."""
    binds: tuple[tuple[int, str, str, Poly, str], ...]
    """(index in `NodeSpec.inputs`, input port, local dim, value, value shown) of each
    local an edge bound, in order."""
    batch: tuple[int | None, ...]
    """The node's `ShapeResult.batch`, or () when no input's source is known."""
    known: bool
    """Every input's source is known: then defaults apply and the outputs exist."""
    defaults: bool
    """The kind has dim defaults (`_apply_defaults`)."""
    outputs: tuple[tuple[str, PortShape], ...]


def infer_shapes(graph: Graph, table: dict[str, Resolved], skip: set[str],
                 out: list[Diagnostic], order: list[NodeSpec] | None = None) -> ShapeResult:
    """Unify along every edge; `order` is `topo_order(graph, skip)` when the caller has it."""
    env = build_env(graph, table, out)
    res = ShapeResult(env, {}, [], {})
    for d in graph.data:
        r = table.get(d.name)
        if r is not None and r.spec is d and r.kind is not None:
            _outputs(r, env, res)
    plans: dict[int, _KindPlan] = {}
    """By the id of the kind (kept alive in the plan)."""
    for node in topo_order(graph, skip) if order is None else order:
        r = table.get(node.name)
        if r is None or r.spec is not node or r.kind is None:
            continue
        plan = plans.get(id(r.kind))
        if plan is None:
            plan = plans[id(r.kind)] = _KindPlan.of(r.kind, env.globals_)
        if plan.dim_params:
            _bind_param_locals(r, plan.dim_params, env)
        _unify_node(node, r, plan, env, res, out)
    return res


def _bind_param_locals(r: Resolved, dim_params: tuple[ParamSpec, ...], env: DimEnv) -> None:
    for spec in dim_params:
        p = r.spec.params.find(spec.name)
        if spec.dim in env.globals_ or p is None:
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
    for p in r.kind.outputs:
        res.outputs[(r.name, p.name)] = res.port_shape(env.qualify_dims(p.spec, r.name), p.spec)


def _unify_node(node: NodeSpec, r: Resolved, plan: _KindPlan, env: DimEnv, res: ShapeResult,
                out: list[Diagnostic]) -> None:
    """Unify a node's inputs, then its defaults and outputs: replayed where a node of its
    kind had the same key (thousands of nodes are copies of a few), else done in full."""
    name, outputs = node.name, res.outputs
    # Everything the unification reads: the locals bound so far (by params), and which
    # producer shape reaches each input, by id (that of None where the producer is
    # unknown): hashing dims would cost more than the edge.
    key: list[object] = []
    for s in plan.locals_:
        key.append(env.locals_.get(f"{name}.{s}"))
    for port, ref in node.inputs:
        key += (port, id(outputs.get((ref.node, ref.port))))
    replay = plan.recall(tuple(key))
    if replay is not None:
        _replay(replay, node, r, env, res)
        return
    sources = {port: outputs.get((ref.node, ref.port)) for port, ref in node.inputs}
    first = len(res.edges)
    known, binds = _unify_inputs(node, r, env, res, out)
    if known:
        _apply_defaults(r, env)
        _outputs(r, env, res)
    # Only a node whose edges all fit (no diagnostics, nothing solved for) and whose
    # outputs name no local of its own (all bound) is one other nodes can copy.
    if binds is None:
        return
    if known and any(f"{name}.{s}" not in env.locals_ for s in plan.locals_):
        return
    made = res.edges[first:]
    head = sources[made[0].port] if made else None  # where `_unify_inputs` took the batch
    index = {port: i for i, (port, _) in enumerate(node.inputs)}
    plan.memo[tuple(key)] = _Replay(
        tuple(s for s in sources.values() if s is not None),
        tuple((index[e.port], e.port, e.label) for e in made),
        tuple((index[port], port, local, value, shown)
              for port, local, value, shown in binds),
        () if head is None else (_batch(head, res),), known, bool(plan.kind.dim_defaults),
        tuple((p.name, outputs[(name, p.name)]) for p in plan.kind.outputs) if known else ())


def _replay(replay: _Replay, node: NodeSpec, r: Resolved, env: DimEnv, res: ShapeResult
            ) -> None:
    """What `_unify_inputs`, `_apply_defaults` and `_outputs` do to a node with this key."""
    name, inputs, edges = node.name, node.inputs, res.edges
    for i, port, label in replay.edges:
        edges.append(EdgeInfo(inputs[i][1], name, port, label, True))
    if replay.batch and name not in res.batch:
        res.batch[name] = replay.batch[0]
    for i, port, local, value, shown in replay.binds:
        ref = inputs[i][1]
        _record(env, f"{name}.{local}", value, shown, f"{ref} -> {name}.{port}", ref)
    if replay.known:
        if replay.defaults:
            _apply_defaults(r, env)
        for port, shape in replay.outputs:
            res.outputs[(name, port)] = shape


def _unify_inputs(node: NodeSpec, r: Resolved, env: DimEnv, res: ShapeResult,
                  out: list[Diagnostic]) -> tuple[bool, list[tuple[str, str, Poly, str]] | None]:
    """Unify every wired input. Whether every input's source is known (no outputs
    otherwise), and the locals bound by `_fits` as `_Replay.binds`, or None when an
    edge needed `_unify_edge`."""
    assert r.kind is not None
    known = True
    made: list[tuple[str, str, Poly, str]] | None = []
    wired = dict(node.inputs)
    for port in r.kind.inputs:
        ref = wired.get(port.name)
        if ref is None:
            known = known and port.optional
            continue
        shape = res.outputs.get((ref.node, ref.port))
        if shape is None:
            known = False
            continue
        if node.name not in res.batch:
            res.batch[node.name] = _batch(shape, res)
        binds = _fits(port.spec, shape, node.name, env)
        if binds is None:
            made = None
            ok = _unify_edge(ref, node, port.name, port.spec, shape, env, out)
        else:
            ok = True
            for var, value in binds:
                shown = res.show(value)
                _record(env, var, value, shown, f"{ref} -> {node.name}.{port.name}", ref)
                if made is not None:
                    made.append((port.name, var.split(".", 1)[1], value, shown))
        res.edges.append(EdgeInfo(ref, node.name, port.name, res.label(shape), ok))
    return known, made


def _batch(shape: PortShape, res: ShapeResult) -> int | None:
    """The batch of a node whose first input with a known source carries `shape`."""
    first = shape.dims[0] if shape.dims else None
    return res.value(first) if first is not None else None


def _fits(spec: TensorSpec, shape: PortShape, node: str, env: DimEnv
          ) -> list[tuple[str, Poly]] | None:
    """The bindings an edge makes, when it needs nothing else from `_unify_edge`.

    That is most edges: the dtypes fit, the ranks match, and every axis equals the
    producer's or is a local name of this node not bound yet (bound to the producer's
    size, as `_bind` would: the producer's dims never name this node's locals, as it
    comes first in topological order). None: anything else, for `_unify_edge`.
    """
    c, dims = env.contract(spec), shape.dims
    if not c.simple or len(c.names) != len(dims) or not _dtype_fits(spec.dtype,
                                                                    shape.spec.dtype):
        return None
    binds: list[tuple[str, Poly]] = []
    for base, name, pdim in zip(c.bases, c.names, dims, strict=True):
        if pdim is None:
            continue
        if name is None:
            if base is None or base is pdim or base == pdim:
                continue
            return None
        var = f"{node}.{name}"
        q = env.locals_.get(var)
        if q is None and all(v != var for v, _ in binds):
            binds.append((var, pdim))
        elif q is not pdim and q != pdim:
            return None
    return binds


@cache
def _dtype_fits(want: str, got: str) -> bool:
    """`TensorSpec.accepts_dtype`, by dtype names: every dtype `got` admits, `want` does."""
    return dtype_set(got) <= dtype_set(want)


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
                env: DimEnv, out: list[Diagnostic]) -> bool:
    e = _Edge(ref, node.name, port, spec, shape)
    ok = True
    if not spec.accepts_dtype(shape.spec):
        ok = False
        out.append(error("FG203", f"edge `{e.text}`: `{port}` takes {spec.dtype}, `{ref}` gives "
                         f"{shape.spec.dtype}", ref.pos, node=node.name, edge=e.text,
                         expected=spec.describe(), actual=shape.spec.describe(),
                         hint=_dtype_hint(spec, shape.spec)))
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
    dims = tuple(env.qualify(a.size, e.node) if a.size is not None else None
                 for a in e.spec.shape.fixed_axes())
    return _unqualify(env.label(dims), e.node)


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
    _record(env, unbound[0], value, env.show(value), e.text, e.ref)
    return None


def _record(env: DimEnv, var: str, value: Poly, shown: str, edge: str, ref: PortRef) -> None:
    """Bind the local `var` (`node.b`) from an edge, and say why."""
    env.locals_[var] = value
    node, short = var.split(".", 1)
    env.why[var] = f"`{short}` of `{node}` = {shown}, from edge {edge} ({ref.pos})"


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


def _dtype_hint(want: TensorSpec, got: TensorSpec) -> str:
    if want.dtype in ("float",) and got.dtype in ("int", "mask", "bool"):
        return "this input takes real values; wire a float output (log-probs, scores, values)"
    if want.dtype in ("int",) and got.dtype == "float":
        return "this input takes token ids or indices; wire an integer output"
    if "str" in (want.dtype, got.dtype):
        return "text (ground truth, data source names) and tensors do not mix"
    return f"wire an output of dtype {want.dtype}"


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
    if src is None or src.kind is None or src.kind.name != "generate":
        return None
    n = env.locals_.get(f"{src.name}.n")
    value = env.value(n)
    if value is None and isinstance(param_value(src, "n"), int):
        return param_value(src, "n")  # type: ignore[return-value]
    return value
