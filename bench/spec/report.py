"""What bench/spec/methods.py measured, summed up: one `Run` per closed loop, one `Cell` per
workload, concurrency and method over the repetitions (ratios to spec-off taken within
each repetition), the table, the last line, and every token that differs from spec-off's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from pdserve.bench.common.stats import Ratio, fmt
from pdserve.engine.spec.speculator import SpecStats

T = TypeVar("T")


@dataclass(frozen=True)
class Run:
    """One method's closed loop over one workload at one concurrency."""

    method: str
    workload: str
    concurrency: int
    rep: int
    wall_s: float
    cpu_s: float
    output_tokens: int
    tpot_s: float  # median over requests
    spec: SpecStats  # this run's drafts and acceptances
    tokens: tuple[tuple[int, ...], ...] = field(repr=False)  # per request, in workload order

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def cpu_throughput(self) -> float:
        return self.output_tokens / self.cpu_s


@dataclass(frozen=True)
class Cell:
    """One method on one workload at one concurrency, over the repetitions."""

    workload: str
    concurrency: int
    method: str
    tpot_ms: Ratio
    throughput: Ratio  # output tokens/s
    tpot_ratio: Ratio  # off / method
    throughput_ratio: Ratio  # method / off
    cpu_throughput_ratio: Ratio  # method / off, output tokens per CPU second
    drafts: int
    acceptance_rate: float  # accepted / draft tokens
    acceptance_length: float  # 1 + accepted / drafts
    acceptance_by_pos: tuple[float, ...]
    tokens_per_step: float  # output tokens / sequence-steps (each emits 1 + its accepted drafts)


def pooled(runs: Sequence[Run]) -> SpecStats:
    per_pos = [sum(col) for col in zip(*(r.spec.num_accepted_tokens_per_pos for r in runs))]
    return SpecStats(sum(r.spec.num_drafts for r in runs), sum(r.spec.num_draft_tokens for r in runs),
                     sum(r.spec.num_accepted_tokens for r in runs), tuple(per_pos))


def acceptance(stats: SpecStats) -> tuple[float, float, tuple[float, ...]]:
    """(rate, mean length, by position); nan without drafts."""
    if stats.num_drafts == 0:
        return math.nan, math.nan, tuple(math.nan for _ in stats.num_accepted_tokens_per_pos)
    return (stats.num_accepted_tokens / stats.num_draft_tokens, 1 + stats.num_accepted_tokens / stats.num_drafts,
            tuple(n / stats.num_drafts for n in stats.num_accepted_tokens_per_pos))


def summarize(runs: Sequence[Run], off: Sequence[Run] | None) -> Cell:
    first = runs[0]
    stats = pooled(runs)
    rate, length, by_pos = acceptance(stats)
    if off is None:
        tpot_ratio = throughput_ratio = cpu_ratio = Ratio.of([])
    else:
        tpot_ratio = Ratio.paired([o.tpot_s for o in off], [r.tpot_s for r in runs])
        throughput_ratio = Ratio.paired([r.throughput for r in runs], [o.throughput for o in off])
        cpu_ratio = Ratio.paired([r.cpu_throughput for r in runs], [o.cpu_throughput for o in off])
    return Cell(first.workload, first.concurrency, first.method, Ratio.of([1e3 * r.tpot_s for r in runs]),
                Ratio.of([r.throughput for r in runs]), tpot_ratio, throughput_ratio, cpu_ratio, stats.num_drafts,
                rate, length, by_pos, tokens_per_step(runs, stats))


def tokens_per_step(runs: Sequence[Run], stats: SpecStats) -> float:
    out = sum(r.output_tokens for r in runs)
    return out / (out - stats.num_accepted_tokens)


def mismatches(run: Run, off: Run, limit: int = 3) -> list[str]:
    """Where `run`'s tokens differ from spec-off's for the same prompts (at most `limit` lines)."""
    problems = []
    for i, (mine, ref) in enumerate(zip(run.tokens, off.tokens)):
        if mine != ref:
            at = next((k for k, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
            problems.append(f"{run.method} {run.workload} c={run.concurrency} repetition {run.rep + 1}: request {i} "
                            f"differs from off at output token {at} ({len(mine)} vs {len(ref)} tokens)")
    return problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])


def span(r: Ratio, digits: int = 3) -> str:
    if math.isnan(r.median):
        return "-"
    return f"{r.median:.{digits}f} [{r.lo:.{digits}f}, {r.hi:.{digits}f}]"


