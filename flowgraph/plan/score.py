"""Which scores a run reports: the rule (`score_plan`) applied to a plan's nodes where the
score is reported (derived, never stored: a plan file cannot say otherwise).

The number on the console is the number trained on: the reported score is what the
plan's advantage node reads, decided once from the wiring, never by looking for the
first node that has `scores` at run time. From the advantage's `scores` input, or back
from its `token_level_rewards` through the token-level chain (`kl_penalty`'s
`token_level_scores`, `token_reward`'s `scores`) to the first per-sequence scores:

    reward -> overlong_penalty -> filter -> grpo     score: filter.scores (the kept,
                                                      penalised scores)
    reward -> token_reward -> kl_penalty -> gae      score: reward.scores (verl's
                                                      critic/score; critic/rewards is
                                                      the KL-penalised token rewards)
    agent_rollout.token_level_rewards -> gae         score: their sum per sequence
    compute_score -> grpo, an agent's tool rewards   score: compute_score's
    unused

A graph without an advantage node (DPO, SFT) reports no score.
"""

from __future__ import annotations

from collections.abc import Iterable

from flowgraph.plan.records import NodePlan, ScorePlan

TOKEN_CHAIN = ("token_level_rewards", "token_level_scores")
"""The token-level inputs followed back to the per-sequence scores they were made from."""


def score_plan(nodes: Iterable[NodePlan]) -> ScorePlan | None:
    """Where the reported score comes from (`ScorePlan`); None without an advantage node,
    or when it reads neither `scores` nor `token_level_rewards`."""
    nodes = tuple(nodes)
    adv = next((n for n in nodes if n.category == "advantage"), None)
    if adv is None:
        return None
    wired = dict(adv.wiring())
    rewards = wired.get("token_level_rewards")
    scores, token = wired.get("scores"), rewards
    by_name = {n.name: n for n in nodes}
    seen: set[tuple[str, str]] = set()
    while scores is None and token is not None and token[0] in by_name and token not in seen:
        seen.add(token)
        producer = dict(by_name[token[0]].wiring())
        scores = producer.get("scores")
        upstream = next((producer[p] for p in TOKEN_CHAIN if p in producer), None)
        if scores is None and upstream is None:
            break  # `token` is made here from no scores: the per-token source itself
        token = upstream
    source = scores or token
    if source is None:
        return None
    mask = wired.get("response_mask")
    return ScorePlan(adv.name, _text(source), _text(_before_filters(source, by_name)),
                     per_token=scores is None, mask=_text(mask) if mask else None,
                     rewards=_text(rewards) if rewards else None)


def _before_filters(ref: tuple[str, str], by_name: dict[str, NodePlan]) -> tuple[str, str]:
    """`ref` one per rollout sample: a filter's `scores` output read through to its input."""
    seen = set()
    while ref[0] in by_name and by_name[ref[0]].category == "filter" and ref not in seen:
        seen.add(ref)
        ref = dict(by_name[ref[0]].wiring()).get("scores", ref)
    return ref


def _text(ref: tuple[str, str]) -> str:
    return f"{ref[0]}.{ref[1]}"
