"""The benchmarks' parts without a cluster: workloads, arrivals, metrics, SLO, the
consistency check, stopping clusters together, and the flags the
benchmarks added to the services (worker CPU pinning, round-robin prefill choice)."""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
import threading
from collections.abc import Iterator

import pytest

from pdserve.bench.cluster.clusters import _exit_all
from pdserve.bench.serving.metrics import RequestResult, Slo, inconsistencies, request_record, summarize
from pdserve.bench.serving.workloads import (
    MOONCAKE_BLOCK,
    ArrivalConfig,
    WorkloadConfig,
    make_workload,
    send_times,
)
from pdserve.services.router import policy
from pdserve.services.worker.config import parse_cpus

VOCAB, MAX_LEN = 1000, 4096


def test_random_workload_has_exact_lengths_in_range_and_is_seeded() -> None:
    cfg = WorkloadConfig(kind="random", num_requests=50, prompt_tokens=(5, 9), output_tokens=(2, 4), seed=3)
    a = make_workload(cfg, ArrivalConfig(request_rate=10.0), VOCAB, MAX_LEN)
    b = make_workload(cfg, ArrivalConfig(request_rate=10.0), VOCAB, MAX_LEN)
    assert a == b
    assert [r.index for r in a] == list(range(50))
    assert all(5 <= r.prompt_len <= 9 and 2 <= r.max_tokens <= 4 for r in a)
    assert all(3 <= t < VOCAB for r in a for t in r.prompt)
    # the rate moves only the times, never the prompts
    c = make_workload(cfg, ArrivalConfig(request_rate=1.0), VOCAB, MAX_LEN)
    assert [r.prompt for r in c] == [r.prompt for r in a] and [r.send_at for r in c] != [r.send_at for r in a]


def test_prefix_workload_shares_exactly_k_prefixes() -> None:
    cfg = WorkloadConfig(kind="prefix", num_requests=40, prefix_count=3, prefix_tokens=20, prompt_tokens=(1, 5))
    requests = make_workload(cfg, ArrivalConfig(), VOCAB, MAX_LEN)
    assert len({r.prompt[:20] for r in requests}) == 3
    assert len({r.prompt for r in requests}) == 40  # unique suffixes
    assert all(21 <= r.prompt_len <= 25 for r in requests)


def test_gamma_arrivals_have_the_asked_mean_and_burstiness() -> None:
    def gaps(burstiness: float) -> list[float]:
        times = send_times(4000, ArrivalConfig(request_rate=5.0, burstiness=burstiness), random.Random(1))
        return [b - a for a, b in zip(times, times[1:])]

    for burstiness in (0.25, 1.0, 4.0):
        g = gaps(burstiness)
        assert statistics.mean(g) == pytest.approx(0.2, rel=0.1)
        # a gamma of shape k has coefficient of variation 1/sqrt(k)
        assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)
    assert send_times(3, ArrivalConfig(), random.Random(0)) == [0.0, 0.0, 0.0]


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_trace_replay_equal_hash_ids_are_equal_blocks(tmp_path) -> None:
    trace = _write_jsonl(tmp_path / "trace.jsonl", [
        {"timestamp": 1000, "input_length": 1200, "output_length": 5, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 6, "hash_ids": [7, 8, 10]},
        {"timestamp": 4000, "input_length": 300, "output_length": 7, "hash_ids": [11]},
    ])
    cfg = WorkloadConfig(kind="trace", num_requests=10, path=trace)
    a, b, c = make_workload(cfg, ArrivalConfig(request_rate=1e-3), VOCAB, MAX_LEN)
    assert [r.send_at for r in (a, b, c)] == [0.0, 0.5, 3.0]  # the trace's own times, not the rate's
    assert (a.prompt_len, b.prompt_len, c.prompt_len) == (1200, 1100, 300)
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (5, 6, 7)
    assert a.prompt[: 2 * MOONCAKE_BLOCK] == b.prompt[: 2 * MOONCAKE_BLOCK]  # hash ids 7, 8
    assert a.prompt[2 * MOONCAKE_BLOCK :][:50] != b.prompt[2 * MOONCAKE_BLOCK :][:50]  # 9 vs 10
    # scaled down: a hash id is 16 tokens, lengths follow; sharing is kept
    small = make_workload(WorkloadConfig(kind="trace", num_requests=10, path=trace, trace_block_tokens=16,
                                         trace_speedup=2.0), ArrivalConfig(), VOCAB, MAX_LEN)
    assert [r.prompt_len for r in small] == [38, 35, 10]
    assert small[0].prompt[:32] == small[1].prompt[:32] and small[0].prompt[32:35] != small[1].prompt[32:35]
    assert [r.send_at for r in small] == [0.0, 0.25, 1.5]


