"""Metrics without processes: what each recording call counts, the engine's phase
times, /metrics over HTTP, the dashboard and rules against the metric definitions.
(tests/cluster/test_observability.py checks all of it end to end through Prometheus.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.outputs import RequestTimes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.speculator import SpecStats
from pdserve.engine.stats import EngineStats
from pdserve.engine.structured.compiler import StructuredStats
from pdserve.engine.tokenizer import Tokenizer
from pdserve.kvtransfer.stats import KVTransferStats
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.metrics import (
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    LATENCY_BUCKETS,
    METRICS,
    PREFIX,
    SPEC_COUNTERS,
    STRUCTURED_FAMILIES,
    Disabled,
    RouterMetrics,
    WorkerMetrics,
    full_name,
)
from pdserve.services.common.stats import WorkerStats, stats_response
from pdserve.services.router.client import options_from_kwargs
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.pb_records import request_of
from pdserve.services.router.events import update_of
from pdserve.services.router.responses import ResponseBuilder
from pdserve.services.router.validate import Limits, Validator
from pdserve.services.worker.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "pdserve-rules.yaml"
BASE = {"model_name": "m", "role": "router", "worker": "router"}
# What Prometheus 2.x sends: it prefers OpenMetrics.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def sample(metrics, name: str, suffix: str = "", **labels: str) -> float:
    value = metrics.registry.get_sample_value(full_name(name) + suffix, {**metrics_base(metrics), **labels})
    return 0.0 if value is None else value


def metrics_base(metrics) -> dict[str, str]:
    return dict(zip(("model_name", "role", "worker"), metrics.base))


# -- router ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator():
    return Validator(Limits("m", vocab_size=4096, max_model_len=128, max_n=4, block_size=16), Tokenizer(DEFAULT_MODEL))


def job(validator, prompt: list[int], **sampling):
    request = pb.GenerateRequest(sampling=options_from_kwargs(**sampling))
    request.token_ids.ids.extend(prompt)
    return validator.validate(request_of(request))


def delta(index: int, *tokens: int, finish: str = "") -> pb.SequenceDelta:
    return pb.SequenceDelta(index=index, token_ids=list(tokens), finish_reason=finish)


def test_router_counts_tokens_gaps_and_finishes_once(validator, monkeypatch):
    """Two sequences (n=2): 1 + 3 tokens and 2 + 1 tokens over three messages."""
    metrics = RouterMetrics("m")
    builder = ResponseBuilder(job(validator, [5] * 20, n=2, max_tokens=4), None, arrival=100.0, metrics=metrics)
    clock = iter([100.5, 101.1, 101.4])
    monkeypatch.setattr("pdserve.services.router.responses.time.monotonic", lambda: next(clock))
    builder.messages(update_of(pb.DecodeResponse(deltas=[delta(0, 1), delta(1, 2, 3)])))  # t=100.5: firsts
    builder.messages(update_of(pb.DecodeResponse(deltas=[delta(0, 4, 5, 6, finish="length")])))  # t=101.1: a gap of 0.6 for 3
    final = pb.DecodeResponse(deltas=[delta(1, 7, finish="stop")], finished=True)
    final.results.add(index=0, finish_reason="length")
    final.results.add(index=1, finish_reason="stop")
    builder.messages(update_of(final))  # t=101.4
    assert sample(metrics, "time_to_first_token_seconds", "_count") == 1
    assert sample(metrics, "time_to_first_token_seconds", "_sum") == pytest.approx(0.5)
    assert sample(metrics, "prompt_tokens", "_total") == 20
    assert sample(metrics, "generation_tokens", "_total") == 7
    # ITL: seq 0: 3 gaps of 0.2; seq 1: 1 gap of 0 (tokens 2 and 3 came together), 1 of 0.9
    assert sample(metrics, "inter_token_latency_seconds", "_count") == 5
    assert sample(metrics, "inter_token_latency_seconds", "_sum") == pytest.approx(0.6 + 0.9)
    assert sample(metrics, "request_time_per_output_token_seconds", "_count") == 2
    assert sample(metrics, "request_time_per_output_token_seconds", "_sum") == pytest.approx(0.6 / 3 + 0.9 / 2)
    assert sample(metrics, "request_success", "_total", finished_reason="length") == 1
    assert sample(metrics, "request_success", "_total", finished_reason="stop") == 1
    assert sample(metrics, "e2e_request_latency_seconds", "_count") == 1
    assert sample(metrics, "e2e_request_latency_seconds", "_sum") == pytest.approx(1.4)


def test_beams_count_tokens_but_no_gaps(validator):
    metrics = RouterMetrics("m")
    builder = ResponseBuilder(job(validator, [5] * 4, beam_width=2, n=2), None, arrival=0.0, metrics=metrics)
    final = pb.DecodeResponse(finished=True)
    final.results.add(index=0, token_ids=[300, 301, 302], finish_reason="length")
    final.results.add(index=1, token_ids=[303], finish_reason="stop")
    builder.messages(update_of(final))
    assert sample(metrics, "generation_tokens", "_total") == 4
    assert sample(metrics, "time_to_first_token_seconds", "_count") == 1
    assert sample(metrics, "inter_token_latency_seconds", "_count") == 0
    assert sample(metrics, "request_time_per_output_token_seconds", "_count") == 0


def test_router_failures_in_flight_and_workers():
    metrics = RouterMetrics("m")
    metrics.watch_workers(lambda: ["decode", "prefill", "decode"])
    metrics.request_started()
    metrics.request_started()
    assert sample(metrics, "num_requests_inflight") == 2
    metrics.request_ended("INVALID_ARGUMENT")
    metrics.request_ended(None)
    assert sample(metrics, "num_requests_inflight") == 0
    assert sample(metrics, "request_failure", "_total", code="INVALID_ARGUMENT") == 1
    assert [sample(metrics, "num_live_workers", pool=p) for p in ("prefill", "decode", "mixed")] == [1, 2, 0]


# -- workers ---------------------------------------------------------------------------


def test_worker_phases_by_path():
    decode = WorkerMetrics("m", "decode", "decode-0")
    decode.request_finished(RequestTimes(arrival=1.0, scheduled=1.5, first_token=2.0, finished=5.0))  # local prefill
    decode.request_finished(RequestTimes(arrival=0.0, scheduled=3.0, first_token=3.0, finished=4.0, kv_committed=3.0))
    assert sample(decode, "request_queue_time_seconds", "_sum") == 0.5  # the remote one never queued here
    assert sample(decode, "request_prefill_time_seconds", "_count") == 1
    assert sample(decode, "request_decode_time_seconds", "_sum") == 3.0 + 1.0
    prefill = WorkerMetrics("m", "prefill", "prefill-0")
    prefill.request_finished(RequestTimes(arrival=1.0, scheduled=1.25, first_token=2.0, finished=2.0))
    prefill.request_finished(RequestTimes(arrival=1.0, scheduled=None, first_token=None, finished=2.0))  # never ran
    prefill.kv_sent([0.01, 0.02])
    assert sample(prefill, "request_prefill_time_seconds", "_sum") == 0.75
    assert sample(prefill, "request_queue_time_seconds", "_count") == 1
    assert sample(prefill, "request_decode_time_seconds", "_count") == 0
    assert sample(prefill, "kv_transfer_seconds", "_count") == 2


# Every EngineStats count at 0 (spec_decode, structured_outputs: their defaults, a worker
# that does not speculate and serves no constraint).
ZERO = dict.fromkeys((f.name for f in fields(EngineStats) if f.name not in ("spec_decode", "structured_outputs")), 0)


def test_worker_reads_engine_and_connector_counters_at_scrape_time():
    metrics = WorkerMetrics("m", "decode", "decode-0")
    stats = [WorkerStats(**{**ZERO, "num_requests_running": 3, "kv_cache_usage": 0.25, "prefix_cache_queries": 10,
                            "kv_fragmentation": 0.125})]
    metrics.watch(lambda: stats[0], lambda: KVTransferStats(kv_transfer_bytes=4096))
    assert sample(metrics, "num_requests_running") == 3
    stats[0] = replace(stats[0], num_requests_running=1)  # read again on the next scrape
    assert sample(metrics, "num_requests_running") == 1
    assert sample(metrics, "kv_cache_usage_perc") == 0.25
    assert sample(metrics, "kv_cache_fragmentation") == 0.125
    assert sample(metrics, "prefix_cache_queries", "_total") == 10
    assert sample(metrics, "kv_transfer_bytes", "_total") == 4096


def test_every_stat_read_at_scrape_time_is_a_field_of_the_typed_stats():
    names = {f.name for f in fields(WorkerStats)} | {f.name for f in fields(KVTransferStats)}
    assert set(ENGINE_GAUGES) | set(ENGINE_COUNTERS) <= names
    assert set(SPEC_COUNTERS) | {"num_accepted_tokens_per_pos"} == {f.name for f in fields(SpecStats)}


SPEC_STATS = SpecStats(num_drafts=7, num_draft_tokens=18, num_accepted_tokens=9, num_accepted_tokens_per_pos=(5, 3, 1),
                       num_unspeculated_requests=2)


def test_worker_reads_speculative_decoding_counters_at_scrape_time():
    """vLLM's spec_decode_* counters with our prefix, one series per draft position."""
    metrics = WorkerMetrics("m", "decode", "decode-0")
    stats = [WorkerStats(**ZERO)]
    metrics.watch(lambda: stats[0], KVTransferStats)
    assert sample(metrics, "spec_decode_num_drafts", "_total") == 0  # a worker that does not speculate: zeros,
    assert metrics.registry.get_sample_value(  # and no position
        full_name("spec_decode_num_accepted_tokens_per_pos_total"), {**metrics_base(metrics), "position": "0"}) is None
    stats[0] = replace(stats[0], spec_decode=SPEC_STATS)
    assert sample(metrics, "spec_decode_num_drafts", "_total") == 7
    assert sample(metrics, "spec_decode_num_draft_tokens", "_total") == 18
    assert sample(metrics, "spec_decode_num_accepted_tokens", "_total") == 9
    assert sample(metrics, "spec_decode_num_unspeculated_requests", "_total") == 2
    per_pos = [sample(metrics, "spec_decode_num_accepted_tokens_per_pos", "_total", position=str(i)) for i in range(4)]
    assert per_pos == [5, 3, 1, 0]


