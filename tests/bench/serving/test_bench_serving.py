"""The serving benchmark end to end: `pdserve bench --quick` starts its own small
cluster, and its JSON report must hold together (every request accounted for, the
tokens asked for, goodput <= throughput, percentiles ordered), its plot must be a
PNG. The openai backends run against `pdserve up --http-port 0` with the same
checks, and the gRPC-vs-HTTP comparison (bench.serving.http --quick) against the same
cluster. Also: workers pinned by the launcher really run on their CPUs."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench_helpers import REPO, bench_env, run_bench
from cluster_helpers import UpProcess
from pdserve.bench.serving.metrics import inconsistencies

pytestmark = pytest.mark.cluster(seconds=30)

LAST_LINE = re.compile(r"^ttft_p50_ms=(?P<ttft>\d+\.\d{2}) tpot_p50_ms=(?P<tpot>\d+\.\d{2})$")


def test_quick_serving_benchmark_report_is_consistent(tmp_path: Path) -> None:
    report, plot = tmp_path / "run.json", tmp_path / "run.png"
    proc = run_bench(["-m", "pdserve", "bench", "--quick", "--workload", "prefix", "--prefix-count", "2",
                      "--request-rate", "20", "--burstiness", "0.5", "--slo", "ttft:2000,tpot:200",
                      "--json", str(report), "--plot", str(plot)])
    match = LAST_LINE.match(proc.stdout.strip().splitlines()[-1])
    assert match, proc.stdout[-500:]
    assert all(math.isfinite(float(match[k])) and float(match[k]) > 0 for k in ("ttft", "tpot"))
    assert "INCONSISTENT" not in proc.stdout and "error x" not in proc.stdout
    assert re.search(r"^Successful requests:\s+16$", proc.stdout, re.MULTILINE), proc.stdout

    data = json.loads(report.read_text())
    summary, requests = data["summary"], data["requests"]
    assert inconsistencies(summary, requests) == []
    # the same properties, checked here without the benchmark's own code
    assert summary["num_requests"] == len(requests) == 16 and summary["failed"] == 0
    assert sorted(r["index"] for r in requests) == list(range(16))
    assert all(r["output_tokens"] == r["requested_tokens"] == 16 for r in requests)
    # one time per token-carrying message: a worker that fell behind sends several
    # tokens in one message (seen on a loaded machine), so at most one per token
    assert all(1 <= len(r["token_times"]) <= r["output_tokens"] for r in requests)
    assert all(r["prompt_tokens"] == r["requested_prompt_tokens"] for r in requests)
    assert summary["output_tokens"] == 16 * 16
    assert summary["good"] <= summary["completed"] and summary["goodput"] <= summary["request_throughput"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = summary[name]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (name, d)
    assert summary["slo"] == "ttft<=2000ms, tpot<=200ms"
    assert data["config"]["arrivals"] == {"request_rate": 20.0, "burstiness": 0.5, "concurrency": 0}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def http_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpProcess, str]]:
    """`pdserve up --http-port 0` (1 prefill + 1 decode worker; no prefix cache, as
    the comparison needs) and its OpenAI base URL, from the line after `ready`."""
    logs = tmp_path_factory.mktemp("http-cluster")
    up = UpProcess(["--http-port", "0", "--num-blocks", "512", "--no-enable-prefix-caching"], logs / "up.log")
    try:
        url = up.openai_url  # UpProcess read the `openai URL` line after `ready`
        assert url.startswith("http://") and url.endswith("/v1"), url
        yield up, url
    finally:
        up.stop()


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_quick_openai_backends_report_is_consistent(backend: str, http_cluster: tuple[UpProcess, str],
                                                    tmp_path: Path) -> None:
    up, base_url = http_cluster
    report = tmp_path / "run.json"
    # prompts past 256 tokens too: a token-id prompt is one prompt, however long (not a list of 256 at most)
    proc = run_bench(["-m", "pdserve", "bench", "--quick", "--backend", backend, "--base-url", base_url,
                      "--prompt-tokens", "8", "320", "--json", str(report)])
    match = LAST_LINE.match(proc.stdout.strip().splitlines()[-1])
    assert match, proc.stdout[-500:]
    assert float(match["ttft"]) > 0 and float(match["tpot"]) > 0
    assert "INCONSISTENT" not in proc.stdout and "error x" not in proc.stdout
    assert f"backend {backend}, model pdserve-tiny-code" in proc.stdout

    data = json.loads(report.read_text())
    summary, requests = data["summary"], data["requests"]
    assert inconsistencies(summary, requests) == []
    assert summary["num_requests"] == len(requests) == 16 and summary["failed"] == 0
    # the tokens asked for, as the server's usage counted them; a time per chunk carrying text
    assert all(r["output_tokens"] == r["requested_tokens"] == 16 for r in requests)
    assert all(1 <= len(r["token_times"]) <= r["output_tokens"] for r in requests)
    assert all(r["ttft"] > 0 and r["tpot"] > 0 for r in requests)
    assert summary["output_tokens"] == 16 * 16
    if backend == "openai":  # token ids sent as token ids: the server counted exactly them
        assert all(r["prompt_tokens"] == r["requested_prompt_tokens"] for r in requests)
        assert max(r["prompt_tokens"] for r in requests) > 256
    else:  # one user message: the chat template's tokens come on top of the text's
        assert all(r["requested_prompt_tokens"] is None and r["prompt_tokens"] > 0 for r in requests)
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = summary[name]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (name, d)
    assert summary["server_ttft"]["count"] == 0  # the OpenAI API reports no server-side timing
    assert data["target"] == base_url and data["config"]["backend"] == backend


@pytest.mark.parametrize("backend", ["grpc", "openai-chat"])
def test_multiturn_workload_resends_each_conversations_history(backend: str, http_cluster: tuple[UpProcess, str],
                                                               tmp_path: Path) -> None:
    """3 conversations of 2-3 turns against a running server: each turn's prompt is the
    one before, its answer and a new user message (gRPC: exactly, in tokens; chat: it
    grows, the template's tokens on top), sent only after the turn before it ended."""
    up, base_url = http_cluster
    report = tmp_path / "multiturn.json"
    target = ["--addr", up.address] if backend == "grpc" else ["--base-url", base_url]
    proc = run_bench(["-m", "pdserve", "bench", "--workload", "multiturn", "--backend", backend, *target,
                      "--num-requests", "3", "--turns", "2", "3", "--think-time", "0.05", "--prompt-tokens", "8", "16",
                      "--max-tokens", "4", "--json", str(report)])
    assert LAST_LINE.match(proc.stdout.strip().splitlines()[-1]), proc.stdout[-500:]
    assert "workload: multiturn, 3 conversations, conversations of 2-3 turns" in proc.stdout
    data = json.loads(report.read_text())
    summary, requests = data["summary"], sorted(data["requests"], key=lambda r: r["index"])
    assert inconsistencies(summary, requests) == [] and summary["failed"] == 0
    assert 6 <= summary["num_requests"] == len(requests) <= 9
    new_conversations = 1
    for prev, cur in zip(requests, requests[1:]):
        if cur["prompt_tokens"] < prev["prompt_tokens"]:  # the next conversation's first turn
            new_conversations += 1
            continue
        assert cur["started"] >= prev["finished"]  # a conversation's turns in order, after the answer
        if backend == "grpc":  # history + answer (4 tokens) + a new user message of 8-16 tokens
            assert 8 <= cur["prompt_tokens"] - prev["prompt_tokens"] - 4 <= 16, (prev, cur)
    assert new_conversations == 3


def test_http_comparison_quick_interleaves_the_three_paths(http_cluster: tuple[UpProcess, str], tmp_path: Path) -> None:
    """bench.serving.http against the running cluster (its --quick mode on its own cluster adds
    a cluster start, ~20 s, to the suite): grpc, openai, openai-chat in turn, the same
    prompt tokens on every path, differences and ratios per repetition."""
    up, base_url = http_cluster
    report = tmp_path / "http.json"
    proc = run_bench(["-m", "pdserve.bench.serving.http", "--quick", "--addr", up.address, "--base-url", base_url,
                      "--json", str(report)])
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"ttft_p50_delta_ms=(\S+) tpot_p50_ratio=(\S+)", lines[-1])
    assert match, lines[-1]
    assert math.isfinite(float(match[1])) and float(match[2]) > 0
    assert "INCONSISTENT" not in proc.stdout
    order = [m.group(1, 2) for m in (re.match(r"\[(\d)/2\] (\S+)", line) for line in lines) if m]
    assert order == [(rep, name) for rep in "12" for name in ("grpc", "openai", "openai-chat")]
    for name in ("openai", "openai-chat"):
        assert re.search(rf"TTFT p50 {name} - grpc \(ms\): \S+ \(min \S+, max \S+, k=2\)", proc.stdout)
        assert re.search(rf"TPOT p50 {name} / grpc: \S+ \(min \S+, max \S+, k=2\)", proc.stdout)
    data = json.loads(report.read_text())
    for rep in range(2):
        runs = {name: data["runs"][name][rep] for name in ("grpc", "openai", "openai-chat")}
        for run in runs.values():
            assert inconsistencies(run["summary"], run["requests"]) == []
            assert run["summary"]["failed"] == 0 and run["summary"]["cached_tokens"] == 0
        # every path prefilled the same tokens: the chat route's, counted by the router
        counts = {name: [r["prompt_tokens"] for r in run["requests"]] for name, run in runs.items()}
        assert counts["grpc"] == counts["openai"] == counts["openai-chat"]
        assert all(r["output_tokens"] == 8 for run in runs.values() for r in run["requests"])
    ttft = {name: [run["summary"]["ttft"]["p50"] for run in data["runs"][name]] for name in ("grpc", "openai-chat")}
    deltas = [h - g for h, g in zip(ttft["openai-chat"], ttft["grpc"])]
    assert data["ttft_p50_delta_ms"]["openai-chat"]["median"] == pytest.approx(statistics.median(deltas))