def test_trace_errors_name_the_line_and_field(tmp_path) -> None:
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 10, "output_length": 1,
                                                 "hash_ids": "x"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: hash_ids"):
        make_workload(WorkloadConfig(kind="trace", path=bad), ArrivalConfig(), VOCAB, MAX_LEN)
    long = _write_jsonl(tmp_path / "long.jsonl", [{"timestamp": 0, "input_length": 9000, "output_length": 1,
                                                   "hash_ids": [1]}])
    with pytest.raises(ValueError, match="--trace-block-tokens"):
        make_workload(WorkloadConfig(kind="trace", path=long), ArrivalConfig(), VOCAB, MAX_LEN)
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="junk.jsonl:1: not JSON"):
        make_workload(WorkloadConfig(kind="trace", path=str(tmp_path / "junk.jsonl")), ArrivalConfig(), VOCAB, MAX_LEN)


def test_sharegpt_lengths_from_records_and_conversations(tmp_path) -> None:
    data = _write_jsonl(tmp_path / "sg.jsonl", [
        {"input_length": 30, "output_length": 4},
        {"input_length": 5000, "output_length": 4},  # longer than max_model_len: skipped
        {"conversations": [{"from": "human", "value": "def fib(n):\n    return n"},
                           {"from": "gpt", "value": "if n < 2 else fib(n - 1) + fib(n - 2)"}]},
        {"conversations": [{"from": "human", "value": "no reply"}]},  # skipped
    ])
    requests = make_workload(WorkloadConfig(kind="sharegpt", num_requests=6, path=data), ArrivalConfig(), VOCAB, MAX_LEN)
    lengths = {(r.prompt_len, r.max_tokens) for r in requests}
    assert (30, 4) in lengths and len(lengths) == 2  # cycled through the two usable records
    (conv,) = lengths - {(30, 4)}
    assert conv[0] > 3 and conv[1] > 3


def _result(index: int, tokens: int, ttft: float, gap: float, error: str = "") -> RequestResult:
    times = tuple(1.0 + index + ttft + i * gap for i in range(tokens)) if not error else ()
    return RequestResult(index=index, error=error, started=1.0 + index, finished=(times[-1] if times else 2.0 + index),
                         requested_tokens=tokens, requested_prompt_tokens=10, prompt_tokens=10 if not error else 0,
                         output_tokens=tokens if not error else 0, token_times=times)


def test_summary_goodput_percentiles_and_consistency() -> None:
    results = [_result(0, 5, 0.1, 0.01), _result(1, 5, 0.5, 0.01), _result(2, 5, 0.1, 0.05), _result(3, 5, 0, 0, "boom")]
    summary = summarize(1.0, results, Slo.parse("ttft:200,tpot:20"))
    assert (summary.completed, summary.failed, summary.good) == (3, 1, 1)
    assert summary.goodput <= summary.request_throughput
    assert summary.output_tokens == 15 and summary.tpot.count == 3
    assert summary.ttft.p50 == pytest.approx(100.0)
    records = [request_record(r, 1.0) for r in results]
    assert inconsistencies(summary.to_dict(), records) == []
    # every kind of damage is caught
    broken = [dict(records[0], output_tokens=4), *records[1:]]
    assert any("asked for" in p for p in inconsistencies(summary.to_dict(), broken))
    assert any("indices" in p for p in inconsistencies(summary.to_dict(), records[:3]))
    assert any("goodput" in p for p in inconsistencies(dict(summary.to_dict(), goodput=99.0), records))
    bad_p = dict(summary.to_dict(), ttft=dict(summary.to_dict()["ttft"], p90=-1.0))
    assert any("not ordered" in p for p in inconsistencies(bad_p, records))
    miscounted = [dict(records[0], prompt_tokens=9), *records[1:]]
    assert any("prompt tokens" in p for p in inconsistencies(summary.to_dict(), miscounted))


def test_slo_parse_errors_name_the_flag() -> None:
    assert Slo.parse("ttft:500,tpot:50") == Slo(500.0, 50.0)
    assert Slo.parse("") == Slo()
    for bad in ("ttft=5", "e2e:5", "ttft:x", "tpot:0"):
        with pytest.raises(ValueError, match="--slo"):
            Slo.parse(bad)


def test_parse_cpus_and_round_robin_policy() -> None:
    assert parse_cpus("0") == {0} and parse_cpus("0,2-3") == {0, 2, 3}
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError, match="cpu_affinity"):
            parse_cpus(bad)
    loads = [policy.Load(w, 0, 0, 0, 10, frozenset()) for w in ("p-1", "p-0")]
    assert [policy.pick_round_robin(loads, t).worker_id for t in range(4)] == ["p-0", "p-1", "p-0", "p-1"]
    assert policy.pick_round_robin([], 0) is None


def test_clusters_are_stopped_all_at_once_and_an_error_waits_for_the_rest() -> None:
    """clusters_up leaves its clusters together: each stop below passes the barrier
    only while the other two are stopping too (one by one, it breaks after 5 s)."""
    barrier = threading.Barrier(3, timeout=5)
    stopped: list[str] = []

    @contextlib.contextmanager
    def cluster(name: str, fails: bool = False) -> Iterator[str]:
        try:
            yield name
        finally:
            barrier.wait()
            stopped.append(name)
            if fails:
                raise OSError(f"{name}: did not stop")

    running = [cluster("a"), cluster("b", fails=True), cluster("c")]
    for cm in running:
        cm.__enter__()
    with pytest.raises(OSError, match="b: did not stop"):
        _exit_all(running)
    assert sorted(stopped) == ["a", "b", "c"]
