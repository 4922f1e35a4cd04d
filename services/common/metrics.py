"""Prometheus metrics of every pdserve service, each defined once (`METRICS`).

Names are `pdserve:<name>` (a counter is exposed with `_total`), labelled with
`model_name`, `role` (router | prefill | decode | mixed) and `worker` (the process
that records it: "router" or the worker id), plus the few labels a spec adds.
Each service owns a `CollectorRegistry` (no module state: two services in one
process, as in tests, never share one) and serves it at `/metrics` over HTTP on
`--metrics-port` (0: any free port), bound on `metrics_host(config)`.

What is recorded where (one call per event, at the place it happens):

    router   FrontEnd.generate               request_started / request_ended(code)
             ResponseBuilder                 first_token, tokens, sequence_finished,
                                             request_finished
             FrontEnd.generate / refuse      structured_request(kind), structured_refusal(reason)
             Dispatcher                      prefill_path, local_prefill_fallback, retry, migration,
                                             worker_chosen, structured_refusal (a worker's)
             KvSubscriber (per worker)       kv_event(kind): batch, snapshot, gap
             scrape time                     live workers per pool (the registry)
    worker   EngineLoop._step                step(seconds, batch)
             EngineLoop._finished            request_finished(times): queue, prefill, decode
             EngineLoop._expire              reservation_expired
             KV sender poll                  kv_sent(seconds): final frame -> receiver's ack
             scrape time                     engine.stats() as of the loop's last iteration
                                             (running, waiting, KV usage and fragmentation,
                                             prefix cache, preemptions, speculative
                                             decoding) and the KV connector's counters
             scrape time, with KV tiers      engine.stats().kv_offload per tier (`tier`:
                                             host | disk) and the offload/onload latencies
                                             the tiers kept since the last scrape

Counters that the engine and the connector keep anyway are read when Prometheus
scrapes, so the hot path pays nothing for them. `--no-metrics` replaces the
recorder by one whose every method does nothing (what bench.serving.command compares).
"""

from __future__ import annotations

import logging
import socket
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.outputs import RequestTimes
from pdserve.services.common.convert import ROLES

if TYPE_CHECKING:
    from pdserve.engine.offload.stats import OffloadStats
    from pdserve.engine.offload.tiers import LowerTiers
    from pdserve.engine.spec.speculator import SpecStats
    from pdserve.engine.structured.compiler import StructuredStats
    from pdserve.kvtransfer.stats import KVTransferStats
    from pdserve.services.common.stats import WorkerStats

log = logging.getLogger(__name__)

PREFIX = "pdserve:"
BASE_LABELS = ("model_name", "role", "worker")
ROUTER = "router"  # the router's role and worker label
POOLS = tuple(ROLES)  # a worker pool per role

# LLM latencies, 1 ms to 10 min (after vLLM's TTFT / ITL / e2e buckets, merged into
# one ladder so every latency panel reads alike).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 600.0,
)
BATCH_SEQS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKENS_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Spec:
    kind: str  # counter | gauge | histogram (recorded) ; counter_family | gauge_family (read at scrape)
    doc: str
    labels: tuple[str, ...] = ()  # beyond BASE_LABELS
    buckets: tuple[float, ...] = LATENCY_BUCKETS


