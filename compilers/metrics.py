"""Metrics an executor computes from a step's values: verl's batch metrics
(`step_metrics`) and, on held-out data, the log-ratio to the reference and the text
metrics of the responses (`HeldOut`). Which node is which is read from the kind facts
its plan carries (`NodePlan.category`, `head`), never from its name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flowgraph.plan import ExecutionPlan


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    return float((x.float() * m).sum() / m.sum().clamp_min(1.0))


def step_metrics(plan: ExecutionPlan, env: dict[tuple[str, str], Any]) -> dict[str, float]:
    """verl's batch metrics: score, rewards, advantages, returns, values, lengths, tokens."""
    out: dict[str, float] = {}
    for node in plan.nodes:
        mask_ref = dict(node.wiring()).get("response_mask")
        mask = env.get(mask_ref) if mask_ref else None
        if node.category == "rollout" and (node.name, "response_mask") in env:
            resp = env[(node.name, "response_mask")].float()
            out.setdefault("response_length/mean", float(resp.sum(-1).mean()))
            prompt = env[(node.name, "prompt_mask")].float()
            out["perf/tokens"] = out.get("perf/tokens", 0.0) + float(resp.sum() + prompt.sum())
            out["perf/response_tokens"] = out.get("perf/response_tokens", 0.0) + float(resp.sum())
        elif node.category == "reward" and (node.name, "scores") in env:
            out.setdefault("critic/score/mean", float(env[(node.name, "scores")].mean()))
        elif node.category == "filter" and (node.name, "scores") in env:
            # The batch trained on is the filter's (the last try's rollout is one part).
            out["critic/score/mean"] = float(env[(node.name, "scores")].mean())
            kept = env[(node.name, "response_mask")].float()
            out["response_length/mean"] = float(kept.sum(-1).mean())
        elif (node.name, "token_level_rewards") in env and mask is not None:  # kl_penalty
            rewards = env[(node.name, "token_level_rewards")]
            out["critic/rewards/mean"] = float((rewards * mask).sum(-1).mean())
        elif node.category == "advantage" and mask is not None:
            out["critic/advantages/mean"] = _masked_mean(env[(node.name, "advantages")], mask)
            out["critic/returns/mean"] = _masked_mean(env[(node.name, "returns")], mask)
        elif node.head == "scalar" and (node.name, "values") in env and mask is not None:
            out["critic/values/mean"] = _masked_mean(env[(node.name, "values")], mask)
    if "critic/score/mean" in out:
        out.setdefault("critic/rewards/mean", out["critic/score/mean"])
    return out


PHASES = ("generation", "scoring", "update", "data", "orchestration")
"""Where a step's time goes (`phase_s/<phase>`): rollouts; everything that scores them
(log-prob and value forwards, rewards, transforms, advantages); updates; loading the
batch; and the rest of the step, outside any node (the executor's own work)."""
_PHASE_OF_CATEGORY = {"rollout": "generation", "update": "update", "data": "data"}


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
    prompt (the rollout's `val_n`; one when greedy)."""

    tokens: list[list[int]] = field(default_factory=list)
    """Valid tokens of each response of the first `generate` node, special tokens dropped."""
    table: list[dict[str, Any]] = field(default_factory=list)
    """One row per response judged by the first `reward` node with fn `exact_match`:
    prompt, response, ground_truth, score, correct, and `prompt_id` (its prompt's number
    in the held-out set)."""
    prompts: int = 0
    """Held-out prompts counted so far."""

    def add(self, plan: ExecutionPlan, env: dict[tuple[str, str], Any],
            tokenizers: dict[str, Any], skip: int = 0) -> None:
        """The batch's responses, but those of its first `skip` prompts (counted already)."""
        from flowgraph.runtime.evaluation import exact_match

        gen = next((n for n in plan.nodes if n.category == "rollout"), None)
        if gen is None:
            return
        index = [int(i) for i in env[(gen.name, "index")]]
        keep = [r for r, i in enumerate(index) if i >= skip]
        special = set(getattr(tokenizers.get(gen.model or ""), "all_special_ids", ()) or ())
        rows = _valid_rows(env[(gen.name, "responses")], env[(gen.name, "response_mask")])
        self.tokens += [[t for t in rows[r] if t not in special] for r in keep]
        first, self.prompts = self.prompts, self.prompts + max(index, default=-1) + 1 - skip
        for node in plan.nodes:
            wired = dict(node.wiring())
            truth, ids, mask = (wired.get(p) for p in ("ground_truth", "responses",
                                                       "response_mask"))
            if node.category != "reward" or truth is None or ids is None or mask is None \
                    or node.model is None:
                continue
            if node.param_values().get("fn") != "exact_match":
                continue
            tok = tokenizers[node.model]
            texts = [tok.decode(row, skip_special_tokens=True) for row in
                     _valid_rows(env[ids], env[mask])]
            prompts = [tok.decode(row, skip_special_tokens=True) for row in
                       _valid_rows(env[(gen.name, "prompts")], env[(gen.name, "prompt_mask")])]
            truths = [str(g) for g in env[truth]]
            scores = env.get((node.name, "scores"))
            for r in keep:
                self.table.append({
                    "prompt_id": first + index[r] - skip, "prompt": prompts[r],
                    "response": texts[r], "ground_truth": truths[r],
                    "score": None if scores is None else float(scores[r]),
                    "correct": exact_match(texts[r], truths[r])})
            return

    def metrics(self) -> dict[str, float]:
        """`diversity/...`; `accuracy` (exact match, the mean over every response: with
        n > 1 responses a prompt, also `accuracy/mean@n` and `accuracy/pass@n`)."""
        from flowgraph.runtime.evaluation import diversity_metrics, pass_at_n

        out = {}
        if self.tokens:
            out = {f"diversity/{k}": v for k, v in diversity_metrics(self.tokens).items()}
        if self.table:
            correct = [row["correct"] for row in self.table]
            out["accuracy"] = sum(correct) / len(correct)
            n = len(correct) // max(len({row["prompt_id"] for row in self.table}), 1)
            if n > 1:
                out[f"accuracy/mean@{n}"] = out["accuracy"]
                out[f"accuracy/pass@{n}"] = pass_at_n(
                    correct, [row["prompt_id"] for row in self.table])
        return out


def _valid_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's tokens where the mask is set: (B, T) -> B lists."""
    return [row[m].tolist() for row, m in zip(ids, mask.bool(), strict=True)]
