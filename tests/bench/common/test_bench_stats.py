"""The benchmarks' one statistics helper (bench/common/stats.py) and their interleaved
repeats (bench/common/repeat.py): percentiles, medians, ratios with their range."""

from __future__ import annotations

import math
import statistics

import pytest

from pdserve.bench.common.repeat import interleaved, rotated
from pdserve.bench.common.stats import Ratio, median, percentile


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert math.isnan(percentile([], 50))


def test_percentile_matches_numpy_linear_at_every_q() -> None:
    values = [7.0, 1.0, 3.0, 10.0, 2.0]  # order does not matter
    # numpy.percentile(values, q) (method "linear"), worked out by hand
    expected = {0: 1.0, 10: 1.4, 25: 2.0, 50: 3.0, 90: 8.8, 99: 9.88, 100: 10.0}
    for q, want in expected.items():
        assert percentile(values, q) == pytest.approx(want), q
    for bad in (-1, 100.5):
        with pytest.raises(ValueError, match="q must be"):
            percentile(values, bad)


def test_median_is_the_middle_value_or_the_mean_of_two() -> None:
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert median(x for x in (5.0, 1.0)) == 3.0  # any iterable
    assert math.isnan(median([]))
    samples = [0.3, 1.7, 0.2, 9.1, 4.4, 4.4]
    assert median(samples) == pytest.approx(statistics.median(samples), rel=1e-12)


def test_ratio_leaves_nan_out_of_the_median_but_counts_it() -> None:
    ratio = Ratio.of([2.0, math.nan, 4.0])
    assert (ratio.median, ratio.lo, ratio.hi, ratio.k) == (3.0, 2.0, 4.0, 3)
    assert math.isnan(Ratio.of([math.nan]).median) and str(Ratio.of([])) == "nan (min nan, max nan, k=0)"
    with pytest.raises(ValueError, match="paired"):
        Ratio.paired([1.0, 2.0], [1.0])


def test_interleaved_alternates_systems_and_ratio_is_the_median() -> None:
    order: list[tuple[str, int]] = []
    runs = interleaved({"a": lambda rep: order.append(("a", rep)) or rep + 1.0,
                        "b": lambda rep: order.append(("b", rep)) or 2.0}, 3)
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    ratio = Ratio.paired(runs["a"], runs["b"])
    assert (ratio.median, ratio.lo, ratio.hi, ratio.k) == (1.0, 0.5, 1.5, 3)
    assert str(ratio) == "1.000 (min 0.500, max 1.500, k=3)"
    assert math.isnan(Ratio.paired([1.0], [0.0]).median)
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"a": lambda rep: rep}, 0)


def test_rotated_starts_each_repetition_one_system_later() -> None:
    assert [rotated("abc", rep) for rep in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert rotated([], 5) == []
