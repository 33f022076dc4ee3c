"""Metrics an executor computes from a step's values: verl's batch metrics
(`step_metrics`) and, on held-out data, the log-ratio to the reference and the text
metrics of the responses (`HeldOut`). Which node is which is read from the kind facts
its plan carries (`NodePlan.category`, `head`), never from its name; the score is the one
the plan says the advantage trains on (`flowgraph.plan.score.score_plan`), never the first node's
that has scores."""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from flowgraph.nodes.logprob import response_span
from flowgraph.plan import ExecutionPlan, NodePlan, ScorePlan
from flowgraph.plan.score import score_plan
from flowgraph.runtime.evaluation import diversity_metrics, exact_match, pass_at_n

STEP_METRICS = (
    ("critic/score/mean", "the scores the advantage node trains on, after every shaping "
     "node, penalty, filter and weighted sum before it (`flowgraph.plan.score`): its `scores` "
     "input, or the scores a `token_reward` puts on the tokens its `token_level_rewards` "
     "come from (verl's score, before the KL penalty), or an agent's token rewards summed "
     "per sequence; none without an advantage node (DPO, SFT). Also the console's `score`, "
     "`val/score/mean` and Prometheus' `flowgraph_reward_mean`"),
    ("critic/rewards/mean", "the advantage's `token_level_rewards` summed per sequence "
     "(after `kl_penalty`); the score when it reads `scores`"),
    ("critic/advantages/mean", "the advantage node's `advantages`, over valid tokens"),
    ("critic/returns/mean", "the advantage node's `returns`, over valid tokens (a kind "
     "that declares none reports none)"),
    ("critic/values/mean", "a node with a scalar head's `values` (`values`), over valid "
     "tokens"),
    ("response_length/mean", "valid response tokens per sequence of the first rollout; "
     "of the filter's kept batch when there is a filter"),
    ("perf/tokens", "prompt and response tokens of every rollout"),
    ("perf/response_tokens", "valid response tokens of every rollout"),
)
"""Each step metric `step_metrics` computes and the node it comes from: the README's
table of them is this one (a test compares)."""


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    return float((x.float() * m).sum() / m.sum().clamp_min(1.0))


def _used_rows(env: dict[tuple[str, str], Any], rollout: str) -> torch.Tensor | slice:
    """The rows of a rollout that hold a sample: an agent rollout with rows_per_episode
    > 1 leaves an episode's unused rows empty (`episode` -1); every row elsewhere."""
    episode = env.get((rollout, "episode"))
    return slice(None) if episode is None else episode >= 0


def step_metrics(plan: ExecutionPlan, env: dict[tuple[str, str], Any]) -> dict[str, float]:
    """verl's batch metrics: score, rewards, advantages, returns, values, lengths, tokens.
    The score is what the advantage trains on (`score_plan`, `flowgraph.plan.score`); an
    output a kind does not declare is not reported (a custom advantage without
    `returns`)."""
    out: dict[str, float] = {}
    for node in plan.nodes:
        mask_ref = dict(node.wiring()).get("response_mask")
        mask = env.get(mask_ref) if mask_ref else None
        if node.category == "rollout" and (node.name, "response_mask") in env:
            used = _used_rows(env, node.name)
            resp = env[(node.name, "response_mask")][used].float()
            out.setdefault("response_length/mean", float(resp.sum(-1).mean()))
            prompt = env[(node.name, "prompt_mask")][used].float()
            out["perf/tokens"] = out.get("perf/tokens", 0.0) + float(resp.sum() + prompt.sum())
            out["perf/response_tokens"] = out.get("perf/response_tokens", 0.0) + float(resp.sum())
        elif node.category == "filter" and (node.name, "response_mask") in env:
            # The batch trained on is the filter's (the last try's rollout is one part).
            kept = env[(node.name, "response_mask")].float()
            out["response_length/mean"] = float(kept.sum(-1).mean())
        elif node.category == "advantage" and mask is not None:
            for port in ("advantages", "returns"):
                if (node.name, port) in env:
                    out[f"critic/{port}/mean"] = _masked_mean(env[(node.name, port)], mask)
        elif node.head == "scalar" and (node.name, "values") in env and mask is not None:
            out["critic/values/mean"] = _masked_mean(env[(node.name, "values")], mask)
    return out | _score_metrics(score_plan(plan.nodes), env)


