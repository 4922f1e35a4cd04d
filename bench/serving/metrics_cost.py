"""What recording Prometheus metrics costs per event, metrics on vs off (`--no-metrics`).

    python -m pdserve.bench.serving.metrics_cost

Times (best of 5 repeats, `timeit`) the calls the hot path makes: a streamed token at
the router, an engine step on a worker; and one scrape of each (`/metrics` rendering,
once per scrape interval, off the request path). `Disabled` is what `--no-metrics`
installs. bench.serving.command measures the same end to end (`--no-metrics`).
"""

from __future__ import annotations

import sys
import timeit
from dataclasses import dataclass

from prometheus_client import generate_latest

from pdserve.bench.common.entry import parse
from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.services.common.flags import flag
from pdserve.services.common.metrics import Disabled, RouterMetrics, WorkerMetrics
from pdserve.services.common.stats import WorkerStats

WORKER_STATS = WorkerStats(
    num_blocks=100, num_free_blocks=70, num_cached_blocks=10, kv_cache_usage=0.3, prefix_cache_queries=5,
    prefix_cache_hits=1, num_preemptions=0, num_requests_running=3, num_requests_waiting=0, num_requests_held=0,
    num_held_blocks=0, num_requests_reserved=0,
)
KV_STATS = KVTransferStats(kv_transfer_bytes=1, kv_transfers=1, kv_transfer_failures=0)


def per_call_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


@dataclass(frozen=True)
class MetricsCostFlags:
    number: int = flag(200_000, "calls per repeat")


def main(argv: list[str] | None = None) -> int:
    args = parse(MetricsCostFlags, argv, "python -m pdserve.bench.serving.metrics_cost", __doc__)
    router, worker, off = RouterMetrics("m"), WorkerMetrics("m", "decode", "decode-0"), Disabled()
    router.watch_workers(lambda: ["prefill", "decode"])
    worker.watch(lambda: WORKER_STATS, lambda: KV_STATS)
    rows = [
        ("router: a streamed token", lambda m: lambda: m.tokens(1, 1.0, 1.05, True)),
        ("worker: an engine step", lambda m: lambda: m.step(0.01, (8, 8))),
    ]
    print(f"{'event':<28}{'on (us)':>10}{'off (us)':>10}")
    for name, call in rows:
        on = per_call_us(call(router if name.startswith("router") else worker), args.number)
        print(f"{name:<28}{on:>10.2f}{per_call_us(call(off), args.number):>10.2f}")
    scrapes = max(1, args.number // 100)
    for name, metrics in (("router: one scrape", router), ("worker: one scrape", worker)):
        print(f"{name:<28}{per_call_us(lambda: generate_latest(metrics.registry), scrapes):>10.0f}{'-':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
