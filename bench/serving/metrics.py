"""Serving metrics from per-request timings: percentiles, throughput, goodput under
an SLO, the report's internal consistency, and its JSON form.

Per request, on the client (`time.perf_counter`):

    TTFT  sending the request -> the first message carrying a token (the OpenAI
          backends: the first SSE chunk carrying text, never a chat role chunk)
    ITL   gaps between consecutive token-carrying messages (pdserve sends one per
          engine step, i.e. one token for n=1; over HTTP, one chunk per step)
    TPOT  (e2e - TTFT) / (tokens - 1)        (undefined for a 1-token request)
    e2e   sending the request -> the end of the stream

Percentiles interpolate linearly between order statistics (numpy's default).
Throughput is over the benchmark's duration: first request sent -> last one done.
Goodput counts the completed requests that met every bound of the SLO (a 1-token
request has no TPOT and meets any TPOT bound), per second of the same duration.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pdserve.bench.common.stats import percentile

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestResult:
    index: int
    error: str  # "" on success
    started: float  # perf_counter when sent
    finished: float  # perf_counter at the end of the stream (or the failure)
    requested_tokens: int  # max_tokens (ignore_eos: the tokens it must produce)
    requested_prompt_tokens: int | None = None  # known for token-id prompts
    prompt_tokens: int = 0  # as the router counted them (usage)
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (usage)
    output_tokens: int = 0
    token_times: tuple[float, ...] = ()  # perf_counter of each token-carrying message
    output_ids: tuple[int, ...] = ()  # the answer (gRPC: as sent; OpenAI: its text tokenized), for multiturn
    server_ttft: float = math.nan
    server_tpot: float = math.nan

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def e2e(self) -> float:
        return self.finished - self.started

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.started if self.token_times else math.nan

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


@dataclass(frozen=True)
class Distribution:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> "Distribution":
        ms = [v * 1e3 for v in values if not math.isnan(v)]
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(sum(ms) / len(ms) if ms else math.nan, p50, p90, p99, len(ms))


@dataclass(frozen=True)
class Slo:
    """Upper bounds in milliseconds (None: no bound)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Slo":
        """'ttft:500,tpot:50' (either part may be left out)."""
        bounds: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition(":")
            if not sep or name not in ("ttft", "tpot"):
                raise ValueError(f"--slo: expected ttft:MS,tpot:MS, got {part!r}")
            try:
                bounds[f"{name}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"--slo: {name} needs milliseconds, got {value!r}") from None
            if not bounds[f"{name}_ms"] > 0:
                raise ValueError(f"--slo: {name} must be > 0, got {value!r}")
        return cls(**bounds)

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and not r.ttft * 1e3 <= self.ttft_ms:
            return False
        return self.tpot_ms is None or r.output_tokens <= 1 or r.tpot * 1e3 <= self.tpot_ms

    def __str__(self) -> str:
        parts = [f"{n}<={v:g}ms" for n, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms)) if v is not None]
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class Summary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    requested_output_tokens: int  # of the completed requests
    request_throughput: float  # completed / s
    output_throughput: float  # tok/s
    total_throughput: float  # (input + output) tok/s
    slo: str
    good: int  # completed requests that met the SLO
    goodput: float  # good / s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    server_ttft: Distribution
    server_tpot: Distribution
    errors: tuple[tuple[str, int], ...]  # reason, count; most frequent first

    def to_dict(self) -> dict:
        d = asdict(self)
        d["errors"] = [{"reason": r, "count": c} for r, c in self.errors]
        return d