def test_worker_reads_structured_outputs_counters_and_compile_times_at_scrape_time():
    metrics = WorkerMetrics("m", "mixed", "mixed-0")
    stats = [WorkerStats(**ZERO)]
    times = [[0.002, 0.5]]
    metrics.watch(lambda: stats[0], KVTransferStats, None, lambda: times.pop() if times else [])
    assert sample(metrics, "structured_outputs_refusals", "_total", reason="timeout") == 0  # every reason, from 0
    assert sample(metrics, "structured_outputs_compile_seconds", "_count") == 2  # each compile observed once
    assert sample(metrics, "structured_outputs_compile_seconds", "_count") == 2
    stats[0] = replace(stats[0], structured_outputs=StructuredStats(
        num_compiles=2, compile_seconds_total=0.502, cache_hits=3, requests=(("choice", 1), ("json_schema", 4)),
        refusals=(("invalid", 1), ("too_deep", 2))))
    assert sample(metrics, "structured_outputs_cache_hits", "_total") == 3
    assert sample(metrics, "structured_outputs_requests", "_total", kind="json_schema") == 4
    assert sample(metrics, "structured_outputs_refusals", "_total", reason="too_deep") == 2
    assert set(STRUCTURED_FAMILIES) <= {f.name for f in fields(StructuredStats)}