METRICS: Mapping[str, Spec] = types.MappingProxyType({
    # -- router: the user's view ---------------------------------------------------------
    "time_to_first_token_seconds": Spec("histogram", "Arrival at the router to the request's first token leaving it"),
    "inter_token_latency_seconds": Spec(
        "histogram", "Gap between a streamed sequence's consecutive tokens (k tokens in one message after a gap g: "
                     "k gaps of g/k)"),
    "request_time_per_output_token_seconds": Spec(
        "histogram", "Per streamed sequence of > 1 token: (last token - first token) / (tokens - 1)"),
    "e2e_request_latency_seconds": Spec("histogram", "Arrival at the router to the request's last message"),
    "prompt_tokens": Spec("counter", "Prompt tokens of requests that produced a first token"),
    "generation_tokens": Spec("counter", "Tokens sent to clients (every sequence of n > 1 and every returned beam)"),
    "request_success": Spec("counter", "Sequences returned, by finish reason", ("finished_reason",)),
    "request_failure": Spec("counter", "Generate calls that ended with an error, by gRPC status", ("code",)),
    "num_requests_inflight": Spec("gauge", "Generate calls in flight at the router"),
    "http_requests": Spec("counter", "HTTP API requests answered, by route and HTTP status", ("route", "status")),
    "router_prefill_path": Spec(
        "counter", "Where a request attempt's prompt was prefilled: remote (a prefill worker), local (its decode "
                   "worker), fallback (meant for a prefill worker, none could: its decode worker)", ("path",)),
    "router_local_prefill_fallbacks": Spec(
        "counter", "Prompts meant for a prefill worker that their decode worker prefilled instead, by reason: "
                   "no_prefill_worker, draining, queue_full, prefill_failed, no_reservation (before the first token); "
                   "kv_transfer (the KV failed after the first token was sent)", ("reason",)),
    "router_retries": Spec("counter", "Attempts moved to another worker after one failed", ("kind",)),
    "request_migrations": Spec(
        "counter", "Requests continued on another decode worker after theirs failed mid-stream, by reason: "
                   "stream_broken (its stream failed), dropped (the registry dropped the worker)", ("reason",)),
    "request_resumptions": Spec(
        "counter", "Streams this router resumed for a client after the router serving them died (the client's "
                   "GenerateRequest.resume)"),
    "router_worker_selected": Spec("counter", "Workers chosen for request attempts", ("target", "target_role")),
    "num_live_workers": Spec("gauge_family", "Workers registered and alive, per pool", ("pool",)),
    "router_kv_events": Spec(
        "counter", "KV event messages from workers applied to the router's view of their caches: batch (a "
                   "delta), snapshot (a full resync: new subscription, restarted or lagging worker), gap (out of "
                   "order: resubscribed)", ("kind",)),
    # structured outputs as clients sent them: each request once (the workers' own
    # structured_outputs_* count what each worker compiles, a P/D request at both)
    "router_structured_outputs_requests": Spec(
        "counter", "Requests whose structured-outputs constraint passed the router's checks, by kind: json_schema, "
                   "json_object, regex, choice, grammar", ("kind",)),
    "router_structured_outputs_refusals": Spec(
        "counter", "Requests whose structured-outputs constraint was refused, by reason: by the router before "
                   "dispatch malformed, conflict (two constraints), too_large, too_deep, invalid_schema (against its "
                   "metaschema); by a worker invalid (its grammar engine refused it), timeout (not compiled within "
                   "--structured-outputs-compile-timeout)", ("reason",)),
    # -- every worker: the engine ----------------------------------------------------------
    "request_queue_time_seconds": Spec("histogram", "Arrival at the worker's engine to first scheduled"),
    "request_prefill_time_seconds": Spec("histogram", "First scheduled to first token sampled (prompt computed here)"),
    "request_decode_time_seconds": Spec("histogram", "First token to finished (decode and mixed workers)"),
    "engine_step_seconds": Spec("histogram", "Duration of one engine step (a decode step on decode workers)"),
    "batch_num_seqs": Spec("histogram", "Sequences in one engine step", buckets=BATCH_SEQS_BUCKETS),
    "batch_num_tokens": Spec("histogram", "Tokens computed in one engine step", buckets=BATCH_TOKENS_BUCKETS),
    "num_requests_running": Spec("gauge_family", "Sequences in the running batch"),
    "num_requests_waiting": Spec("gauge_family", "Sequences waiting to be scheduled (preempted ones included)"),
    "kv_cache_usage_perc": Spec("gauge_family", "Fraction of KV blocks in use (1 = full)"),
    "num_kv_blocks": Spec("gauge_family", "KV cache blocks of this worker"),
    "kv_cache_fragmentation": Spec(
        "gauge_family", "Allocated KV slots holding no token / allocated KV slots (0 when none is allocated; "
                        "blocks shared by a prefix or a fork count once)"),
    "prefix_cache_queries": Spec("counter_family", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": Spec("counter_family", "Prompt tokens found in the prefix cache"),
    "num_preemptions": Spec("counter_family", "Sequences preempted (blocks freed, recomputed later)"),
    # -- speculative decoding (decode and mixed workers with --speculative-config; vLLM's names) --
    "spec_decode_num_drafts": Spec("counter_family", "Verifications that scored at least one draft token"),
    "spec_decode_num_draft_tokens": Spec("counter_family", "Draft tokens scored by the target model"),
    "spec_decode_num_accepted_tokens": Spec(
        "counter_family", "Draft tokens accepted and emitted (a run cut at a stop counts what was emitted)"),
    "spec_decode_num_accepted_tokens_per_pos": Spec(
        "counter_family", "Verifications whose draft at this position (0 .. num_speculative_tokens - 1) was accepted "
                          "and emitted; non-increasing in position, summing to the accepted tokens", ("position",)),
    "spec_decode_num_unspeculated_requests": Spec(
        "counter_family", "Requests decoded without speculation on a speculating worker (beam search)"),
    # -- KV transfer ---------------------------------------------------------------------
    "kv_transfer_seconds": Spec(
        "histogram", "Prefill: final frame sent to the receiver's ack (what the transfer adds after the "
                     "layer-wise pages that overlap the prefill)"),
    "kv_transfer_bytes": Spec("counter_family", "KV page bytes: sent (prefill), received and committed (decode)"),
    "kv_transfers": Spec("counter_family", "Transfers acknowledged (prefill) or committed (decode)"),
    "kv_transfer_failures": Spec("counter_family", "Transfers that failed"),
    "num_requests_held": Spec("gauge_family", "Prefill: finished requests whose blocks wait to be shipped"),
    "num_held_blocks": Spec("gauge_family", "Prefill: KV blocks held for shipping"),
    "num_requests_reserved": Spec("gauge_family", "Decode: reservations waiting for their KV"),
    "reservations_expired": Spec("counter", "Decode: reservations whose KV did not arrive in time"),
    # -- KV tiers below the device pool (workers with --kv-offload-host-bytes / --kv-offload-dir;
    #    vLLM's kv_offload_* names where it has one) ---------------------------------------------
    "kv_offload_tiering_block_hits": Spec(
        "counter_family", "Blocks a prefix lookup missed in the device pool and found in this tier (copied up)",
        ("tier",)),
    "kv_offload_tiering_block_misses": Spec(
        "counter_family", "Blocks a prefix lookup looked for in this tier and did not find", ("tier",)),
    "kv_offload_tiering_write_bytes": Spec("counter_family", "KV bytes written into this tier", ("tier",)),
    "kv_offload_tiering_read_bytes": Spec("counter_family", "KV bytes read from this tier (copied up)", ("tier",)),
    "kv_offload_cache_usage_perc": Spec("gauge_family", "Fraction of this tier's blocks in use (1 = full)", ("tier",)),
    "kv_offload_cache_capacity_bytes": Spec("gauge_family", "This tier's capacity in bytes", ("tier",)),
    "kv_offload_blocks": Spec(
        "counter_family", "Blocks copied between the device pool and the tiers below it: store (down), load (up)",
        ("direction",)),
    "kv_offload_stores_skipped": Spec(
        "counter_family", "Blocks not copied down, by reason: queue_full (dropped, never waited for), cancelled "
                          "(the device block was reused first), expired (past the queue's deadline)", ("reason",)),
    "kv_offload_queue_depth": Spec("gauge_family", "Copies down waiting for the offload worker"),
    "kv_offload_onload_failures": Spec(
        "counter_family", "Copies up that failed or ran past their deadline (the blocks were recomputed)"),
    "kv_offload_corrupt_files": Spec(
        "counter_family", "Disk tier files found truncated, corrupted or replaced (deleted, never served)"),
    "kv_offload_disk_write_errors": Spec(
        "counter_family", "Writes the disk refused (full, read-only): offload to disk stopped, serving goes on"),
    "kv_offload_seconds": Spec("histogram", "A block's copy down: queued to written into the tier below"),
    "kv_onload_seconds": Spec("histogram", "A request's blocks copied up from the tiers below before its first step"),
    # -- structured outputs (engine/structured/: every worker role) -------------------------------
    "structured_outputs_compile_seconds": Spec("histogram", "Compiling one constraint's grammar (off the step)"),
    "structured_outputs_cache_hits": Spec(
        "counter_family", "Constrained requests whose grammar was compiled already (or being compiled)"),
    "structured_outputs_requests": Spec("counter_family", "Constrained requests, by kind: json_schema, json_object, "
                                                          "regex, choice, grammar", ("kind",)),
    "structured_outputs_refusals": Spec(
        "counter_family", "Constrained requests refused, by reason: invalid (the grammar engine refused it), timeout "
                          "(past --structured-outputs-compile-timeout), too_large, too_deep (admission limits)",
        ("reason",)),
    # -- backpressure (router and decode workers) -------------------------------------------
    "stream_write_cutoffs": Spec(
        "counter", "Streams cut off because one message waited longer than --stream-write-timeout to be written "
                   "(the reader stopped reading)"),
})

ROUTER_METRICS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds", "prompt_tokens", "generation_tokens", "request_success", "request_failure",
    "num_requests_inflight", "http_requests", "router_prefill_path", "router_local_prefill_fallbacks", "router_retries",
    "request_migrations", "request_resumptions", "router_worker_selected", "router_kv_events", "stream_write_cutoffs",
    "router_structured_outputs_requests", "router_structured_outputs_refusals",
)
WORKER_METRICS = (
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "engine_step_seconds", "batch_num_seqs", "batch_num_tokens", "kv_transfer_seconds", "reservations_expired",
    "stream_write_cutoffs",
)
# WorkerStats / KVTransferStats field -> metric, read at scrape time
ENGINE_GAUGES = {
    "num_requests_running": "num_requests_running", "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage": "kv_cache_usage_perc", "num_blocks": "num_kv_blocks", "kv_fragmentation": "kv_cache_fragmentation",
    "num_requests_held": "num_requests_held", "num_held_blocks": "num_held_blocks",
    "num_requests_reserved": "num_requests_reserved",
}
ENGINE_COUNTERS = {
    "prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions", "kv_transfer_bytes": "kv_transfer_bytes",
    "kv_transfers": "kv_transfers", "kv_transfer_failures": "kv_transfer_failures",
}
# SpecStats field (WorkerStats.spec_decode) -> metric, read at scrape time; the per-position
# counts (num_accepted_tokens_per_pos) are one series per position.
SPEC_COUNTERS = {
    "num_drafts": "spec_decode_num_drafts", "num_draft_tokens": "spec_decode_num_draft_tokens",
    "num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "num_unspeculated_requests": "spec_decode_num_unspeculated_requests",
}
# TierStats field -> metric (one series per tier, `tier` label), read at scrape time
TIER_FAMILIES = {
    "hits": "kv_offload_tiering_block_hits", "misses": "kv_offload_tiering_block_misses",
    "bytes_written": "kv_offload_tiering_write_bytes", "bytes_read": "kv_offload_tiering_read_bytes",
    "usage": "kv_offload_cache_usage_perc", "capacity_bytes": "kv_offload_cache_capacity_bytes",
}
# OffloadStats field -> (metric, value of its extra label or None), read at scrape time
OFFLOAD_FAMILIES = {
    "offloads": ("kv_offload_blocks", "store"), "onloaded_blocks": ("kv_offload_blocks", "load"),
    "offloads_dropped": ("kv_offload_stores_skipped", "queue_full"),
    "offloads_cancelled": ("kv_offload_stores_skipped", "cancelled"),
    "offloads_expired": ("kv_offload_stores_skipped", "expired"),
    "queue_depth": ("kv_offload_queue_depth", None), "onload_failures": ("kv_offload_onload_failures", None),
    "corrupt_files": ("kv_offload_corrupt_files", None), "disk_write_errors": ("kv_offload_disk_write_errors", None),
}
# StructuredStats field -> (metric, its label), read at scrape time
STRUCTURED_FAMILIES = {"cache_hits": ("structured_outputs_cache_hits", None),
                       "requests": ("structured_outputs_requests", "kind"),
                       "refusals": ("structured_outputs_refusals", "reason")}
