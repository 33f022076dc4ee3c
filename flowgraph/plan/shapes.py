"""A plan's dims agree with themselves (`shape_problems`, which `verify` runs on every plan
compiled or read): a plan file edited by hand in one place and not the other is refused,
naming the node, the port and the field, instead of running on the contradiction.

* `dims`: B is Bp*N;
* an output's `dims` have as many axes as its kind's contract (`spec.dims`), and it is
  `batched` exactly when its first axis counts rows of the batch (a word with Bp or a
  node-local dim, or `_`), the rule the compiler applies (`has_batch_axis`);
* an input's `dims` are those of the output it reads (`_` matches any), and its `shape`
  (`(Bp*N, T) = (16, 8)`) is its dims at the plan's `dims`.
"""

from __future__ import annotations

from flowgraph.dims import Poly, parse_expr
from flowgraph.errors import DimError
from flowgraph.plan.records import ExecutionPlan, InputPlan, NodePlan, OutputPlan

FIX = "edit both alike, or compile the graph again"


def shape_problems(plan: ExecutionPlan) -> list[str]:
    """Every contradiction between the plan's dims, outputs and inputs."""
    values = {d.name: d.value for d in plan.dims}
    problems = _derived_problems(values)
    outputs = {f"{n.name}.{o.port}": o for n in plan.nodes for o in n.outputs}
    for node in plan.nodes:
        problems += [p for o in node.outputs for p in _output_problems(node, o)]
        problems += [p for i in node.inputs
                     for p in _input_problems(node, i, outputs.get(i.src), values)]
    return problems


def _derived_problems(values: dict[str, int]) -> list[str]:
    if not {"B", "Bp", "N"} <= values.keys() or values["B"] == values["Bp"] * values["N"]:
        return []
    return [f"`dims.B` is {values['B']}, but B is Bp*N = {values['Bp']}*{values['N']} = "
            f"{values['Bp'] * values['N']}: set Bp or N instead, and compile the graph again"]


def _variadic(spec_dims: str) -> bool:
    first = spec_dims.split()[:1]
    return bool(first) and (first[0] == "..." or first[0].startswith("*"))


def batch_word(word: str) -> bool:
    """A resolved axis (`Bp*N`, `gen.n*Bp`, `_`) counts rows of the batch: every batch
    axis derives from a data source's Bp; an open one is taken for one, to be safe."""
    if word == "_":
        return True
    return any(part == "Bp" or "." in part
               for part in word.replace("(", " ").replace(")", " ").replace("*", " ")
               .replace("+", " ").replace("-", " ").replace("/", " ").split())


def _output_problems(node: NodePlan, out: OutputPlan) -> list[str]:
    if out.dims is None or out.spec is None or _variadic(out.spec.dims):
        return []
    where = f"node `{node.name}` output `{out.port}`"
    words, contract = out.dims.split(), out.spec.dims.split()
    problems = [] if len(words) == len(contract) else [
        f"{where}: `dims` is `{out.dims}` ({_axes(len(words))}), but its kind's contract "
        f"`spec.dims` is `{out.spec.dims}` ({_axes(len(contract))}): {FIX}"]
    want = bool(words) and batch_word(words[0])
    if out.batched == want:
        return problems
    has = "has a batch axis" if want else "has no batch axis (Bp prompts or Bp*N samples first)"
    return [*problems, f"{where}: `batched` is {str(out.batched).lower()}, but its `dims` "
                       f"`{out.dims}` {has}: {FIX}"]


def _axes(n: int) -> str:
    return f"{n} axis" if n == 1 else f"{n} axes"


def _input_problems(node: NodePlan, wire: InputPlan, out: OutputPlan | None,
                    values: dict[str, int]) -> list[str]:
    where = f"node `{node.name}` input `{wire.port}`"
    problems = []
    variadic = (wire.spec is not None and _variadic(wire.spec.dims)) or (
        out is not None and out.spec is not None and _variadic(out.spec.dims))
    if (out is not None and out.dims is not None and wire.dims is not None
            and not variadic and not _same(wire.dims.split(), out.dims.split())):
        problems.append(f"{where}: `dims` is `{wire.dims}`, but the output it reads, "
                        f"`{wire.src}`, has `dims` `{out.dims}`: {FIX}")
    return problems + _shape_problems(where, wire.shape, values)


def _same(a: list[str], b: list[str]) -> bool:
    return len(a) == len(b) and all(x == y or "_" in (x, y) for x, y in zip(a, b, strict=True))


def _shape_problems(where: str, shape: str, values: dict[str, int]) -> list[str]:
    """`(Bp*N, T) = (16, 8)`: each number is its dim's value at the plan's `dims`."""
    dims, sep, numbers = shape.partition(" = ")
    if not sep:
        return []
    exprs, sizes = _items(dims), _items(numbers)
    for expr, size in zip(exprs, sizes, strict=False):
        if not size.isdigit():
            continue
        try:
            poly = parse_expr(expr)
        except DimError:
            continue
        if not poly.symbols() <= values.keys():
            continue
        value = poly.subs({k: Poly.const(v) for k, v in values.items()})
        if value.is_const() and value.const_value() != int(size):
            return [f"{where}: `shape` is `{shape}`, but {expr} is {value.const_value()} at "
                    f"the plan's `dims`: {FIX}"]
    return []


def _items(text: str) -> list[str]:
    """`(Bp*N, T)` -> [`Bp*N`, `T`]."""
    return [t.strip() for t in text.strip().removeprefix("(").removesuffix(")").split(",")
            if t.strip() and t.strip() != "..."]
