"""Batch arithmetic: mini-batches and data-parallel ranks divide the batch; groups stay whole.

Numbers follow verl's normalisation, per data-parallel rank: with a global batch of
`b` sequences over `dp` ranks, each rank holds `b/dp`; an update's `mini_batch_size`
(sequences per optimizer step on one rank) must divide it, so the global batch is
divisible by mini-batch x dp; `micro_batch_size` must divide the mini-batch.
GRPO/RLOO groups (N samples of one prompt) must not be split across ranks.
"""

from __future__ import annotations

from flowgraph.check.shapes import DimEnv, ShapeResult, group_size
from flowgraph.check.structure import Resolved, param_value
from flowgraph.diagnostics import Diagnostic, error
from flowgraph.ir import NodeSpec


def _divisors(n: int, limit: int = 1024) -> list[int]:
    """Divisors of `n` for a hint: those up to `limit`, then `n` itself.

    Bounded because `n` comes from the file: `Bp: 1000000000000` must not hang the check.
    """
    small = [d for d in range(1, min(n, limit) + 1) if n % d == 0]
    return small if n <= limit else [*small, n]


def check_batches(table: dict[str, Resolved], shapes: ShapeResult, dp: int,
                  out: list[Diagnostic]) -> None:
    for r in table.values():
        if not isinstance(r.spec, NodeSpec) or r.kind is None:
            continue
        batch = shapes.batch.get(r.name)
        if batch is None:
            continue
        if r.kind.trains:
            _check_update(r, batch, dp, out)
        if r.kind.grouped:
            _check_groups(r, batch, dp, table, shapes.env, out)


def _int_param(r: Resolved, name: str) -> int | None:
    v = param_value(r, name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _check_update(r: Resolved, batch: int, dp: int, out: list[Diagnostic]) -> None:
    mini = _int_param(r, "mini_batch_size")
    micro = _int_param(r, "micro_batch_size")
    p = r.spec.params.find("mini_batch_size")
    pos = p.pos if p is not None else r.pos
    if batch % dp:
        out.append(error("FG301", f"`{r.name}`: the batch of {batch} sequences does not split "
                         f"evenly over {dp} data-parallel ranks", r.pos, node=r.name,
                         expected="batch % dp == 0", actual=f"{batch} % {dp} = {batch % dp}",
                         hint=f"use a data-parallel size among {_divisors(batch)}, or change "
                              "Bp/N"))
        return
    per_rank = batch // dp
    mini = mini or per_rank
    if batch % (mini * dp):
        fits = [d for d in _divisors(per_rank)]
        out.append(error("FG301", f"`{r.name}`: global batch {batch} is not divisible by "
                         f"mini_batch_size {mini} x {dp} data-parallel rank(s) = {mini * dp}",
                         pos, node=r.name, expected=f"{batch} % (mini_batch_size x dp) == 0",
                         actual=f"{batch} % {mini * dp} = {batch % (mini * dp)}",
                         hint=f"with dp={dp} each rank holds {per_rank} sequences; "
                              f"mini_batch_size must divide it: one of {fits}. The last "
                              "mini-batch would otherwise be short and its gradient "
                              "silently scaled differently"))
        return
    if micro is not None and mini % micro:
        q = r.spec.params.find("micro_batch_size")
        out.append(error("FG303", f"`{r.name}`: mini_batch_size {mini} is not divisible by "
                         f"micro_batch_size {micro}", q.pos if q else r.pos, node=r.name,
                         actual=f"{mini} % {micro} = {mini % micro}",
                         hint=f"micro_batch_size must divide {mini}: one of "
                              f"{_divisors(mini)}"))


def _check_groups(r: Resolved, batch: int, dp: int, table: dict[str, Resolved], env: DimEnv,
                  out: list[Diagnostic]) -> None:
    assert isinstance(r.spec, NodeSpec)
    n = group_size(r.spec, table, env)
    if n is None or n < 1:
        return
    if batch % n:
        out.append(error("FG302", f"`{r.name}`: batch {batch} is not a whole number of groups "
                         f"of {n}", r.pos, node=r.name,
                         hint="groups come from `generate` with n samples per prompt; wire "
                              "scores and index from that generate's batch"))
        return
    groups = batch // n
    if groups % dp:
        ok_dp = [d for d in _divisors(groups)]
        out.append(error("FG302", f"`{r.name}` ({r.kind.name if r.kind else '?'}) needs whole "
                         f"groups, but {groups} groups of {n} samples do not split evenly over "
                         f"{dp} data-parallel ranks", r.pos, node=r.name,
                         expected="groups % dp == 0 (Bp % dp == 0)",
                         actual=f"{groups} % {dp} = {groups % dp}",
                         hint=f"a group split across ranks gets a wrong baseline; use Bp "
                              f"divisible by {dp}, or a data-parallel size among {ok_dp}"))
