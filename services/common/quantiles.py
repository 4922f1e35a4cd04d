"""Percentiles of a sample, as the benchmarks (bench/common/stats.py) and the planner's
simulator (planner/simulator.py) report them: linear interpolation between order
statistics (numpy's default), nan for an empty sample."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between order statistics."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count); nan when empty."""
    return percentile(values, 50)
