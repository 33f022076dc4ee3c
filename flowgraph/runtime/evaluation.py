"""Text metrics of held-out responses: diversity, repetition, exact-match accuracy.

Pure Python over token sequences (any hashable items: token ids, or words); the local
executor's `evaluate` calls them on the greedy responses of the held-out prompts and
writes `val/...` keys. With c(g) the count of n-gram g over all responses and
C = Σ_g c(g):

    distinct-n      = |{g : c(g) > 0}| / C                 (Li et al. 2016, eq. in §4.1)
    entropy-n       = −Σ_g (c(g)/C) · ln(c(g)/C)  in nats  (Zhang et al. 2018, "Ent-n")
    repetition-n    = mean over responses r with ≥ 1 n-gram of
                      1 − |unique n-grams of r| / |n-grams of r|
                      (Welleck et al. 2019, "seq-rep-n")

Responses shorter than n contribute no n-gram; a corpus without any n-gram scores 0
on every measure (nothing was generated, nothing is diverse or repeated).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

from flowgraph.runtime.answers import extract_answer

__all__ = [
    "distinct_n",
    "diversity_metrics",
    "exact_match",
    "exact_match_accuracy",
    "ngram_entropy",
    "ngrams",
    "pass_at_n",
    "repetition_rate",
]


def ngrams(seq: Sequence[Hashable], n: int) -> list[tuple[Hashable, ...]]:
    """The n-grams of one sequence, in order; none when it is shorter than n."""
    if n < 1:
        raise ValueError(f"n-gram order must be >= 1; got {n}")
    return [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]


def _counts(seqs: Sequence[Sequence[Hashable]], n: int) -> Counter[tuple[Hashable, ...]]:
    counts: Counter[tuple[Hashable, ...]] = Counter()
    for seq in seqs:
        counts.update(ngrams(seq, n))
    return counts


def distinct_n(seqs: Sequence[Sequence[Hashable]], n: int) -> float:
    """Distinct n-grams over all n-grams of the corpus, in [0, 1]."""
    counts = _counts(seqs, n)
    total = sum(counts.values())
    return len(counts) / total if total else 0.0


def ngram_entropy(seqs: Sequence[Sequence[Hashable]], n: int) -> float:
    """Shannon entropy (nats) of the corpus's n-gram distribution; ln(#distinct) at most."""
    counts = _counts(seqs, n)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values()) if total else 0.0


def repetition_rate(seqs: Sequence[Sequence[Hashable]], n: int = 2) -> float:
    """Mean share of repeated n-grams within a response (seq-rep-n), in [0, 1)."""
    rates = []
    for seq in seqs:
        grams = ngrams(seq, n)
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return sum(rates) / len(rates) if rates else 0.0


def diversity_metrics(seqs: Sequence[Sequence[Hashable]]) -> dict[str, float]:
    """The `val/diversity/...` set: distinct-1/2, entropy-1/2 (nats), repetition (seq-rep-2)."""
    return {
        "distinct_1": distinct_n(seqs, 1),
        "distinct_2": distinct_n(seqs, 2),
        "entropy_1": ngram_entropy(seqs, 1),
        "entropy_2": ngram_entropy(seqs, 2),
        "repetition_2": repetition_rate(seqs, 2),
    }


def exact_match(text: str, truth: str) -> bool:
    """Whether a response's final answer equals the ground truth, by the reward's
    `exact_match` rule (`flowgraph.runtime.answers.extract_answer`: the number after
    `####`, else the last number; thousands commas, `$` and a final full stop ignored).
    Partial credit (the reward's `format_score`) does not count here."""
    answer, expected = extract_answer(text), extract_answer(str(truth))
    return answer is not None and answer == expected


def exact_match_accuracy(texts: Sequence[str], truths: Sequence[str]) -> float:
    """Share of responses that are an `exact_match` of their ground truth."""
    if len(texts) != len(truths):
        raise ValueError(f"{len(texts)} responses but {len(truths)} ground truths")
    if not texts:
        return 0.0
    return sum(exact_match(t, g) for t, g in zip(texts, truths, strict=True)) / len(texts)


def pass_at_n(correct: Sequence[bool], groups: Sequence[int]) -> float:
    """Share of prompts (`groups`: each response's prompt) with at least one right
    response among their n: pass@n as reported with n samples (not the unbiased
    estimator of Chen et al. 2021 for k < n)."""
    if len(correct) != len(groups):
        raise ValueError(f"{len(correct)} verdicts but {len(groups)} group ids")
    by_prompt: dict[int, bool] = {}
    for ok, g in zip(correct, groups, strict=True):
        by_prompt[g] = by_prompt.get(g, False) or ok
    return sum(by_prompt.values()) / len(by_prompt) if by_prompt else 0.0
