"""One measured run of a workload against a server, what `pdserve bench` and the
comparison benchmarks (bench.cluster.disagg, bench.cluster.prefix, bench.serving.http)
share: warm-up, open-loop sending, the summary table and the JSON report.

    warm_up(backend, count)                          unmeasured short requests
    measure(backend, requests, concurrency=, ...)    -> Measured (results, summary, load)
        run_load: each request sent at its time on a thread of its own, at most
        `concurrency` in flight; on an interrupt every call in flight is cancelled
    table(summary) / write_json(path, payload)       the report (NaN as null)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.serving.backend import Backend, InFlight
from pdserve.bench.serving.metrics import RequestResult, Slo, Summary, inconsistencies, request_record, summarize
from pdserve.bench.serving.workloads import BenchRequest


WARMUP_TOKENS = 4


def warm_up(backend: Backend, count: int, timeout: float, vocab_size: int) -> None:
    """A few short requests, not measured (first forward passes, connections)."""
    inflight = InFlight()
    for i in range(count):
        prompt = tuple(3 + (7 * j + i) % max(1, vocab_size - 3) for j in range(24))
        result = backend.send(BenchRequest(-1 - i, prompt, WARMUP_TOKENS, 0.0), timeout, inflight)
        if not result.ok:
            print(f"warning: warm-up request failed: {result.error}", file=sys.stderr)


@contextmanager
def progress_bar(total: int, enabled: bool | None, desc: str) -> Iterator[Callable[[Future], None]]:
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="req", disable=None if enabled is None else not enabled,
              file=sys.stderr, dynamic_ncols=True) as bar:
        yield lambda _future: bar.update(1)


def run_load(
    backend: Backend, requests: Sequence[BenchRequest], concurrency: int, timeout: float,
    progress: bool | None = None, desc: str = "requests",
) -> tuple[float, list[RequestResult]]:
    """Send every request at its time, at most `concurrency` in flight (0: no limit);
    returns the start time (perf_counter) and the results in request order. On an
    interrupt every call in flight is cancelled before the exception propagates."""
    inflight = InFlight()
    ordered = sorted(requests, key=lambda r: r.send_at)
    with ThreadPoolExecutor(max_workers=concurrency or len(requests), thread_name_prefix="bench") as pool, \
            progress_bar(len(requests), progress, desc) as tick:
        try:
            start = time.perf_counter()
            futures = []
            for request in ordered:
                delay = start + request.send_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(backend.send, request, timeout, inflight))
                futures[-1].add_done_callback(tick)
            results = sorted((f.result() for f in futures), key=lambda r: r.index)
            return start, results
        except BaseException:
            inflight.close()
            pool.shutdown(wait=False, cancel_futures=True)
            raise


@dataclass(frozen=True)
class Measured:
    """One run of a workload against one router."""

    label: str
    target: str
    start: float
    requests: tuple[BenchRequest, ...]
    results: tuple[RequestResult, ...]
    summary: Summary
    load_avg: tuple[float, float, float] = field(default=(math.nan,) * 3)

    def records(self) -> list[dict]:
        return [request_record(r, self.start) for r in self.results]

    def problems(self) -> list[str]:
        return inconsistencies(self.summary.to_dict(), self.records())

    def to_dict(self) -> dict:
        return {"label": self.label, "target": self.target, "load_avg": list(self.load_avg),
                "summary": self.summary.to_dict(), "requests": self.records()}


def measure(
    backend: Backend, requests: Sequence[BenchRequest], *, concurrency: int, timeout: float, slo: Slo,
    label: str = "", progress: bool | None = None,
) -> Measured:
    load = load_average()
    start, results = run_load(backend, requests, concurrency, timeout, progress, desc=label or "requests")
    return Measured(label, backend.address, start, tuple(requests), tuple(results), summarize(start, results, slo), load)


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (math.nan,) * 3


def table(summary: Summary, title: str = "Serving Benchmark Result") -> str:
    s = summary
    rows = [
        ("Successful requests", s.completed), ("Failed requests", s.failed),
        ("Benchmark duration (s)", f"{s.duration_s:.2f}"),
        ("Total input tokens", s.input_tokens), ("  of them from a prefix cache", s.cached_tokens),
        ("Total generated tokens", s.output_tokens),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_throughput:.2f}"),
        ("SLO for goodput", s.slo),
        ("Goodput (req/s)", f"{s.goodput:.2f}  ({s.good}/{s.completed} met the SLO)"),
    ]
    width = 72
    lines = [f" {title} ".center(width, "=")]
    lines += [f"{name + ':':<44}{value}" for name, value in rows]
    lines.append("-" * width)
    lines.append(f"{'(ms)':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>10}")
    for name, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e),
                    ("TTFT (router)", s.server_ttft), ("TPOT (router)", s.server_tpot)):
        lines.append(f"{name:<20}{d.mean:>10.2f}{d.p50:>10.2f}{d.p90:>10.2f}{d.p99:>10.2f}{d.count:>10}")
    lines.append("=" * width)
    lines += [f"error x{count}: {reason}" for reason, count in s.errors]
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(payload), indent=1) + "\n")


def _finite(x: object) -> object:
    """NaN (an empty distribution) as null: the JSON stays standard."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