def _score_metrics(score: ScorePlan | None, env: dict[tuple[str, str], Any]
                   ) -> dict[str, float]:
    """`critic/score/mean` (what the advantage trains on) and `critic/rewards/mean` (its
    token-level rewards summed per sequence; the score when it reads scores)."""
    scores = sequence_scores(score, env) if score is not None else None
    if score is None or scores is None:
        return {}
    out = {"critic/score/mean": float(scores.mean())}
    rewards, mask = _value(env, score.rewards), _value(env, score.mask)
    if rewards is not None and mask is not None:
        out["critic/rewards/mean"] = float((rewards * mask).sum(-1).mean())
    else:
        out["critic/rewards/mean"] = out["critic/score/mean"]
    return out


def sequence_scores(score: ScorePlan, env: dict[tuple[str, str], Any], *,
                    rows: bool = False) -> torch.Tensor | None:
    """The reported score of each sequence (with `rows`: of each rollout sample, before a
    filter); None when the step holds none (a node that did not run)."""
    values: torch.Tensor | None = _value(env, score.rows if rows else score.scores)
    if values is None or not score.per_token:
        return values
    mask = _value(env, score.mask)
    return None if mask is None else (values * mask).sum(-1)


def _value(env: dict[tuple[str, str], Any], ref: str | None) -> Any:
    """The step's value of output `node.port`; None when it holds none."""
    if ref is None:
        return None
    node, _, port = ref.partition(".")
    return env.get((node, port))


PHASES = ("generation", "scoring", "update", "data", "orchestration")
"""Where a step's time goes (`phase_s/<phase>`): rollouts; everything that scores them
(log-prob and value forwards, rewards, transforms, advantages); updates; loading the
batch; and the rest of the step, outside any node (the executor's own work)."""
_PHASE_OF_CATEGORY = {"rollout": "generation", "update": "update", "data": "data"}


