"""A model as judge: a model reads each response against a rubric and writes its score
(LLM-as-a-judge, Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot
Arena"; generative reward models, Mahan et al. 2024).

Each row's prompt and response are decoded with the policy's tokenizer (the param
`policy`, a model of the graph), put into the rubric `template` (Python format fields
`{prompt}`, `{response}` and, wired, `{ground_truth}`), and given to the judge as one
user message (through its tokenizer's chat template when it has one). The judge is the
node's model, frozen, decoding greedily so its verdict is the same on every target, or
an OpenAI-compatible server (`url`; `flowgraph.nodes.judge_url`). The score is read
from the reply:

    s = float(m.group(1)),  m the last match of `score_pattern` in the reply

(default `Score: <number>`, case-insensitive), valid when min_score ≤ s ≤ max_score.
Any other reply is invalid and scores `invalid_score`. Metrics, over every worker's
rows: `judge/invalid`, the fraction of invalid replies; `judge/mean`, the mean score.

Notation: b rows, P prompt length, T response length, Pj the judge's prompt length.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowgraph.errors import FlowgraphError
from flowgraph.nodes.data.padding import pad, pad_id
from flowgraph.nodes.generate import SamplingSpec, decode, eval_mode, stop_ids
from flowgraph.nodes.judge_url import JudgeServer, ask_url
from flowgraph.nodes.logprob import response_span
from flowgraph.runtime import NodeContext

__all__ = ["SCORE_PATTERN", "judge", "parse_score"]

SCORE_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
"""The documented reply format: `Score: 7` (or `score=7.5`); the last one counts."""


def parse_score(reply: str, pattern: str, low: float, high: float) -> float | None:
    """The score of a reply (the last match's first group), None when invalid."""
    found = re.findall(pattern, reply)
    if not found:
        return None
    value = float(found[-1] if isinstance(found[-1], str) else found[-1][0])
    return value if low <= value <= high else None


def _texts(tokenizer: Any, ids: Tensor, mask: Tensor) -> list[str]:
    return [tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
            for r, m in zip(ids, mask.bool(), strict=True)]


def _ask_model(model: nn.Module, tokenizer: Any, texts: list[str], max_new_tokens: int,
               ctx: NodeContext) -> list[str]:
    """Greedy replies of the judge model to each text, as one user message."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               tokenize=False, add_generation_prompt=True)
                 for t in texts]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    filler = pad_id(tokenizer)
    prompts, prompt_mask = pad(ids, None, filler, left=True)  # as decode expects: (b, Pj)
    device = next(model.parameters()).device
    spec = SamplingSpec(max_new_tokens, 0.0, 1.0, 0, True, stop_ids(model, tokenizer), filler)
    with eval_mode(model):
        out = decode(model, prompts.to(device), prompt_mask.to(device), [0] * len(ids), spec,
                     ctx.workers)
    return _texts(tokenizer, out["responses"].cpu(), out["response_mask"].cpu())


def judge(
    prompts: Tensor,
    prompt_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    ground_truth: Sequence[Any] | None = None,
    *,
    ctx: NodeContext,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    template: str,
    policy: str = "actor",
    max_new_tokens: int = 32,
    score_pattern: str = SCORE_PATTERN,
    min_score: float = 0.0,
    max_score: float = 10.0,
    invalid_score: float = 0.0,
    url: str | None = None,
    api_model: str | None = None,
    api_key_env: str | None = None,
    concurrency: int = 8,
    retries: int = 3,
    backoff_s: float = 1.0,
    request_timeout_s: float = 60.0,
    cache: bool = True,
) -> dict[str, Tensor]:
    """scores (b,) float32: the judge's score of each row's response, `invalid_score`
    where its reply holds none in [min_score, max_score]."""
    decoder = ctx.tokenizers.get(policy)
    if decoder is None:
        raise FlowgraphError(f"judge node `{ctx.node}`: `policy` names model `{policy}`, "
                             f"which has no tokenizer here; the graph's models: "
                             f"{sorted(ctx.tokenizers)}")
    fields = {"prompt": _texts(decoder, prompts.cpu(), prompt_mask.cpu()),
              "response": _texts(decoder, responses.cpu(), response_span(response_mask).cpu())}
    if ground_truth is not None:
        fields["ground_truth"] = [str(g) for g in ground_truth]
    texts = [template.format(**{k: v[i] for k, v in fields.items()})
             for i in range(len(responses))]
    if url is not None:
        server = JudgeServer(url, api_model, api_key_env, max_new_tokens, concurrency, retries,
                             backoff_s, request_timeout_s)
        replies = ask_url(server, texts, ctx, cache)
    elif model is None or tokenizer is None:
        raise FlowgraphError(f"judge node `{ctx.node}`: bind a judge model (`model:`) or "
                             "set `url` (an OpenAI-compatible server)")
    else:
        replies = _ask_model(model, tokenizer, texts, max_new_tokens, ctx)
    got = [parse_score(r, score_pattern, min_score, max_score) for r in replies]
    scores = torch.tensor([invalid_score if s is None else s for s in got])
    sums = ctx.workers.sum({"n": float(len(got)), "invalid": float(got.count(None)),
                            "score": float(scores.double().sum())})
    if sums["n"]:
        ctx.metrics["judge/invalid"] = sums["invalid"] / sums["n"]
        ctx.metrics["judge/mean"] = sums["score"] / sums["n"]
    return {"scores": scores.to(responses.device)}