def test_bench_rejects_bad_flags_naming_them() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--slo", "ttft=1", "--addr", "127.0.0.1:1"],
                          cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--slo" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pdserve.bench.serving.command", "--workload", "trace", "--addr", "127.0.0.1:1"],
                          cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dataset" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--backend", "openai", "--addr", "127.0.0.1:1"],
                          cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--addr" in proc.stderr and "--base-url" in proc.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_launcher_pins_each_worker_and_all_its_threads(tmp_path: Path) -> None:
    from pdserve.launch.local import ClusterSpec, LaunchConfig, LocalCluster
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.worker.config import WorkerConfig

    cpus = sorted(os.sched_getaffinity(0))[:2]
    spec = ClusterSpec(RouterConfig(port=0), WorkerConfig(num_blocks=64),
                       LaunchConfig(prefill=1, decode=1, worker_cpus=f"{cpus[0]};{cpus[1]}"))
    with LocalCluster(spec, log_dir=tmp_path) as cluster:
        for worker, cpu in (("prefill-0", cpus[0]), ("decode-0", cpus[1])):
            pid = cluster.processes[worker].pid
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            assert len(tids) > 3  # engine, gRPC, torch threads...
            assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset({cpu})}, worker
        assert len(os.sched_getaffinity(cluster.processes["router"].pid)) >= 2  # the router is not pinned
