"""Batch arithmetic: mini-batches and data-parallel ranks divide the batch; groups stay whole.

Numbers follow verl's normalisation: an update's `mini_batch_size` is global (sequences
per optimizer step over all data-parallel ranks, verl's `ppo_mini_batch_size`), so the
same graph steps through the same mini-batches on 1 or dp ranks. It must divide the
global batch `b` and split evenly over the `dp` ranks (each takes mini/dp rows of each
mini-batch); `micro_batch_size` (per rank, verl's `micro_batch_size_per_gpu`) must
divide mini/dp.
GRPO/RLOO groups (N samples of one prompt) must not be split across ranks.

An update runs on the workers that host its model: under target ray with declared
`resources.pools`, those of its pool (`size`), else the `dp` ranks.

`packing: true` on a model whose attention is not varlen is allowed (the numbers are
the padded run's) but warned about: SDPA / eager see one N × N mask over all the
micro-batch's tokens, more work and memory than the padding it saves.
"""

from __future__ import annotations

from typing import NamedTuple

from flowgraph.checker.shapes import DimEnv, ShapeResult, group_size
from flowgraph.checker.structure import Resolved, param_value
from flowgraph.choices import VARLEN_ATTENTION
from flowgraph.diagnostics import Diagnostic, error, warning
from flowgraph.ir import Graph, NodeSpec


def _divisors(n: int, limit: int = 1024) -> list[int]:
    """Divisors of `n` for a hint: those up to `limit`, then `n` itself.

    Bounded because `n` comes from the file: `Bp: 1000000000000` must not hang the check.
    """
    small = [d for d in range(1, min(n, limit) + 1) if n % d == 0]
    return small if n <= limit else [*small, n]


class Ranks(NamedTuple):
    """The data-parallel workers an update runs on, and how a message names them."""

    size: int
    said: str
    """`2 data-parallel ranks`, `the 4 workers of pool `actor``."""
    knob: str
    """What to change: `a data-parallel size`, `a size for pool `actor``."""


def ranks_of(graph: Graph, dp: int, pools: bool) -> tuple[Ranks, dict[str, Ranks]]:
    """(the `dp` ranks, the workers of each model's declared pool when `pools`)."""
    by_model = {m: Ranks(p.size, f"the {p.size} workers of pool `{p.name}`",
                         f"a size for pool `{p.name}`")
                for p in graph.resources.pools if pools and p.size > 0 for m in p.models}
    return Ranks(dp, f"{dp} data-parallel ranks", "a data-parallel size"), by_model


def check_batches(graph: Graph, table: dict[str, Resolved], shapes: ShapeResult, dp: Ranks,
                  pools: dict[str, Ranks], out: list[Diagnostic]) -> None:
    for r in table.values():
        if not isinstance(r.spec, NodeSpec) or r.kind is None:
            continue
        _check_packing(graph, r, out)
        batch = shapes.batch.get(r.name)
        if batch is None:
            continue
        _check_token_budget(r, shapes.env, out)
        if r.kind.trains:
            _check_update(r, batch, pools.get(r.spec.model or "", dp), out)
        if r.kind.grouped:
            _check_groups(r, batch, dp.size, table, shapes.env, out)


