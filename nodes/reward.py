"""Outcome rewards: rule-based scores, a learned reward model, and their token placement.

* `rule_reward` decodes each response and scores it: `exact_match` (GSM8K style, as
  verl's `gsm8k.compute_score`: the number after `####`, else the last number in
  the text), `format` (is the `#### <number>` marker there) or `length_penalty`
  (−c·|len − target|, in tokens).
* `reward_model` reads a scalar from a sequence classifier at the last valid token
  (the reward model of Ouyang et al. 2022).
* `token_reward` puts a sequence score on the last valid response token, the sparse
  reward that PPO's per-token advantage (GAE) consumes.
* `compute_score` calls a function with verl's signature, `compute_score(data_source,
  solution_str, ground_truth, extra_info=None) -> float | dict`, on each decoded response:
  yours from a plugin (`fn: rewards.py:compute_score`), a built-in (`gsm8k`, `math`:
  `flowgraph.nodes.scores`), or one per data source (`fns`), as verl's reward managers.

Your own reward is a plain function whose jaxtyping annotations are its contract.
List its module under `plugins:` in the graph, and `flowgraph check` reads the
contract without running anything:

    from jaxtyping import Float, Int
    from torch import Tensor
    from flowgraph.registry import node_kind

    @node_kind("brevity", outputs=["scores"], category="reward")
    def brevity(responses: Int[Tensor, "b T"], response_mask: Int[Tensor, "b T"],
                scale: float = 0.1) -> Float[Tensor, "b"]:
        return -scale * response_mask.sum(-1).float()

Notation: B sequences, P prompt length, T response length.
"""

from __future__ import annotations

import importlib
import math
import numbers
import warnings
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowgraph.errors import RewardFnError
from flowgraph.nodes.logprob import forward_hidden, micro_batches, sequence_lengths
from flowgraph.nodes.scores import BUILTIN_SCORES
from flowgraph.runtime import NodeContext
from flowgraph.runtime.answers import extract_answer, has_marked_answer, normalise_answer

__all__ = ["compute_score", "reward_model", "rule_reward", "token_reward"]


def _texts(tokenizer: object, responses: Tensor, response_mask: Tensor, fn: str) -> list[str]:
    if tokenizer is None:
        raise ValueError(
            f"reward fn `{fn}` decodes the responses: bind a model (its "
            f"tokenizer) to the reward node, or pass tokenizer="
        )
    mask = response_mask.bool()
    return [
        tokenizer.decode(r[m].tolist(), skip_special_tokens=True)  # type: ignore[attr-defined]
        for r, m in zip(responses, mask, strict=True)
    ]


def rule_reward(
    responses: Tensor,
    response_mask: Tensor,
    ground_truth: Sequence[Any] | None = None,
    *,
    tokenizer: object = None,
    fn: str = "exact_match",
    correct_score: float = 1.0,
    format_score: float = 0.0,
    target_length: int | None = None,
    length_coef: float = 0.01,
) -> dict[str, Tensor]:
    """scores (B,) float32 of one rule.

    exact_match: correct_score if the answer equals ground_truth, format_score if an
    answer was found but is wrong, 0 if none. format: correct_score if the `####`
    marker with a number is present, else 0. length_penalty: −length_coef·|len − target|.
    """
    if fn == "length_penalty":
        if target_length is None:
            raise ValueError("reward fn `length_penalty` needs the param target_length")
        length = response_mask.sum(-1).float()
        return {"scores": -length_coef * (length - target_length).abs()}
    texts = _texts(tokenizer, responses, response_mask, fn)
    if fn == "format":
        scores = [correct_score if has_marked_answer(t) else 0.0 for t in texts]
    elif fn == "exact_match":
        if ground_truth is None or len(ground_truth) != len(texts):
            got = "none" if ground_truth is None else f"{len(ground_truth)} values"
            raise ValueError(
                f"reward fn `exact_match` needs one ground_truth per response "
                f"({len(texts)}); got {got}. Wire the data's ground_truth."
            )
        answers = [extract_answer(t) for t in texts]
        scores = [
            0.0 if a is None else correct_score if a == normalise_answer(str(g)) else format_score
            for a, g in zip(answers, ground_truth, strict=True)
        ]
    else:
        raise ValueError(f"unknown reward fn `{fn}`; known: exact_match, format, length_penalty")
    return {"scores": torch.tensor(scores, dtype=torch.float32)}