REFUSAL_REASONS = ("invalid", "timeout", "too_large", "too_deep")
_FAMILY = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def full_name(name: str) -> str:
    return PREFIX + name


def metrics_host(config: Any) -> str:
    """Where a service binds /metrics: `--metrics-host`, else its internal surface's
    host: the router's Registry host (`--internal-host`, never only the public one),
    a worker's `--host` (a worker has no public surface)."""
    return config.metrics_host or getattr(config, "registry_host", config.host)


class _Recorder:
    """A service's registry with the metrics it records, base labels bound."""

    def __init__(self, names: Iterable[str], model_name: str, role: str, worker: str) -> None:
        self.registry = CollectorRegistry()
        self.base = (model_name, role, worker)
        self._families: dict[str, Any] = {name: self._make(name) for name in names}
        self._server: Any = None

    def _make(self, name: str) -> Any:
        spec = METRICS[name]
        kwargs: dict[str, Any] = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
        return _FAMILY[spec.kind](full_name(name), spec.doc, BASE_LABELS + spec.labels, registry=self.registry, **kwargs)

    def child(self, name: str, *extra: str) -> Any:
        """The metric `name` with the base labels (and `extra` ones) set."""
        return self._families[name].labels(*self.base, *extra)

    def stream_cut_off(self) -> None:
        """A reader stopped reading and its stream was cut off (services/common/write_guard.py)."""
        self.child("stream_write_cutoffs").inc()

    def collect_with(self, collect: Callable[[], Iterator[Metric]]) -> None:
        """Add metrics produced at scrape time by `collect()`."""
        self.registry.register(_Callback(collect))

    def family(self, name: str, value_labels: tuple[str, ...] = ()) -> Metric:
        """An empty scrape-time metric family for the spec `name`."""
        spec = METRICS[name]
        cls = CounterMetricFamily if spec.kind == "counter_family" else GaugeMetricFamily
        return cls(full_name(name), spec.doc, labels=BASE_LABELS + spec.labels)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on host:port (0: any free port); the bound port."""
        self._server = _MetricsServer.on(host, port, self.registry)
        bound = int(self._server.server_port)
        log.info("metrics: http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """/metrics in the text format 0.0.4, whatever the scraper's Accept header asks:
    prometheus-client 0.26's OpenMetrics output turns `pdserve:x` into `pdserve_x`
    (its sample names are escaped as label names), the text format keeps the names."""

    daemon_threads = True

    @classmethod
    def on(cls, host: str, port: int, registry: CollectorRegistry) -> "_MetricsServer":
        server_class = type("_Server", (cls,), {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        server = make_server(host, port, _metrics_app(registry), server_class, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return server


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape is noise
        pass


def _metrics_app(registry: CollectorRegistry) -> Callable[..., list[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"pdserve serves /metrics\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _Callback(Collector):
    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        return self._collect()


class RouterMetrics(_Recorder):
    """The router's metrics: what users see, and how their requests were routed."""

    def __init__(self, model_name: str) -> None:
        super().__init__(ROUTER_METRICS, model_name, ROUTER, ROUTER)
        self._ttft = self.child("time_to_first_token_seconds")
        self._itl = self.child("inter_token_latency_seconds")
        self._tpot = self.child("request_time_per_output_token_seconds")
        self._e2e = self.child("e2e_request_latency_seconds")
        self._prompt = self.child("prompt_tokens")
        self._generated = self.child("generation_tokens")
        self._inflight = self.child("num_requests_inflight")

    def watch_workers(self, roles: Callable[[], Iterable[str]]) -> None:
        """Report live workers per pool at scrape time; `roles()`: one role per worker."""

        def collect() -> Iterator[Metric]:
            family = self.family("num_live_workers")
            live = list(roles())
            for pool in POOLS:
                family.add_metric([*self.base, pool], live.count(pool))
            yield family

        self.collect_with(collect)

    def request_started(self) -> None:
        self._inflight.inc()

    def request_ended(self, failure: str | None) -> None:
        """A Generate call is over: `failure` is its gRPC status name, None if it succeeded."""
        self._inflight.dec()
        if failure is not None:
            self.child("request_failure", failure).inc()

    def http_request(self, route: str, status: int) -> None:
        self.child("http_requests", route, str(status)).inc()

    def first_token(self, ttft: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft)
        self._prompt.inc(prompt_tokens)

    def tokens(self, count: int, previous: float | None, now: float, streamed: bool) -> None:
        """`count` tokens of one sequence reached the client at `now`; its previous ones at
        `previous` (None: these are its first). Beams (`streamed` False) have no ITL."""
        if count <= 0:
            return
        self._generated.inc(count)
        if not streamed:
            return
        if previous is None:  # the first token has no gap; those with it came at once
            gaps, gap = count - 1, 0.0
        else:
            gaps, gap = count, (now - previous) / count
        for _ in range(gaps):
            self._itl.observe(gap)

    def sequence_finished(self, reason: str, tpot: float | None) -> None:
        self.child("request_success", reason).inc()
        if tpot is not None:
            self._tpot.observe(tpot)

    def request_finished(self, e2e: float) -> None:
        self._e2e.observe(e2e)

    def prefill_path(self, path: str) -> None:
        self.child("router_prefill_path", path).inc()

    def local_prefill_fallback(self, reason: str) -> None:
        self.child("router_local_prefill_fallbacks", reason).inc()

    def retry(self, kind: str) -> None:
        self.child("router_retries", kind).inc()

    def migration(self, reason: str) -> None:
        self.child("request_migrations", reason).inc()

    def request_resumed(self) -> None:
        self.child("request_resumptions").inc()

    def worker_chosen(self, worker_id: str, role: str) -> None:
        self.child("router_worker_selected", worker_id, role).inc()

    def kv_event(self, kind: str) -> None:
        self.child("router_kv_events", kind).inc()

    def structured_request(self, kind: str) -> None:
        """A request with a constraint of this kind passed the router's checks."""
        self.child("router_structured_outputs_requests", kind).inc()

    def structured_refusal(self, reason: str) -> None:
        """A constraint was refused: by the router before dispatch, or by a worker."""
        self.child("router_structured_outputs_refusals", reason).inc()


