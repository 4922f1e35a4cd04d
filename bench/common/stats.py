"""The statistics every benchmark reports, in one place: percentiles of a sample, its
median, and a median with its range over repetitions.

    percentile([..], 99)        linear interpolation between order statistics (numpy's
                                default), nan for an empty sample
    median([..])                percentile 50 (the middle value, or the mean of the two)
    Ratio.of([r1, r2, r3])      median (min lo, max hi, k=3): per-repetition ratios, nan
                                ones left out of the median and range but counted in k
    Ratio.paired(a, b)          Ratio.of(a_i / b_i): each repetition's systems compared
    ratio_line(name, pairs)     "name: median (min, max, k)" of the pairs' a / b, and the median
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.services.common.quantiles import median, percentile  # re-exported: the benchmarks' names

__all__ = ["Ratio", "median", "percentile", "ratio_line", "safe_div"]


@dataclass(frozen=True)
class Ratio:
    """The median of per-repetition ratios, with their min and max."""

    median: float
    lo: float
    hi: float
    k: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Ratio":
        finite = [v for v in values if not math.isnan(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan, len(values))
        return cls(median(finite), min(finite), max(finite), len(values))

    @classmethod
    def paired(cls, numerators: Sequence[float], denominators: Sequence[float]) -> "Ratio":
        """Ratio.of(n_i / d_i): each repetition's systems against each other."""
        if len(numerators) != len(denominators):
            raise ValueError(f"paired: {len(numerators)} numerators, {len(denominators)} denominators")
        return cls.of([safe_div(n, d) for n, d in zip(numerators, denominators)])

    def __str__(self) -> str:
        return f"{fmt(self.median)} (min {fmt(self.lo)}, max {fmt(self.hi)}, k={self.k})"


def ratio_line(name: str, pairs: Sequence[tuple[float, float]]) -> tuple[str, float]:
    """`name: median (min lo, max hi, k=K)` of the per-repetition ratios a / b, and the median."""
    ratio = Ratio.paired([a for a, _ in pairs], [b for _, b in pairs])
    return f"{name}: {ratio}", ratio.median


def safe_div(n: float, d: float) -> float:
    """n / d, nan when either is nan or d is 0 (a system with nothing to show)."""
    if math.isnan(n) or math.isnan(d) or d == 0:
        return math.nan
    return n / d


def fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.3f}"