ScoreFn = Callable[..., Any]


def _function(ref: str | ScoreFn) -> ScoreFn:
    """A scoring function: the function itself (a graph built in Python), a built-in name,
    `file.py:function` (a plugin file, imported from the graph's folder by the executor)
    or `module:function`. Looked up at every call, not cached: another graph run in this
    process may bring its own `rewards.py`."""
    if callable(ref):
        return ref
    if ":" not in ref:
        if ref not in BUILTIN_SCORES:
            raise ValueError(f"compute_score: no built-in function `{ref}`; built-ins: "
                             f"{', '.join(BUILTIN_SCORES)}")
        return BUILTIN_SCORES[ref]
    module, _, name = ref.partition(":")
    loaded = importlib.import_module(module.removesuffix(".py"))
    fn: ScoreFn | None = getattr(loaded, name, None)
    if not callable(fn):
        raise ValueError(f"compute_score: `{module}` has no function `{name}`")
    return fn


def _where(row: int, source: Any, extra_info: Any) -> str:
    """`row i (data_source s, extra_info index k)`: the row as a user finds it again
    (verl's datasets number their rows in `extra_info.index`)."""
    index = extra_info.get("index") if isinstance(extra_info, dict) else None
    at = "" if index is None else f", extra_info index {index!r}"
    return f"row {row} (data_source `{source}`{at})"


def _score(result: Any, where: str) -> tuple[float, dict[str, Any]]:
    """(score, extra entries) of what a function returned: a number (a bool counts as
    1 or 0, as verl writes it into its reward tensor), or a dict whose `score` is one
    (its other entries are extra info, as verl's reward managers keep them)."""
    extra: dict[str, Any] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"{where} returned a dict without `score`: keys "
                             f"{sorted(result)}")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if not isinstance(result, numbers.Real):
        raise ValueError(f"{where} returned {type(result).__name__} {result!r}; a score is "
                         "a number (or a dict with `score`)")
    if not math.isfinite(result):
        raise RewardFnError(f"{where} returned {result!r}; a score must be a finite number "
                            "(a NaN or infinity would spread through the advantages)")
    return float(result), extra


_WARNED: set[tuple[str, str]] = set()
"""(function, key) pairs whose non-numeric values were reported (once a process)."""


def _numeric(ref: str, key: str, value: Any) -> float | None:
    """An extra entry as a number to average, or None for text and the like (said once:
    it is kept for the validation table, not averaged)."""
    if isinstance(value, numbers.Real):
        return float(value)
    if (ref, key) not in _WARNED:
        _WARNED.add((ref, key))
        warnings.warn(f"reward fn `{ref}` returned `{key}` = {value!r} "
                      f"({type(value).__name__}): not a number, so it has no "
                      f"`critic/{key}/mean`; it is kept in validation/step_<k>.jsonl",
                      stacklevel=3)
    return None


def _route(fns: Mapping[Any, str], source: Any, fn: str | None) -> str | None:
    """fns' function for a row's data_source (the value, else its text: a YAML key `7`
    for a source 7), else fn; a source that is no key (None, a dict) goes to fn."""
    if source is None or not isinstance(source, Hashable):
        return fn
    return fns.get(source, fns.get(str(source), fn))