class WorkerMetrics(_Recorder):
    """A worker's metrics: its engine, its queue and its KV transfers."""

    def __init__(self, model_name: str, role: str, worker: str) -> None:
        super().__init__(WORKER_METRICS, model_name, role, worker)
        self.role = role
        self._queue = self.child("request_queue_time_seconds")
        self._prefill = self.child("request_prefill_time_seconds")
        self._decode = self.child("request_decode_time_seconds")
        self._step = self.child("engine_step_seconds")
        self._seqs = self.child("batch_num_seqs")
        self._tokens = self.child("batch_num_tokens")
        self._transfer = self.child("kv_transfer_seconds")
        self._expired = self.child("reservations_expired")

    def watch(self, snapshot: Callable[[], WorkerStats], kv_stats: Callable[[], KVTransferStats],
              tiers: LowerTiers | None = None, compile_times: Callable[[], list[float]] | None = None) -> None:
        """Report the engine's stats (as of the loop's last iteration) and the KV
        connector's counters at scrape time; with KV tiers (`tiers`: the engine's
        `offload`), their counters and the latencies observed since the last scrape;
        `compile_times`: the grammar compiles since the last call (the engine's
        `structured_compile_times`, thread-safe)."""
        offload = _OffloadLatencies(self, tiers) if tiers is not None else None
        compiles = _Drained(self, "structured_outputs_compile_seconds", compile_times) if compile_times else None

        def collect() -> Iterator[Metric]:
            stats = snapshot()
            values = {**vars(stats), **vars(kv_stats())}
            for table in (ENGINE_GAUGES, ENGINE_COUNTERS):
                for field, name in table.items():
                    family = self.family(name)
                    family.add_metric(list(self.base), float(values[field]))
                    yield family
            yield from self._spec_families(stats.spec_decode)
            yield from self._structured_families(stats.structured_outputs)
            if compiles is not None:
                yield from compiles.collect()
            if offload is not None:
                yield from self._offload_families(stats.kv_offload)
                yield from offload.collect()

        self.collect_with(collect)

    def _offload_families(self, stats: OffloadStats) -> Iterator[Metric]:
        families: dict[str, Metric] = {}

        def add(name: str, labels: tuple[str, ...], value: float) -> None:
            if name not in families:
                families[name] = self.family(name)
            families[name].add_metric([*self.base, *labels], value)

        for tier, tier_stats in (("host", stats.host), ("disk", stats.disk)):
            if tier_stats is not None:
                for field, name in TIER_FAMILIES.items():
                    add(name, (tier,), float(getattr(tier_stats, field)))
        for field, (name, label) in OFFLOAD_FAMILIES.items():
            add(name, (label,) if label is not None else (), float(getattr(stats, field)))
        yield from families.values()

    def _structured_families(self, stats: StructuredStats) -> Iterator[Metric]:
        for field, (name, label) in STRUCTURED_FAMILIES.items():
            family = self.family(name)
            value = getattr(stats, field)
            if label is None:
                family.add_metric(list(self.base), float(value))
            else:
                counts = dict(value)
                keys = REFUSAL_REASONS if label == "reason" else sorted(counts)
                for key in keys:  # every reason, zero too: rate() needs the series before the first one
                    family.add_metric([*self.base, key], float(counts.get(key, 0)))
            yield family

    def _spec_families(self, spec: SpecStats) -> Iterator[Metric]:
        for field, name in SPEC_COUNTERS.items():
            family = self.family(name)
            family.add_metric(list(self.base), float(getattr(spec, field)))
            yield family
        per_pos = self.family("spec_decode_num_accepted_tokens_per_pos")
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([*self.base, str(position)], float(count))
        yield per_pos

    def step(self, seconds: float, batch: tuple[int, int]) -> None:
        self._step.observe(seconds)
        self._seqs.observe(batch[0])
        self._tokens.observe(batch[1])

    def request_finished(self, times: RequestTimes | None) -> None:
        """Queue and prefill time of prompts computed here; decode time off the prefill role."""
        if times is None:
            return
        if times.kv_committed is None and times.scheduled is not None:
            self._queue.observe(times.scheduled - times.arrival)
            if times.first_token is not None:
                self._prefill.observe(times.first_token - times.scheduled)
        if self.role != "prefill" and times.first_token is not None:
            self._decode.observe(times.finished - times.first_token)

    def reservation_expired(self) -> None:
        self._expired.inc()

    def kv_sent(self, seconds: Iterable[float]) -> None:
        for s in seconds:
            self._transfer.observe(s)