def table(cells: Sequence[Cell]) -> list[str]:
    head = (f"{'workload':<10} {'c':>3} {'method':<11} {'TPOT ms [min, max]':<24} {'tok/s [min, max]':<26} "
            f"{'off/TPOT [min, max]':<23} {'tok/s / off [min, max]':<23} {'cpu: tok/s / off':<23} "
            f"{'acc.rate':>8} {'acc.len':>7} {'tok/step':>8}  by position")
    lines = [head, "-" * len(head)]
    for c in cells:
        pos = " ".join(f"{p:.2f}" for p in c.acceptance_by_pos) if c.drafts else "-"
        lines.append(f"{c.workload:<10} {c.concurrency:>3} {c.method:<11} {span(c.tpot_ms, 2):<24} "
                     f"{span(c.throughput, 1):<26} {span(c.tpot_ratio):<23} {span(c.throughput_ratio):<23} "
                     f"{span(c.cpu_throughput_ratio):<23} "
                     f"{fmt(c.acceptance_rate):>8} {fmt(c.acceptance_length):>7} {c.tokens_per_step:>8.3f}  {pos}")
    return lines


def acceptance_curves(cells: Sequence[Cell], runs: Sequence[Run]) -> dict[str, list[float]]:
    """Acceptance by position per speculating method and workload, over every concurrency."""
    curves = {}
    for workload, method in sorted({(c.workload, c.method) for c in cells if c.method != "off"}):
        _, _, by_pos = acceptance(pooled([r for r in runs if (r.workload, r.method) == (workload, method)]))
        curves[f"{method}, {workload}"] = list(by_pos)
    return curves


def analyse(runs: Sequence[Run]) -> tuple[list[Cell], list[str]]:
    """A cell per workload, concurrency and method, in the order they first ran; every
    difference from spec-off's tokens."""
    cells, problems = [], []
    for workload in _in_order(r.workload for r in runs):
        for concurrency in _in_order(r.concurrency for r in runs):
            def of(method: str) -> list[Run]:
                return [r for r in runs if (r.workload, r.concurrency, r.method) == (workload, concurrency, method)]

            off = of("off") or None
            for method in _in_order(r.method for r in runs if r.rep == 0):
                cells.append(summarize(of(method), off if method != "off" else None))
                if off is not None and method != "off":
                    for mine, ref in zip(of(method), off):
                        problems += mismatches(mine, ref)
    return cells, problems


def acceptance_summary(runs: Sequence[Run]) -> list[str]:
    """Per workload, `acceptance_length <workload>: method=L ...` for every speculating
    method, pooled over its runs (all concurrencies and repetitions)."""
    lines = []
    for workload in _in_order(r.workload for r in runs):
        lengths = []
        for method in _in_order(r.method for r in runs if r.method != "off"):
            _, length, _ = acceptance(pooled([r for r in runs if (r.workload, r.method) == (workload, method)]))
            lengths.append(f"{method}={fmt(length)}")
        if lengths:
            lines.append(f"acceptance_length {workload}: {' '.join(lengths)}")
    return lines


# issue 22's names for the three proposers' figures
_HEAD_LINE_NAMES = {"eagle3": "eagle", "draft_model": "draft", "ngram": "ngram"}


def head_lines(cells: Sequence[Cell], runs: Sequence[Run]) -> list[str]:
    """Per workload where eagle3, draft_model and ngram all ran: `<workload>:
    eagle_acceptance_length=X draft_acceptance_length=Y ngram_acceptance_length=Z` (pooled
    over their runs), then each one's and spec-off's median TPOT at concurrency 1 in ms."""
    lines = []
    for workload in _in_order(r.workload for r in runs):
        methods = {r.method for r in runs if r.workload == workload}
        if not set(_HEAD_LINE_NAMES) <= methods:
            continue
        parts = []
        for method, name in _HEAD_LINE_NAMES.items():
            _, length, _ = acceptance(pooled([r for r in runs if (r.workload, r.method) == (workload, method)]))
            parts.append(f"{name}_acceptance_length={fmt(length)}")
        for method, name in [*_HEAD_LINE_NAMES.items(), ("off", "off")]:
            c1 = next((c for c in cells if (c.workload, c.method, c.concurrency) == (workload, method, 1)), None)
            if c1 is not None:
                parts.append(f"{name}_tpot_c1_ms={c1.tpot_ms.median:.2f}")
        lines.append(f"{workload}: {' '.join(parts)}")
    return lines


def last_line(cells: Sequence[Cell], runs: Sequence[Run]) -> str:
    """`tpot_ratio_c1=X throughput_ratio_c64=Y acceptance_length=Z`: ngram on the grounded
    workload (Y at the highest concurrency run, when 64 was not)."""

    def cell(concurrency: int) -> Cell | None:
        return next((c for c in cells if (c.workload, c.method, c.concurrency) == ("grounded", "ngram", concurrency)),
                    None)

    highest = max(r.concurrency for r in runs)
    low, high = cell(1), cell(highest)
    if highest != 64:
        print(f"note: no concurrency 64 in this run; throughput_ratio_c64 is at concurrency {highest}")
    _, length, _ = acceptance(pooled([r for r in runs if (r.workload, r.method) == ("grounded", "ngram")]))
    x = low.tpot_ratio.median if low else math.nan
    y = high.throughput_ratio.median if high else math.nan
    return f"tpot_ratio_c1={fmt(x)} throughput_ratio_c64={fmt(y)} acceptance_length={fmt(length)}"


def _in_order(values: Iterable[T]) -> list[T]:
    return list(dict.fromkeys(values))