def compute_score(
    responses: Tensor,
    response_mask: Tensor,
    ground_truth: Sequence[Any] | None = None,
    data_source: Sequence[Any] | None = None,
    extra_info: Sequence[Any] | None = None,
    *,
    ctx: NodeContext,
    tokenizer: object = None,
    fn: str | None = None,
    fns: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """scores (b,) float32: each decoded response scored by verl's signature,
    `f(data_source=, solution_str=, ground_truth=, extra_info=)`, with f = fns[data_source]
    when the map has the row's source, else fn; reward_extra_info (b,): each row's extra
    dict entries. Numeric extra entries are reported as `critic/<key>/mean` over the
    rows that gave them. Values reach f as the dataset holds them (`PromptDataset`)."""
    # verl's NaiveRewardManager / default_compute_score routing, one row at a time.
    texts = _texts(tokenizer, responses, response_mask, "compute_score")
    scores, extras, rows = [], defaultdict(list), []
    for i, text in enumerate(texts):
        source = None if data_source is None else data_source[i]
        info = None if extra_info is None else extra_info[i]
        ref = _route(fns or {}, source, fn)
        where = _where(ctx.row_offset + i, source, info)
        if ref is None:
            raise ValueError(f"compute_score: no function for row {i} (data_source "
                             f"`{source}`): set fn, or list the source under fns")
        try:
            result = _function(ref)(
                data_source=source, solution_str=text,
                ground_truth=None if ground_truth is None else ground_truth[i],
                extra_info=info)
        except Exception as exc:
            raise RewardFnError(f"reward fn `{ref}` raised on {where}: "
                                f"{type(exc).__name__}: {exc}") from exc
        score, extra = _score(result, f"reward fn `{ref}` on {where}")
        scores.append(score)
        rows.append(extra)
        for key, value in extra.items():
            number = _numeric(ref, key, value)
            if number is not None:
                extras[key].append(number)
    ctx.metrics.update({f"critic/{k}/mean": sum(v) / len(v) for k, v in extras.items()})
    return {"scores": torch.tensor(scores, dtype=torch.float32), "reward_extra_info": rows}


def _score_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone, head) of a `ValueModel` or a Hugging Face *ForSequenceClassification."""
    names = ("backbone", "value_head") if hasattr(model, "value_head") else ("base_model", "score")
    backbone, head = (getattr(model, name, None) for name in names)
    if not isinstance(backbone, nn.Module) or not isinstance(head, nn.Module):
        raise TypeError(
            f"reward_model needs a ValueModel or an AutoModelForSequenceClassification "
            f"with a `score` head; got {type(model).__name__}"
        )
    return backbone, head


def reward_model(
    model: nn.Module,
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packing: bool = False,
    ctx: NodeContext | None = None,
) -> dict[str, Tensor]:
    """scores (B,) float32: r(x, y) read at the last valid response token (0 if none)."""
    backbone, head = _score_head(model)
    parts = []
    lengths = sequence_lengths(prompt_mask, response_mask)
    workers = ctx.workers if ctx is not None else None
    for rows in micro_batches(lengths, micro_batch_size, max_token_len, workers=workers,
                              packing=packing):
        hidden = forward_hidden(backbone, prompts[rows], prompt_mask[rows], responses[rows],
                                response_mask[rows], on_tokens=True, packing=packing)
        r = head(hidden)  # (b, T, 1)
        if r.shape[-1] != 1:
            raise ValueError(
                f"the reward head returned shape {tuple(r.shape)}; "
                f"a reward model needs num_labels=1"
            )
        last, valid = _last_valid(response_mask[rows])
        parts.append(r.squeeze(-1).float().gather(-1, last.unsqueeze(-1)).squeeze(-1) * valid)
    return {"scores": torch.cat(parts)}


def _last_valid(response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the last valid token of each row (B,) and whether the row has one (B,)."""
    T = response_mask.shape[-1]
    position = torch.arange(1, T + 1, device=response_mask.device)
    last = (response_mask.bool() * position).argmax(-1)
    return last, response_mask.bool().any(-1)


def token_reward(scores: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """token_level_scores (B, T): scores[i] at row i's last valid token, 0 elsewhere.

    A row without a valid token gets nothing (its score has nowhere to go).
    """
    if scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"token_reward: scores must be (B,) = ({len(response_mask)},) to match "
            f"response_mask {tuple(response_mask.shape)}; got {tuple(scores.shape)}"
        )
    last, valid = _last_valid(response_mask)
    out = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    return {
        "token_level_scores": out.scatter(-1, last.unsqueeze(-1), (scores * valid).unsqueeze(-1))
    }
