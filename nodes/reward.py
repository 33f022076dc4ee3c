"""Outcome rewards: rule-based scores, a learned reward model, and their token placement.

* `rule_reward` decodes each response and scores it: `exact_match` (GSM8K style, as
  verl's `gsm8k.compute_score`: the number after `####`, else the last number in
  the text), `format` (is the `#### <number>` marker there) or `length_penalty`
  (−c·|len − target|, in tokens).
* `reward_model` reads a scalar from a sequence classifier at the last valid token
  (the reward model of Ouyang et al. 2022).
* `token_reward` puts a sequence score on the last valid response token, the sparse
  reward that PPO's per-token advantage (GAE) consumes.
* `compute_score` calls reward functions as their authors wrote them, chosen by
  signature (`flowgraph.runtime.reward_call`): TRL's, `f(prompts, completions,
  completion_ids, **columns) -> list[float | None]`, once per batch as TRL 1.16's
  GRPOTrainer calls its `reward_funcs` (several, summed with `weights`, its
  `reward_weights`, None skipped); verl's, `compute_score(data_source, solution_str,
  ground_truth, extra_info=None) -> float | dict`, on each decoded response, as verl's
  reward managers. Yours from a plugin (`fn: rewards.py:compute_score`), the Python
  function itself, a built-in (`gsm8k`, `math`: `flowgraph.nodes.scores`), or one per
  data source (`fns`).

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

One module past ~450 lines, on purpose: the four outcome-reward kinds share the
decoding of responses and the placement of a sequence's score on its tokens.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from flowgraph.agent.env import completion
from flowgraph.errors import RewardFnError
from flowgraph.nodes.logprob import forward_hidden, micro_batched, response_span
from flowgraph.nodes.scores import BUILTIN_SCORES
from flowgraph.runtime import NodeContext
from flowgraph.runtime.answers import extract_answer, has_marked_answer, normalise_answer
from flowgraph.runtime.reward_call import (
    TRL_CALL,
    TRL_NOT_COLUMNS,
    VERL_CALL,
    CallStyleError,
    TrainerState,
    call_style,
    function_name,
    keywords_taken,
    load_function,
)

SCORE_CALLS = (TRL_CALL, VERL_CALL)
"""How `compute_score` calls a function (the kind's `calls`, `flowgraph.kinds`)."""

__all__ = ["compute_score", "reward_model", "rule_reward", "token_reward"]


def _texts(tokenizer: object, responses: Tensor, response_mask: Tensor, fn: str) -> list[str]:
    if tokenizer is None:
        raise ValueError(
            f"reward fn `{fn}` decodes the responses: bind a model (its "
            f"tokenizer) to the reward node, or pass tokenizer="
        )
    # up to the last valid token: an agent's response holds the tools' results it read
    mask = response_span(response_mask).bool()
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
FnRef = str | ScoreFn
"""A reward function as a param holds it: a name (`_function`) or the callable itself."""


def _function(ref: FnRef) -> ScoreFn:
    """A scoring function: a callable as it is, a built-in name, `file.py:function` or
    `module:function` (`flowgraph.runtime.reward_call.load_function`)."""
    return load_function(ref, BUILTIN_SCORES, "compute_score")


def _label(ref: FnRef) -> str:
    """How messages name a function: as the graph does, or a callable by its name."""
    return ref if isinstance(ref, str) else function_name(ref)
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


def _route(fns: Mapping[Any, FnRef], source: Any) -> FnRef | None:
    """fns' function for a row's data_source (the value, else its text: a YAML key `7`
    for a source 7); None for a source that is no key (None, a dict)."""
    if source is None or not isinstance(source, Hashable):
        return None
    return fns.get(source, fns.get(str(source)))


def _calls(fn: FnRef | Sequence[FnRef] | None, weights: Sequence[float] | None,
           fns: Mapping[Any, FnRef], data_source: Sequence[Any] | None, b: int
           ) -> list[tuple[FnRef, float, list[int]]]:
    """(function, weight, its rows) of each function the node calls: every function of
    `fn` (one, or a list: TRL's reward_funcs with `weights`, its reward_weights) on the
    rows fns does not route, each function of fns on the rows it routes (weight 1)."""
    listed: list[FnRef] = (list(fn) if isinstance(fn, (list, tuple)) else [] if fn is None
                           else [cast(FnRef, fn)])
    if weights is not None and len(weights) != len(listed):
        raise ValueError(f"compute_score: {len(weights)} weights for {len(listed)} "
                         f"functions in fn; give one weight per function (TRL's "
                         f"reward_weights)")
    routed = [_route(fns, None if data_source is None else data_source[i]) for i in range(b)]
    rest = [i for i in range(b) if routed[i] is None]
    if rest and not listed:
        source = None if data_source is None else data_source[rest[0]]
        raise ValueError(f"compute_score: no function for row {rest[0]} (data_source "
                         f"`{source}`): set fn, or list the source under fns")
    calls = [(f, 1.0 if weights is None else float(weights[k]), rest)
             for k, f in enumerate(listed)]
    for ref in dict.fromkeys(r for r in routed if r is not None):
        calls.append((ref, 1.0, [i for i in range(b) if routed[i] is ref]))
    return [c for c in calls if c[2]]


def compute_score(
    responses: Tensor,
    response_mask: Tensor,
    ground_truth: Sequence[Any] | None = None,
    data_source: Sequence[Any] | None = None,
    extra_info: Sequence[Any] | None = None,
    row: Sequence[Mapping[str, Any]] | None = None,
    messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    *,
    ctx: NodeContext,
    tokenizer: object = None,
    fn: FnRef | Sequence[FnRef] | None = None,
    weights: Sequence[float] | None = None,
    fns: Mapping[Any, FnRef] | None = None,
) -> dict[str, Any]:
    """scores (b,) float32: Σ_k weights_k · R_k over the functions that scored the row
    (TRL's nansum), R_k (b,) the values of function k, called as its signature says
    (`flowgraph.runtime.reward_call`): TRL's batch call, or verl's per row with
    f = fns[data_source] when the map has the row's source, else fn.
    reward_extra_info (b,): each row's extra dict entries (verl) and log_extra columns
    (TRL); score_mask (b,) int64: 0 where every function returned None (score 0).
    Metrics: `rewards/<name>/mean` and `/std` of each function (TRL's nanmean, nanstd
    over the whole batch), `critic/<key>/mean` of numeric extra entries."""
    texts = _texts(tokenizer, responses, response_mask, "compute_score")
    b = len(texts)
    rows: list[dict[str, Any]] = [{} for _ in range(b)]
    columns, names, weighted = [], [], []
    for ref, weight, at in _calls(fn, weights, fns or {}, data_source, b):
        f = _function(ref)
        try:
            style = call_style(f, SCORE_CALLS)
        except CallStyleError as exc:
            raise RewardFnError(f"reward fn `{_label(ref)}`: {exc}") from None
        got: Sequence[float | None]
        if style.per_batch:
            got = _trl_scores(f, _label(ref), at, texts, responses, response_mask, row, ctx,
                              rows, messages)
        else:
            got = _verl_scores(f, _label(ref), at, texts, ground_truth, data_source,
                               extra_info, ctx, rows)
        column = torch.full((b,), math.nan)  # NaN: not this function's row, or None
        column[at] = torch.tensor([math.nan if v is None else v for v in got])
        columns.append(column)
        names.append(function_name(f))
        weighted.append(weight)
    values = torch.stack(columns, 1) if columns else torch.empty(b, 0)
    return _combine(values, torch.tensor(weighted), names, rows, texts, row, ctx)


def _verl_scores(f: ScoreFn, label: str, at: list[int], texts: list[str],
                 ground_truth: Sequence[Any] | None, data_source: Sequence[Any] | None,
                 extra_info: Sequence[Any] | None, ctx: NodeContext,
                 rows: list[dict[str, Any]]) -> list[float]:
    """verl's NaiveRewardManager / default_compute_score: one call per row; a dict
    result's other entries into the row's extras, their numbers `critic/<key>/mean`."""
    scores, extras = [], defaultdict(list)
    for i in at:
        source = None if data_source is None else data_source[i]
        info = None if extra_info is None else extra_info[i]
        where = _where(ctx.row_offset + i, source, info)
        try:
            result = f(data_source=source, solution_str=texts[i],
                       ground_truth=None if ground_truth is None else ground_truth[i],
                       extra_info=info)
        except Exception as exc:
            raise RewardFnError(f"reward fn `{label}` raised on {where}: "
                                f"{type(exc).__name__}: {exc}") from exc
        score, extra = _score(result, f"reward fn `{label}` on {where}")
        scores.append(score)
        rows[i].update(extra)
        for key, value in extra.items():
            number = _numeric(label, key, value)
            if number is not None:
                extras[key].append(number)
    ctx.metrics.update({f"critic/{k}/mean": sum(v) / len(v) for k, v in extras.items()})
    return scores


def _conversational(prompt: Any) -> bool:
    """TRL's `is_conversational`: a prompt that is a list of messages with roles."""
    return (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
            and "role" in prompt[0])


def _trl_scores(f: ScoreFn, label: str, at: list[int], texts: list[str], responses: Tensor,
                response_mask: Tensor, row: Sequence[Mapping[str, Any]] | None,
                ctx: NodeContext, rows: list[dict[str, Any]],
                messages: Sequence[Sequence[Mapping[str, Any]]] | None = None
                ) -> list[float | None]:
    """TRL 1.16 `GRPOTrainer._calculate_rewards`: one call on the batch's rows `at`, with
    prompts, completions (message lists for a conversational prompt), completion_ids,
    every column of the rows but `prompt` (and `completion`, `completion_ids`), and
    trainer_state, log_extra, log_metric; one number or None per completion."""
    when = f"at step {ctx.step}"
    if row is None:
        raise ValueError(f"reward fn `{label}` is called as TRL calls a reward function "
                         "(its signature names completions, prompts or completion_ids), "
                         "with the prompts and the dataset's columns, which reach "
                         "the node through its input `row` (the data's `row`, through "
                         "generate); wire `row: gen.row`")
    picked = [row[i] for i in at]
    prompts = [r["prompt"] for r in picked]
    chat = _conversational(prompts[0])
    columns = {k: [r.get(k) for r in picked] for k in picked[0]
               if k not in TRL_NOT_COLUMNS}
    logged: dict[str, list[float]] = defaultdict(list)

    def log_extra(column: str, values: Sequence[Any]) -> None:
        for i, value in zip(at, values, strict=True):
            rows[i][column] = value

    def log_metric(name: str, value: float) -> None:
        logged[name].append(float(value))

    given: dict[str, object] = {
        "prompts": prompts,
        "completions": [completion(messages[i]) for i in at] if messages is not None else
                       [[{"role": "assistant", "content": texts[i]}] if chat else texts[i]
                        for i in at],
        "completion_ids": [responses[i][response_mask[i].bool()].tolist() for i in at],
        **columns,
        "trainer_state": TrainerState(global_step=ctx.step),
        "log_extra": log_extra,
        "log_metric": log_metric,
    }
    try:
        result = f(**keywords_taken(f, given))
    except Exception as exc:
        raise RewardFnError(f"reward fn `{label}` raised {when} on a batch of {len(at)} "
                            f"completions (rows {ctx.row_offset + at[0]}.."
                            f"{ctx.row_offset + at[-1]}): {type(exc).__name__}: {exc}"
                            ) from exc
    ctx.metrics.update({k: sum(v) / len(v) for k, v in logged.items()})
    return _batch_scores(result, f"reward fn `{label}` {when}", len(at), ctx.row_offset, at)


def _batch_scores(result: Any, who: str, n: int, offset: int, at: list[int]
                  ) -> list[float | None]:
    """A TRL function's list: one number (a bool counts as 1 or 0) or None per
    completion, finite."""
    if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__len__"):
        raise ValueError(f"{who} returned {type(result).__name__} {result!r:.80}; a TRL "
                         f"reward function returns a list with one float (or None) per "
                         f"completion")
    got = list(result)
    if len(got) != n:
        raise ValueError(f"{who} returned {len(got)} values for {n} completions; it returns "
                         "exactly one float (or None) per completion")
    for j, value in enumerate(got):
        if value is None:
            continue
        if not isinstance(value, numbers.Real):
            raise ValueError(f"{who} returned {type(value).__name__} {value!r:.80} for "
                             f"row {offset + at[j]}; each value is a float, or None where "
                             "the function does not apply")
        if not math.isfinite(value):
            raise RewardFnError(f"{who} returned {value!r} for row {offset + at[j]}; a "
                                "score must be a finite number (None: the function does not "
                                "apply to the row)")
    return [None if v is None else float(v) for v in got]


def _nan_stats(ctx: NodeContext, values: Tensor, names: list[str]) -> None:
    """`rewards/<name>/mean` and `/std` of each column of values (b, K) over the whole
    batch, every worker's rows: TRL's nanmean and nanstd (unbiased, NaN below 2 values)."""
    given = ~values.isnan()
    x = values.double().nan_to_num(0.0)
    sums = ctx.workers.sum({f"{k}/n": float(given[:, k].sum()) for k in range(len(names))}
                           | {f"{k}/s": float(x[:, k].sum()) for k in range(len(names))})
    means = {k: sums[f"{k}/s"] / sums[f"{k}/n"] if sums[f"{k}/n"] else math.nan
             for k in range(len(names))}
    squares = ctx.workers.sum({f"{k}": float(((x[:, k] - means[k]) ** 2 * given[:, k]).sum())
                               for k in range(len(names))})
    for k, name in enumerate(names):
        n = sums[f"{k}/n"]
        ctx.metrics[f"rewards/{name}/mean"] = means[k]
        ctx.metrics[f"rewards/{name}/std"] = (math.sqrt(squares[f"{k}"] / (n - 1)) if n > 1
                                              else math.nan)


def _combine(values: Tensor, weights: Tensor, names: list[str], rows: list[dict[str, Any]],
             texts: list[str], row: Sequence[Mapping[str, Any]] | None, ctx: NodeContext
             ) -> dict[str, Any]:
    """TRL's `(rewards_per_func * reward_weights).nansum(dim=1)` and its unscorable rows
    (every function None: said, as TRL warns)."""
    _nan_stats(ctx, values, names)
    unscored = values.isnan().all(1)
    if unscored.any():
        i = int(unscored.nonzero()[0, 0])
        prompt = None if row is None else row[i].get("prompt")
        warnings.warn(
            f"node `{ctx.node}` at step {ctx.step}: every reward function "
            f"({', '.join(names)}) returned None for {int(unscored.sum())} of {len(texts)} "
            f"rows (the first: row {ctx.row_offset + i}, prompt {prompt!r:.80}, completion "
            f"{texts[i]!r:.80}). Their score is 0; wire this node's score_mask into grpo's "
            f"score_mask to leave them out of their group's baseline with advantage 0, as "
            f"TRL does. Make sure at least one function scores every row.", stacklevel=2)
    scores = (values * weights.unsqueeze(0)).nansum(1)
    return {"scores": scores, "reward_extra_info": rows,
            "score_mask": (~unscored).long()}


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

    def forward(rows: Tensor) -> dict[str, Tensor]:
        hidden = forward_hidden(backbone, prompts[rows], prompt_mask[rows], responses[rows],
                                response_mask[rows], on_tokens=True, packing=packing)
        r = head(hidden)  # (b, T, 1)
        if r.shape[-1] != 1:
            raise ValueError(
                f"the reward head returned shape {tuple(r.shape)}; "
                f"a reward model needs num_labels=1"
            )
        last, valid = _last_valid(response_mask[rows])
        return {"scores": r.squeeze(-1).float().gather(-1, last.unsqueeze(-1)).squeeze(-1)
                * valid}

    return micro_batched(forward, prompt_mask, response_mask, micro_batch_size,
                         max_token_len, packing, ctx)


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