def data_positions(cursors: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`data/<source>/epoch` and `data/<source>/position`: where each data source's
    training cursor stands after the batch a step trains on. Every prompt is drawn once,
    so they grow by the prompts a step draws: a resumed run's are the uninterrupted
    run's, and a rollout that `drop` admission dropped skips its prompts."""
    return {f"data/{source}/{key}": float(value) for source, cursor in cursors.items()
            for key, value in cursor.items() if isinstance(value, numbers.Real)}


def phase_seconds(plan: ExecutionPlan, seconds: dict[str, float], wall: float,
                  waited: float = 0.0) -> dict[str, float]:
    """`phase_s/<phase>` from each node's (and data source's) seconds in one step of
    `wall` seconds; they add up to `wall`. `waited`: seconds the step waited for a
    rollout generated elsewhere (asynchronous rollouts), its generation phase."""
    out = dict.fromkeys(PHASES, 0.0)
    out["generation"] = waited
    for name, s in seconds.items():
        kind = plan.node(name)
        out["update" if kind.trains else _PHASE_OF_CATEGORY.get(kind.category, "scoring")] += s
    out["orchestration"] = max(wall - sum(seconds.values()) - waited, 0.0)
    return {f"phase_s/{phase}": s for phase, s in out.items()}


def log_ratio_to_reference(plan: ExecutionPlan, env: dict[tuple[str, str], Any]
                           ) -> dict[str, float]:
    """`log_ratio_to_ref`: the mean over valid response tokens of log π(y_t) − log π_ref(y_t).
    On responses sampled from π this is the k1 estimate of KL(π ‖ π_ref); on the greedy
    held-out responses it is not (it can be negative), hence its name. Read from the first node that
    takes both an actor log-prob (`log_prob` or `old_log_prob`) and `ref_log_prob` (PPO's
    `kl_penalty`, GRPO's actor update); nothing when the graph has no reference."""
    for node in plan.nodes:
        wired = dict(node.wiring())
        ref, mask = wired.get("ref_log_prob"), wired.get("response_mask")
        actor = wired.get("log_prob") or wired.get("old_log_prob")
        if ref is None or mask is None or actor is None:
            continue
        pi, pi_ref = env.get(actor), env.get(ref)
        if pi is not None and pi_ref is not None:
            return {"log_ratio_to_ref": _masked_mean(pi - pi_ref, env[mask])}
    return {}


@dataclass
class HeldOut:
    """Responses to the held-out prompts, gathered over the evaluation batches: n per
    prompt (the rollout's `val_n`; one when greedy), judged by a reward node of any kind
    (`judge`), as verl's validation keeps them."""

    tokens: list[list[int]] = field(default_factory=list)
    """Valid tokens of each response of the first `generate` node, special tokens dropped."""
    table: list[dict[str, Any]] = field(default_factory=list)
    """One row per response: prompt_id (its prompt's number in the held-out set), prompt,
    response, ground_truth, data_source, score (what the advantage trains on:
    `flowgraph.plan.score`), correct (where the reward reports it) and each entry of a
    `compute_score` dict result (`reward_extra_info`)."""
    prompts: int = 0
    """Held-out prompts counted so far."""

    def add(self, plan: ExecutionPlan, env: dict[tuple[str, str], Any],
            tokenizers: dict[str, Any], skip: int = 0) -> None:
        """The batch's responses, but those of its first `skip` prompts (counted already)."""
        gen = next((n for n in plan.nodes if n.category == "rollout"), None)
        if gen is None:
            return
        index = [int(i) for i in env[(gen.name, "index")]]
        keep = [r for r, i in enumerate(index) if i >= skip]
        opens = list(range(len(index)))  # the row holding each row's first prompt
        if (gen.name, "episode") in env:  # an agent's episode is one response: its last
            ids = env[(gen.name, "episode")].tolist()  # row, asked by its first row's prompt
            keep = [r for r in keep
                    if ids[r] >= 0 and (r + 1 == len(ids) or ids[r + 1] != ids[r])]
            for r in range(1, len(ids)):
                if ids[r] == ids[r - 1]:
                    opens[r] = opens[r - 1]
        tok = tokenizers.get(gen.model or "")
        special = set(getattr(tok, "all_special_ids", ()) or ())
        mask = env[(gen.name, "response_mask")]
        rows = _valid_rows(env[(gen.name, "responses")], mask)
        self.tokens += [[t for t in rows[r] if t not in special] for r in keep]
        first, self.prompts = self.prompts, self.prompts + max(index, default=-1) + 1 - skip
        judge = _judge(plan, env)
        if judge is None or tok is None:
            return
        # an agent's response: its tokens up to its last sampled one, tool results too
        texts = [tok.decode(row, skip_special_tokens=True)
                 for row in _valid_rows(env[(gen.name, "responses")], response_span(mask))]
        prompts = [tok.decode(row, skip_special_tokens=True) for row in
                   _valid_rows(env[(gen.name, "prompts")], env[(gen.name, "prompt_mask")])]
        column = partial(_per_sample, env, judge, gen, index)
        truths, sources = column("ground_truth"), column("data_source")
        extras = env.get((judge.name, "reward_extra_info")) or [{}] * len(texts)
        score = score_plan(plan.nodes)
        scores = sequence_scores(score, env, rows=True) if score else None
        exact = judge.param_values().get("fn") == "exact_match"
        for r in keep:
            row = {"prompt_id": first + index[r] - skip, "prompt": prompts[opens[r]],
                   "response": texts[r], "ground_truth": _plain(truths[r]),
                   "data_source": _plain(sources[r]),
                   "score": None if scores is None else float(scores[r])}
            if exact and truths[r] is not None:
                row["correct"] = exact_match(texts[r], str(truths[r]))
            elif isinstance(extras[r].get("acc"), numbers.Real):  # verl's name for it
                row["correct"] = extras[r]["acc"]
            self.table.append({**{k: _plain(v) for k, v in extras[r].items()}, **row})

    def rows(self) -> list[dict[str, Any]]:
        """The table with one set of columns (a row lacking a key has None there)."""
        columns = list(dict.fromkeys(k for row in self.table for k in row))
        return [{c: row.get(c) for c in columns} for row in self.table]

    def metrics(self) -> dict[str, float]:
        """`diversity/...`; `accuracy` (the mean over every response that reports one: with
        n > 1 responses a prompt, also `accuracy/mean@n` and `accuracy/pass@n`); and per
        data source (when the rows come from several) `<source>/score/mean`,
        `<source>/accuracy` and `<source>/<key>/mean` of each numeric entry of the
        reward's dict results; and per env of an agent rollout with several (`env`, from its
        `reward_extra_info`) `agent/<env>/accuracy` and `agent/<env>/score/mean`."""
        out = {}
        if self.tokens:
            out = {f"diversity/{k}": v for k, v in diversity_metrics(self.tokens).items()}
        out.update(_accuracy(self.table))
        sources = {s for row in self.table if (s := _source(row)) is not None}
        for source in sorted(sources) if len(sources) > 1 else ():  # a split
            rows = [row for row in self.table if _source(row) == source]
            out.update({f"{source}/{k}": v for k, v in _means(rows).items()})
            out.update({f"{source}/{k}": v for k, v in _accuracy(rows).items()
                        if k == "accuracy"})
        for env in sorted({e for row in self.table if isinstance(e := row.get("env"), str)}):
            rows = [row for row in self.table if row.get("env") == env]
            out.update({f"agent/{env}/{k}": v for k, v in (_means(rows) | _accuracy(rows)).items()
                        if k in ("score/mean", "accuracy")})
        return out


def _source(row: dict[str, Any]) -> str | None:
    """A row's data source as a metric name part: a name or number, else None."""
    value = row.get("data_source")
    return str(value) if isinstance(value, (str, int, float)) else None


_FIXED = ("prompt_id", "prompt", "response", "ground_truth", "data_source", "correct")


def _means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """`score/mean` and `<key>/mean` of every numeric entry, over the rows that have it."""
    values: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in _FIXED and isinstance(value, numbers.Real):
                values.setdefault(key, []).append(float(value))
    return {f"{k}/mean": sum(v) / len(v) for k, v in values.items()}


def _accuracy(rows: list[dict[str, Any]]) -> dict[str, float]:
    judged = [row for row in rows if row.get("correct") is not None]
    if not judged:
        return {}
    correct = [float(row["correct"]) for row in judged]
    out = {"accuracy": sum(correct) / len(correct)}
    ids = [row["prompt_id"] for row in judged]
    n = len(correct) // max(len(set(ids)), 1)
    if n > 1:
        out[f"accuracy/mean@{n}"] = out["accuracy"]
        out[f"accuracy/pass@{n}"] = pass_at_n([c > 0 for c in correct], ids)
    return out


def _judge(plan: ExecutionPlan, env: dict[tuple[str, str], Any]) -> NodePlan | None:
    """The reward node the validation table shows: the first that reports correctness
    (an `exact_match` rule, a dict result with `acc`), else the first reward node; an
    agent rollout's episode rewards count as one."""
    rewards = [n for n in plan.nodes if n.category == "reward"]
    agents = [n for n in plan.nodes if n.category == "rollout" and (n.name, "scores") in env]
    for node in rewards + agents:  # an agent rollout scores its episodes (`Env.reward`)
        extras = env.get((node.name, "reward_extra_info")) or [{}]
        if node.param_values().get("fn") == "exact_match" or "acc" in extras[0]:
            return node
    return (rewards + agents)[0] if rewards or agents else None


def _per_sample(env: dict[tuple[str, str], Any], judge: NodePlan, gen: NodePlan,
                index: list[int], port: str) -> list[Any]:
    """Each response's value of a per-row column (`ground_truth`, `data_source`): what
    the judge reads, else the rollout's output, else its data source's row; None each
    when there is none."""
    for ref in (dict(judge.wiring()).get(port), (gen.name, port)):
        if ref is not None and ref in env:
            return list(env[ref])
    prompts = dict(gen.wiring()).get("prompts")
    data = env.get((prompts[0], port)) if prompts is not None else None
    return [None] * len(index) if data is None else [data[i] for i in index]


def _plain(value: Any) -> Any:
    """A value as JSON keeps it (numbers, text, lists, dicts), else its repr."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _valid_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's tokens where the mask is set: (B, T) -> B lists."""
    return [row[m].tolist() for row, m in zip(ids, mask.bool(), strict=True)]