class _OffloadLatencies:
    """The tiers' latency histograms: the samples the tiers kept since the last scrape
    (`take_latency_samples`, each handed over once) are observed when Prometheus
    scrapes, so neither the engine thread nor the offload worker touches a histogram."""

    def __init__(self, metrics: WorkerMetrics, tiers: LowerTiers) -> None:
        self.tiers = tiers
        spec = METRICS["kv_offload_seconds"]
        self._lock = threading.Lock()  # two scrapes at once must not observe a sample twice or lose one
        self._families = {name: Histogram(full_name(name), METRICS[name].doc, BASE_LABELS, registry=None,
                                          buckets=spec.buckets) for name in ("kv_offload_seconds", "kv_onload_seconds")}
        self._children = [family.labels(*metrics.base) for family in self._families.values()]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            for child, samples in zip(self._children, self.tiers.take_latency_samples()):
                for seconds in samples:
                    child.observe(seconds)
            metrics = [m for family in self._families.values() for m in family.collect()]
        yield from metrics


class _Drained:
    """A histogram of samples handed over at scrape time (`take`: those since its last
    call), so the engine thread never touches it."""

    def __init__(self, metrics: WorkerMetrics, name: str, take: Callable[[], list[float]]) -> None:
        self.take = take
        self._lock = threading.Lock()  # two scrapes at once must not observe a sample twice or lose one
        self._family = Histogram(full_name(name), METRICS[name].doc, BASE_LABELS, registry=None,
                                 buckets=METRICS[name].buckets)
        self._child = self._family.labels(*metrics.base)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            for seconds in self.take():
                self._child.observe(seconds)
            metrics = list(self._family.collect())
        yield from metrics


class Disabled:
    """Metrics off (`--no-metrics`): every recording call does nothing, nothing is served."""

    registry = None

    def serve(self, host: str, port: int) -> int:
        return 0

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _ignore


def _ignore(*_args: object, **_kwargs: object) -> None:
    return None


def router_metrics(enabled: bool, model_name: str) -> RouterMetrics:
    return RouterMetrics(model_name) if enabled else Disabled()  # type: ignore[return-value]


def worker_metrics(enabled: bool, model_name: str, role: str, worker: str) -> WorkerMetrics:
    return WorkerMetrics(model_name, role, worker) if enabled else Disabled()  # type: ignore[return-value]
