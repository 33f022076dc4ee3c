"""The fix an FG203 (dtype mismatch along an edge) suggests: only outputs that exist.

A hint to "wire an output of dtype int" where the graph has none sends the user looking
for something that is not there. So the hint names the outputs of this graph, before the
consumer in topological order (wiring one makes no cycle), that the port takes, the same
port name first; where there are none, it says how to make the port take what it is
given. A mask given is answered with the annotation that takes the one mask type
(`MASK_DTYPE`): every mask is of that type, so no other output would do.
"""

from __future__ import annotations

from collections.abc import Mapping

from flowgraph.contracts import MASK_DTYPE, TensorSpec

SHOWN = 3
"""Outputs a hint names at most."""

Shaped = Mapping[tuple[str, str], tuple[TensorSpec, int | None]]
"""Every output shaped so far, by (node, port): its contract and its rank (None: any)."""


def dtype_hint(port: str, want: TensorSpec, got: TensorSpec, outputs: Shaped) -> str:
    """What to do about input `port` (taking `want`) wired to an output giving `got`."""
    if "binary" in got.constraints:  # a mask: every mask is one type, so the port is wrong
        return (f"a mask is {MASK_DTYPE} {{binary}} (every built-in gives one so): a custom "
                f"kind takes it annotated `Int[Tensor, \"{want.dims}\"]`, or "
                f"`Bool[Tensor, \"{want.dims}\"]` to get it as bool")
    rank = len(want.shape.fixed_axes())
    fits = sorted((f"{node}.{out}" for (node, out), (spec, dims) in outputs.items()
                   if want.accepts_dtype(spec)
                   and (want.shape.variadic or dims is None or dims == rank)),
                  key=lambda ref: ref.split(".", 1)[1] != port)
    if fits:
        named = ", ".join(f"`{ref}`" for ref in fits[:SHOWN])
        return f"{_what(want, got)}wire an output that gives {want.dtype}: {named}"
    return (f"{_what(want, got)}no output of this graph gives {want.dtype}: make `{port}` "
            f"take {got.dtype} (a custom kind: its annotation), or convert it in a node "
            "between them")


def _what(want: TensorSpec, got: TensorSpec) -> str:
    """Why the two do not mix, where a word helps."""
    if want.dtype == "float" and got.dtype in ("int", "mask", "bool"):
        return "this input takes real values (log-probs, scores, values); "
    if want.dtype == "int" and got.dtype == "float":
        return "this input takes token ids or indices; "
    if "str" in (want.dtype, got.dtype):
        return "text (ground truth, data source names) and tensors do not mix; "
    return ""
