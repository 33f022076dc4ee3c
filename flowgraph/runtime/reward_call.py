"""How a reward function is called: as its author wrote it, for TRL or for verl.

A function is read by its signature. One that takes `completions` (or `prompts`,
`completion_ids`) is called as TRL 1.16's
GRPOTrainer calls its `reward_funcs`: once per batch, with the keywords `prompts`,
`completions`, `completion_ids` and every dataset column of the rows, returning one
float (or None: not applicable to that row) per completion. One that takes
`solution_str` is called as verl's reward managers call `compute_score`: once per row,
with `data_source`, `solution_str`, `ground_truth`, `extra_info`. The checker
(`flowgraph.checker.functions`) and the `compute_score` kind (`flowgraph.nodes.reward`)
both choose with `call_style`; plain Python, no torch.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast


@dataclass(frozen=True, slots=True)
class CallStyle:
    """One way a node calls a function a param names."""

    name: str
    """Whose convention it is: `TRL`, `verl`."""
    markers: tuple[str, ...]
    """Parameters any of which, in the signature, selects this style."""
    keywords: tuple[str, ...]
    """The keywords every call passes (TRL adds the dataset's columns)."""
    signature: str
    """The signature to show in a hint."""
    per_batch: bool
    """Called once per batch (TRL), else once per row (verl)."""
    reads: str = ""
    """The node input this style needs wired (TRL: `row`, the dataset's columns)."""
    positional: bool = False
    """Passes `keywords`' values by position, in order (`filter`'s predicate: any
    parameter name will do), else by keyword."""


TRL_CALL = CallStyle(
    "TRL", ("completions", "prompts", "completion_ids"), ("prompts", "completions",
                                                         "completion_ids"),
    "def f(prompts, completions, completion_ids, **kwargs) -> list[float | None]",
    per_batch=True, reads="row")
"""TRL 1.16 `GRPOTrainer._calculate_rewards`: `reward_func(prompts=, completions=,
completion_ids=, **reward_kwargs)`, the kwargs being the dataset's columns (all but
`prompt`) and `trainer_state`, `log_extra`, `log_metric`."""
VERL_CALL = CallStyle(
    "verl", ("solution_str",), ("data_source", "solution_str", "ground_truth", "extra_info"),
    "def f(data_source, solution_str, ground_truth, extra_info=None) -> float | dict",
    per_batch=False)
"""verl's `NaiveRewardManager`: `compute_score(data_source=, solution_str=,
ground_truth=, extra_info=)` on each decoded response."""
FILTER_CALL = CallStyle(
    "filter", (), ("scores",), "def keep(scores: list[float]) -> bool", per_batch=False,
    positional=True)
"""The `filter` kind's predicate (`flowgraph.nodes.filter`): called once per sample group
with that group's scores, in row order, as one positional list of floats; it returns
whether to keep the group."""
TRL_EXTRAS = ("trainer_state", "log_extra", "log_metric")
"""The keywords TRL passes besides the data (its `environments` needs an environment
factory, which flowgraph's rollouts do not take)."""


TRL_PASSES = TRL_CALL.keywords + TRL_EXTRAS
"""Every keyword TRL's call passes besides the dataset's columns."""
TRL_NOT_COLUMNS = ("prompt", "completion", "completion_ids")
"""Columns of a row TRL never passes as keywords (`_calculate_rewards` drops them)."""


def unmet_parameters(fn: Callable[..., object], columns: Sequence[str]) -> list[str]:
    """The parameters of `fn` that TRL's call leaves without a value on rows holding
    `columns`: those without a default that are neither a keyword TRL passes itself
    (`TRL_PASSES`) nor one of `columns` (the call would raise a TypeError at the first
    batch); none for a function without a readable signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in named and p.default is inspect.Parameter.empty
            and p.name not in TRL_PASSES and p.name not in columns]


class CallStyleError(ValueError):
    """A function whose signature matches no style, or several."""


def function_name(fn: Callable[..., object]) -> str:
    """The name TRL logs a function's rewards under (`rewards/<name>/mean`): its
    `__name__`, or its class's name for a callable object."""
    return str(getattr(fn, "__name__", type(fn).__name__))


def load_function(ref: object, builtins: Mapping[str, Callable[..., object]], kind: str
                  ) -> Callable[..., object]:
    """The function a param names: a callable as it is (a Python function given as
    itself), a built-in name of `builtins`, `file.py:function` (a plugin file, imported
    from the graph's folder by the executor) or `module:function`. Looked up at every
    call, not cached: another graph run in this process may bring its own plugin file.
    ValueError naming `kind` when there is none."""
    if callable(ref):
        return ref
    text = str(ref)
    if ":" not in text:
        if text not in builtins:
            known = ", ".join(builtins) or "none"
            raise ValueError(f"{kind}: no built-in function `{text}`; built-ins: {known}")
        return builtins[text]
    module, _, name = text.partition(":")
    fn = getattr(importlib.import_module(module.removesuffix(".py")), name, None)
    if not callable(fn):
        raise ValueError(f"{kind}: `{module}` has no function `{name}`")
    return cast("Callable[..., object]", fn)


def call_style(fn: Callable[..., object], styles: Sequence[CallStyle]) -> CallStyle:
    """The style one of whose marker parameters `fn` declares. A function without a readable
    signature (a C builtin), or naming no marker but taking `**kwargs`, is called in the
    last style (verl's), as before there were several. CallStyleError when it declares
    none of the markers (and no `**kwargs`) or more than one."""
    if len(styles) == 1 and not styles[0].markers:  # one way to call it (`FILTER_CALL`)
        return styles[0]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return styles[-1]
    found = [s for s in styles if any(m in params for m in s.markers)]
    if len(found) == 1:
        return found[0]
    if not found and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return styles[-1]
    ways = "; ".join(f"{' or '.join(f'`{m}`' for m in s.markers)} ({s.name}: "
                     f"`{s.signature}`, called once per {'batch' if s.per_batch else 'row'})"
                     for s in styles)
    which = "both" if found else "neither"
    names = ", ".join(str(p.replace(annotation=inspect.Parameter.empty))
                      for p in params.values())
    raise CallStyleError(f"`{function_name(fn)}({names})` takes {which} of the parameters "
                         f"that say how to call it: {ways}")


def keywords_taken(fn: Callable[..., object], given: dict[str, object]) -> dict[str, object]:
    """The keywords of `given` that `fn` can take: all with `**kwargs`, else those it
    names (TRL would raise on an unexpected column; a function that names what it
    reads gets it, and the dataset may hold more)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return given
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return given
    return {k: v for k, v in given.items() if k in params}


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What TRL's `trainer_state` keyword gives a reward that shapes by progress."""

    global_step: int
    """Optimizer steps taken before this batch (the run's 0-based step)."""