def test_the_stats_rpc_carries_the_speculative_decoding_counters():
    message = stats_response("decode-0", "decode", 16, WorkerStats(**ZERO, spec_decode=SPEC_STATS))
    assert (message.spec_decode_num_drafts, message.spec_decode_num_draft_tokens, message.spec_decode_num_accepted_tokens,
            message.spec_decode_num_unspeculated_requests) == (7, 18, 9, 2)
    assert list(message.spec_decode_num_accepted_tokens_per_pos) == [5, 3, 1]


def test_engine_times_each_phase():
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=64)))
    engine.add_request("local", list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    reservation = engine.reserve_remote("remote", list(range(50, 90)), SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.last_batch == (0, 0)
    outputs = {}
    for _ in range(3):
        outputs.update({o.request_id: o for o in engine.step()})
    assert engine.last_batch == (1, 1)  # a decode step of "local"
    outputs.update({o.request_id: o for o in engine.commit_remote(reservation.request_id, 7)})
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    local, remote = outputs["local"].times, outputs["remote"].times
    assert local.kv_committed is None
    assert local.arrival <= local.scheduled <= local.first_token <= local.finished
    assert remote.arrival < remote.kv_committed == remote.scheduled <= remote.first_token <= remote.finished
    assert engine.stats().num_held_blocks == 0


def _tiered_engine_after_a_revisit() -> LLMEngine:
    """A pool of 12 blocks and a host tier: prompt A, then three others that evict A's
    blocks (copied down), then A again (its blocks copied back up)."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=12),
                                    kv_offload_host_bytes=1 << 24))
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, first in enumerate((3, 300, 600, 900, 3)):
        engine.add_request(f"r{i}", list(range(first, first + 64)), greedy)
        while engine.has_unfinished():
            engine.step()
        assert engine.offload.flush(30)
    return engine


def test_worker_reports_the_kv_tiers_per_tier_and_their_latencies_once():
    engine = _tiered_engine_after_a_revisit()
    try:
        metrics = WorkerMetrics("m", "decode", "decode-0")
        metrics.watch(lambda: WorkerStats.of(engine.stats(), 0, 0.0), KVTransferStats, engine.offload)
        stats = engine.stats().kv_offload
        assert stats.host.hits > 0
        assert sample(metrics, "kv_offload_tiering_block_hits", "_total", tier="host") == stats.host.hits
        assert sample(metrics, "kv_offload_tiering_block_misses", "_total", tier="host") == stats.host.misses
        assert sample(metrics, "kv_offload_tiering_write_bytes", "_total", tier="host") == stats.host.bytes_written > 0
        assert sample(metrics, "kv_offload_tiering_read_bytes", "_total", tier="host") == stats.host.bytes_read > 0
        assert sample(metrics, "kv_offload_cache_usage_perc", tier="host") == stats.host.usage > 0
        assert sample(metrics, "kv_offload_cache_capacity_bytes", tier="host") == stats.host.capacity_bytes
        assert sample(metrics, "kv_offload_blocks", "_total", direction="store") == stats.offloads > 0
        assert sample(metrics, "kv_offload_blocks", "_total", direction="load") == stats.onloaded_blocks > 0
        assert sample(metrics, "kv_offload_stores_skipped", "_total", reason="queue_full") == stats.offloads_dropped
        assert sample(metrics, "kv_offload_queue_depth") == 0
        assert sample(metrics, "kv_offload_corrupt_files", "_total") == 0
        assert metrics.registry.get_sample_value(  # no disk tier: no disk series
            full_name("kv_offload_tiering_block_hits_total"), {**metrics_base(metrics), "tier": "disk"}) is None
        onloads = sample(metrics, "kv_onload_seconds", "_count")
        assert onloads == stats.onload_seconds_count > 0
        assert sample(metrics, "kv_offload_seconds", "_count") == stats.offload_seconds_count > 0
        assert sample(metrics, "kv_onload_seconds", "_count") == onloads  # each sample observed once
    finally:
        engine.close()


def test_a_worker_without_tiers_reports_none():
    metrics = WorkerMetrics("m", "mixed", "mixed-0")
    metrics.watch(lambda: WorkerStats(**ZERO), KVTransferStats)
    exposed = {s.name for family in metrics.registry.collect() for s in family.samples}
    assert not {n for n in exposed if "offload" in n or "onload" in n}


# -- serving and switching off -------------------------------------------------------------


def test_metrics_server_keeps_colon_names_for_prometheus():
    metrics = RouterMetrics("m")
    port = metrics.serve("127.0.0.1", 0)
    try:
        metrics.first_token(0.1, 5)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=5) as reply:
            text = reply.read().decode()
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert 'pdserve:prompt_tokens_total{model_name="m",role="router",worker="router"} 5.0' in text
        assert "pdserve_" not in text
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_disabled_metrics_record_and_serve_nothing():
    off = Disabled()
    assert off.serve("127.0.0.1", 0) == 0 and off.registry is None
    off.first_token(0.1, 5)
    off.close()


def test_metrics_port_flags():
    with pytest.raises(ValueError, match="metrics_port"):
        RouterConfig(port=9000, metrics_port=9000)
    with pytest.raises(ValueError, match="metrics_port"):
        WorkerConfig(metrics_port=70000)
    assert WorkerConfig(host="10.0.0.5").metrics_host is None  # bound on --host (metrics_host())


# -- definitions, dashboard, rules ----------------------------------------------------------


def test_buckets_span_one_millisecond_to_ten_minutes():
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] == 600.0
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))


def _exposed_names() -> set[str]:
    names = set()
    for name, spec in METRICS.items():
        if spec.kind == "histogram":
            names |= {f"{PREFIX}{name}_{s}" for s in ("bucket", "sum", "count")}
        elif spec.kind.startswith("counter"):
            names.add(f"{PREFIX}{name}_total")
        else:
            names.add(PREFIX + name)
    return names


def _referenced(expr: str) -> set[str]:
    return set(re.findall(r"pdserve:[a-z0-9_]+(?::[a-z0-9_]+)?", expr))


def _dashboard():
    spec = importlib.util.spec_from_file_location("pdserve_dashboard", REPO / "deploy" / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dashboard_is_built_from_code_and_uses_defined_metrics():
    dashboard = _dashboard()
    assert (REPO / "deploy" / "grafana" / "pdserve.json").read_text() == dashboard.render(), \
        "run python deploy/grafana/dashboard.py"
    used = set().union(*(_referenced(q.expr) for p in dashboard.panels() for q in p.queries))
    assert used and used <= _exposed_names(), used - _exposed_names()
    names = {v["name"] for v in json.loads(dashboard.render())["templating"]["list"]}
    assert names == {"datasource", "model_name"}


def test_rules_use_defined_metrics_and_their_own_records():
    rules = yaml.safe_load(RULES.read_text())["groups"]
    records = {r["record"] for g in rules for r in g["rules"] if "record" in r}
    used = set().union(*(_referenced(r["expr"]) for g in rules for r in g["rules"]))
    assert used <= _exposed_names() | records, used - _exposed_names() - records
    alerts = {r["alert"] for g in rules for r in g["rules"] if "alert" in r}
    assert alerts == {"PdserveTTFTHigh", "PdserveTPOTHigh", "PdserveKVTransferFailures", "PdserveKVCacheNearFull",
                      "PdservePoolEmpty", "PdserveNoDecodeWorker", "PdserveRequestErrors"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (make test installs Debian's prometheus)")
@pytest.mark.parametrize("command", [["check", "rules", str(RULES)],
                                     ["test", "rules", str(RULES.with_name("pdserve-rules.test.yaml"))]])
def test_promtool(command):
    result = subprocess.run(["promtool", *command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
