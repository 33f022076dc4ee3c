"""Held-out text metrics against values worked out by hand."""

import math

import pytest

from flowgraph.runtime.evaluation import (
    distinct_n,
    diversity_metrics,
    exact_match_accuracy,
    ngram_entropy,
    ngrams,
    repetition_rate,
)

# Three responses. Unigrams (7): 1 ×3, 2 ×2, 3 ×2. Bigrams (4): (1,2) ×2, (2,1), (3,3);
# the one-token response has none.
CORPUS = [[1, 2, 1, 2], [3, 3], [1]]


def test_ngrams_in_order_and_none_when_too_short() -> None:
    assert ngrams([1, 2, 1, 2], 2) == [(1, 2), (2, 1), (1, 2)]
    assert ngrams([1], 2) == []
    with pytest.raises(ValueError, match="order must be >= 1"):
        ngrams([1], 0)


def test_distinct_n() -> None:
    assert distinct_n(CORPUS, 1) == pytest.approx(3 / 7)  # {1, 2, 3} of 7 unigrams
    assert distinct_n(CORPUS, 2) == pytest.approx(3 / 4)  # {(1,2), (2,1), (3,3)} of 4
    # words work as well as token ids: the, cat, sat, the, cat -> 3 distinct of 5
    assert distinct_n([["the", "cat", "sat"], ["the", "cat"]], 1) == pytest.approx(3 / 5)


def test_ngram_entropy_in_nats() -> None:
    # p = (3/7, 2/7, 2/7): H = 3/7·ln(7/3) + 2·2/7·ln(7/2)
    assert ngram_entropy(CORPUS, 1) == pytest.approx(3 / 7 * math.log(7 / 3)
                                                     + 4 / 7 * math.log(7 / 2))
    # p = (1/2, 1/4, 1/4): H = 1/2·ln 2 + 2·1/4·ln 4 = 1.5·ln 2
    assert ngram_entropy(CORPUS, 2) == pytest.approx(1.5 * math.log(2))
    # one n-gram type: no uncertainty; k equally likely types: ln k
    assert ngram_entropy([[5, 5, 5]], 1) == 0.0
    assert ngram_entropy([[1, 2, 3, 4]], 1) == pytest.approx(math.log(4))


def test_repetition_rate_is_seq_rep_n() -> None:
    # [1,2,1,2]: 3 bigrams, 2 unique -> 1/3; [3,3]: 1 of 1 -> 0; [1]: no bigram, left out
    assert repetition_rate(CORPUS, 2) == pytest.approx((1 / 3 + 0) / 2)
    # unigrams: [1,2,1,2] -> 1 - 2/4, [3,3] -> 1 - 1/2, [1] -> 0
    assert repetition_rate(CORPUS, 1) == pytest.approx((0.5 + 0.5 + 0) / 3)


def test_nothing_generated_scores_zero() -> None:
    assert diversity_metrics([[], []]) == {
        "distinct_1": 0.0, "distinct_2": 0.0, "entropy_1": 0.0, "entropy_2": 0.0,
        "repetition_2": 0.0}


def test_diversity_metrics_names_the_set() -> None:
    got = diversity_metrics(CORPUS)
    assert got["distinct_1"] == pytest.approx(3 / 7)
    assert got["distinct_2"] == pytest.approx(3 / 4)
    assert got["entropy_2"] == pytest.approx(1.5 * math.log(2))
    assert got["repetition_2"] == pytest.approx(1 / 6)


def test_exact_match_accuracy_follows_the_reward_rule() -> None:
    texts = ["#### 7", "I think 12, no: 13", "no number", "$1,234.", "#### 8"]
    truths = ["7", "12", "5", "1234", "3"]
    # hits: `#### 7`; `1,234.` normalised to 1234. Misses: the last number 13 is not 12;
    # no answer at all; 8 is not 3 (partial credit does not count) -> 2 of 5
    assert exact_match_accuracy(texts, truths) == pytest.approx(2 / 5)
    assert exact_match_accuracy([], []) == 0.0
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        exact_match_accuracy(["1", "2"], ["1"])