def _int_param(r: Resolved, name: str) -> int | None:
    v = param_value(r, name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _check_update(r: Resolved, batch: int, ranks: Ranks, out: list[Diagnostic]) -> None:
    mini = _int_param(r, "mini_batch_size")
    micro = _int_param(r, "micro_batch_size")
    p = r.spec.params.find("mini_batch_size")
    pos = p.pos if p is not None else r.pos
    dp = ranks.size
    if batch % dp:
        out.append(error("FG301", f"`{r.name}`: the batch of {batch} sequences does not split "
                         f"evenly over {ranks.said}", r.pos, node=r.name,
                         expected="batch % dp == 0", actual=f"{batch} % {dp} = {batch % dp}",
                         hint=f"use {ranks.knob} among {_divisors(batch)}, or change Bp/N"))
        return
    mini = mini or batch
    if batch % mini:
        out.append(error("FG301", f"`{r.name}`: global batch {batch} is not divisible by "
                         f"mini_batch_size {mini}", pos, node=r.name,
                         expected=f"{batch} % mini_batch_size == 0",
                         actual=f"{batch} % {mini} = {batch % mini}",
                         hint=f"mini_batch_size must divide {batch}: one of "
                              f"{[d for d in _divisors(batch) if d % dp == 0]}. The last "
                              "mini-batch would otherwise be short and its gradient "
                              "silently scaled differently"))
        return
    if mini % dp:
        out.append(error("FG301", f"`{r.name}`: mini_batch_size {mini} does not split evenly "
                         f"over {ranks.said}", pos, node=r.name,
                         expected="mini_batch_size % dp == 0",
                         actual=f"{mini} % {dp} = {mini % dp}",
                         hint=f"each rank takes mini_batch_size/dp sequences of every "
                              f"mini-batch: use one of "
                              f"{[d for d in _divisors(batch) if d % dp == 0]}, or "
                              f"{ranks.knob} among {_divisors(mini)}"))
        return
    per_rank = mini // dp
    if micro is not None and per_rank % micro:
        q = r.spec.params.find("micro_batch_size")
        out.append(error("FG303", f"`{r.name}`: the {per_rank} sequences of a mini-batch on "
                         f"each rank are not divisible by micro_batch_size {micro}",
                         q.pos if q else r.pos, node=r.name,
                         expected="(mini_batch_size / dp) % micro_batch_size == 0",
                         actual=f"{per_rank} % {micro} = {per_rank % micro}",
                         hint=f"micro_batch_size must divide {per_rank}: one of "
                              f"{_divisors(per_rank)}"))


def _check_token_budget(r: Resolved, env: DimEnv, out: list[Diagnostic]) -> None:
    """`max_token_len` replaces `micro_batch_size` and holds a whole row: P + T tokens
    for each sequence the row puts in the forward."""
    budget = _int_param(r, "max_token_len")
    if budget is None:
        return
    q = r.spec.params.find("max_token_len")
    pos = q.pos if q is not None else r.pos
    micro = _int_param(r, "micro_batch_size")
    if micro is not None:
        out.append(error("FG303", f"`{r.name}`: micro_batch_size {micro} and max_token_len "
                         f"{budget} both cut the micro-batches", pos, node=r.name,
                         hint="set one: rows per micro-batch, or a token budget (verl's "
                              "use_dynamic_bsz); remove the other"))
        return
    P, T = env.values.get("P"), env.values.get("T")
    if P is None or T is None:
        return
    per_row = r.kind.sequences_per_row if r.kind is not None else 1
    need = per_row * (P + T)
    if budget < need:
        rows = f"{per_row} x (P + T)" if per_row > 1 else "P + T"
        out.append(error("FG303", f"`{r.name}`: max_token_len {budget} cannot hold one row "
                         f"of {need} tokens ({rows} = {need})", pos, node=r.name,
                         expected=f"max_token_len >= {need}", actual=str(budget),
                         hint=f"use at least {need}; a micro-batch takes as many rows as "
                              "fit, each padded to the longest prompt and response in it"))


def _check_packing(graph: Graph, r: Resolved, out: list[Diagnostic]) -> None:
    assert isinstance(r.spec, NodeSpec)
    model = graph.model(r.spec.model) if r.spec.model else None
    if param_value(r, "packing") is not True or model is None \
            or model.attn_implementation in VARLEN_ATTENTION:
        return
    q = r.spec.params.find("packing")
    out.append(warning("FG305", f"`{r.name}` packs its sequences, but model `{model.name}` "
                       f"runs {model.attn_implementation} attention: one N x N mask over "
                       f"every token of a micro-batch, more work than the padding it saves",
                       q.pos if q else r.pos, node=r.name,
                       hint=f"packing pays with varlen attention: set models.{model.name}."
                            f"attn_implementation: flash_attention_2 (a GPU), or packing: "
                            f"false (the same numbers)"))


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
