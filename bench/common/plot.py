"""PNG plots of serving runs (matplotlib, headless): CDFs of TTFT and TPOT, and
output tokens per second over time, one line per run so that systems measured in
the same benchmark can be compared at a glance; and speculative decoding's
acceptance by draft position (bench/spec/methods.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: plots know no more of a run than its results
    from pdserve.bench.serving.metrics import RequestResult


@dataclass(frozen=True)
class Run:
    label: str
    start: float  # perf_counter of the run's start
    results: Sequence[RequestResult]


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(v for v in values if not math.isnan(v))
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _tokens_per_second(run: Run, bins: int = 40) -> tuple[list[float], list[float]]:
    times = [t - run.start for r in run.results if r.ok for t in r.token_times]
    if not times:
        return [], []
    width = max(max(times) / bins, 1e-3)
    counts = [0] * (int(max(times) / width) + 1)
    for t in times:
        counts[int(t / width)] += 1
    return [(i + 0.5) * width for i in range(len(counts))], [c / width for c in counts]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'pdserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_runs(runs: Sequence[Run], path: str | Path, title: str = "") -> None:
    """Three panels: TTFT CDF, TPOT CDF, output tokens/s over time."""
    plt = _pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, (ttft, tpot, rate) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        ok = [r for r in run.results if r.ok]
        ttft.plot(*_cdf([r.ttft * 1e3 for r in ok]), label=run.label, drawstyle="steps-post")
        tpot.plot(*_cdf([r.tpot * 1e3 for r in ok]), label=run.label, drawstyle="steps-post")
        rate.plot(*_tokens_per_second(run), label=run.label)
    for ax, xlabel, name in ((ttft, "TTFT (ms)", "TTFT"), (tpot, "TPOT (ms)", "TPOT")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    rate.set_xlabel("time since start (s)")
    rate.set_ylabel("output tokens/s")
    rate.set_title("output throughput over time")
    rate.grid(True, alpha=0.3)
    for ax in (ttft, tpot, rate):
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_acceptance(curves: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> None:
    """One line per label: the fraction of drafts whose token at position i (1-based)
    was accepted, which never increases with i."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, by_pos in curves.items():
        ax.plot(range(1, len(by_pos) + 1), by_pos, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "acceptance by draft position", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