def _per_s(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def summarize(start: float, results: Sequence[RequestResult], slo: Slo = Slo()) -> Summary:
    ok = [r for r in results if r.ok]
    end = max((r.finished for r in results), default=start)
    duration = end - start
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    good = sum(slo.met(r) for r in ok)
    return Summary(
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        input_tokens=inputs,
        cached_tokens=sum(r.cached_tokens for r in ok),
        output_tokens=outputs,
        requested_output_tokens=sum(r.requested_tokens for r in ok),
        request_throughput=_per_s(len(ok), duration),
        output_throughput=_per_s(outputs, duration),
        total_throughput=_per_s(inputs + outputs, duration),
        slo=str(slo),
        good=good,
        goodput=_per_s(good, duration),
        ttft=Distribution.of_seconds([r.ttft for r in ok]),
        tpot=Distribution.of_seconds([r.tpot for r in ok]),
        itl=Distribution.of_seconds([gap for r in ok for gap in r.itl]),
        e2e=Distribution.of_seconds([r.e2e for r in ok]),
        server_ttft=Distribution.of_seconds([r.server_ttft for r in ok]),
        server_tpot=Distribution.of_seconds([r.server_tpot for r in ok if r.output_tokens > 1]),
        errors=tuple(Counter(r.error for r in results if not r.ok).most_common()),
    )


def inconsistencies(summary: dict, requests: Sequence[dict]) -> list[str]:
    """What is wrong with a report (its JSON form: `summary` and per-request records);
    empty when it holds together: every request accounted for once, each completed
    request produced exactly the tokens it asked for and (for token-id prompts) the
    router counted the prompt it was sent, totals are the sums, goodput <= throughput,
    percentiles ordered."""
    problems: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    ok = [r for r in requests if not r["error"]]
    indices = sorted(r["index"] for r in requests)
    expect(indices == list(range(summary["num_requests"])), f"request indices {indices[:5]}... != 0..{summary['num_requests'] - 1}")
    expect(summary["completed"] + summary["failed"] == summary["num_requests"], "completed + failed != requests")
    expect(summary["completed"] == len(ok), f"completed={summary['completed']} but {len(ok)} records succeeded")
    for r in ok:
        expect(r["output_tokens"] == r["requested_tokens"],
               f"request {r['index']}: {r['output_tokens']} tokens, asked for {r['requested_tokens']}")
        expect(len(r["token_times"]) >= 1, f"request {r['index']}: no token time")
        if r["requested_prompt_tokens"] is not None:
            expect(r["prompt_tokens"] == r["requested_prompt_tokens"],
                   f"request {r['index']}: router counted {r['prompt_tokens']} prompt tokens, sent "
                   f"{r['requested_prompt_tokens']}")
        expect(0 <= r["cached_tokens"] <= r["prompt_tokens"], f"request {r['index']}: cached > prompt tokens")
    expect(summary["output_tokens"] == sum(r["output_tokens"] for r in ok), "output_tokens != sum over requests")
    expect(summary["output_tokens"] == summary["requested_output_tokens"], "output tokens != requested")
    expect(summary["input_tokens"] == sum(r["prompt_tokens"] for r in ok), "input_tokens != sum over requests")
    expect(summary["good"] <= summary["completed"], "more good requests than completed ones")
    if summary["completed"]:
        expect(summary["goodput"] <= summary["request_throughput"] + 1e-12, "goodput > request throughput")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = summary[name]
        if d["count"]:
            expect(0 <= d["p50"] <= d["p90"] <= d["p99"], f"{name}: percentiles not ordered: {d}")
    if summary["ttft"]["count"]:
        expect(summary["ttft"]["p50"] <= summary["e2e"]["p99"], "ttft p50 > e2e p99")
    return problems


def request_record(r: RequestResult, start: float) -> dict:
    """One request in the JSON report; times in seconds after the benchmark's start."""
    return {
        "index": r.index, "error": r.error, "requested_tokens": r.requested_tokens,
        "requested_prompt_tokens": r.requested_prompt_tokens, "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens,
        "started": r.started - start, "finished": r.finished - start,
        "ttft": _json_float(r.ttft), "tpot": _json_float(r.tpot), "e2e": r.e2e,
        "token_times": [t - start for t in r.token_times],
    }


def _json_float(x: float) -> float | None:
    return None if math.isnan(x) else x


@dataclass(frozen=True)
class Headline:
    """A server's run in the three figures a side-by-side compares (bench.serving.defaults,
    bench.serving.vs_vllm)."""

    throughput: float  # output tokens/s
    ttft_p50_ms: float
    tpot_p50_ms: float

    def line(self) -> str:
        return (f"output {self.throughput:8.1f} tok/s  TTFT p50 {self.ttft_p50_ms:9.1f} ms  "
                f"TPOT p50 {self.tpot_p50_ms:7.1f} ms")
