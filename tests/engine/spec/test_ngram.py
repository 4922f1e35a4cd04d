"""The prompt-lookup proposer on hand-made histories: vLLM's longest-suffix, earliest-occurrence rule."""

from __future__ import annotations

import pytest

from pdserve.engine.spec.ngram import propose_ngram


def test_copies_what_followed_the_suffix():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], k=2, min_n=2, max_n=3) == [4, 1]


def test_earliest_occurrence_wins_among_equals():
    # [1, 2] occurs at 0 (then 9) and at 3 (then 8): vLLM copies the earliest.
    assert propose_ngram([1, 2, 9, 1, 2, 8, 1, 2], k=1, min_n=2, max_n=2) == [9]


def test_longest_suffix_wins_over_an_earlier_shorter_one():
    history = [5, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    assert propose_ngram(history, k=3, min_n=2, max_n=3) == [8, 1, 2]
    # With max_n = 2 only [2, 3] is looked up, first seen at 1.
    assert propose_ngram(history, k=3, min_n=2, max_n=2) == [7, 1, 2]


def test_min_n_bounds_the_match():
    history = [1, 2, 3, 9, 3]
    assert propose_ngram(history, k=2, min_n=2, max_n=4) == []
    assert propose_ngram(history, k=2, min_n=1, max_n=4) == [9, 3]


def test_draft_stops_at_the_end_of_history():
    assert propose_ngram([1, 2, 3, 1, 2], k=5, min_n=2, max_n=2) == [3, 1, 2]


def test_occurrence_may_overlap_the_suffix_but_is_never_the_suffix():
    assert propose_ngram([7, 7, 7, 7], k=4, min_n=1, max_n=3) == [7]
    assert propose_ngram([7, 7], k=4, min_n=1, max_n=5) == [7]
    assert propose_ngram([7], k=4, min_n=1, max_n=5) == []


def test_no_match():
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []
    assert propose_ngram([1, 2], k=3, min_n=3, max_n=5) == []


def test_k_zero_proposes_nothing():
    assert propose_ngram([1, 2, 1, 2], k=0, min_n=1, max_n=2) == []


def test_longer_history_than_max_n_matches_only_up_to_max_n():
    # The whole 4-token suffix [1, 2, 3, 4] occurs earlier, but max_n = 2 looks at [3, 4]
    # only, whose earliest occurrence is at 0.
    history = [3, 4, 0, 1, 2, 3, 4, 6, 1, 2, 3, 4]
    assert propose_ngram(history, k=2, min_n=1, max_n=2) == [0, 1]
    assert propose_ngram(history, k=2, min_n=1, max_n=4) == [6, 1]


@pytest.mark.parametrize(("k", "low", "high"), [(1, 0, 2), (1, 3, 2), (-1, 1, 2)])
def test_bad_arguments_raise(k, low, high):
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 3], k=k, min_n=low, max_n=high)


def naive(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule spelled out: longest suffix first, earliest earlier occurrence."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        suffix = history[len(history) - n :]
        for start in range(len(history) - n):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


def test_agrees_with_the_rule_spelled_out_on_random_histories():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        history = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(0, 6)
        assert propose_ngram(history, k, min_n, max_n) == naive(history, k, min_n, max_n), (history, k, min_n, max_n)
