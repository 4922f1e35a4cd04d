"""Quick modes of the cluster comparisons (bench.cluster.disagg, bench.cluster.prefix): each starts
its clusters, runs its systems interleaved (A B A B), and prints consistent reports
and its machine-readable last line. The figures themselves are in docs/benchmarks.md;
here only their form and internal consistency are checked (speed is never asserted)."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from pdserve.bench.serving.metrics import inconsistencies
from bench_helpers import run_bench

pytestmark = pytest.mark.cluster(seconds=120)


def _runs_consistent(runs: list[dict], expected_requests: int) -> None:
    for run in runs:
        summary, requests = run["summary"], run["requests"]
        assert inconsistencies(summary, requests) == [], run["label"]
        assert summary["num_requests"] == len(requests) == expected_requests
        assert summary["failed"] == 0, summary["errors"]
        assert summary["goodput"] <= summary["request_throughput"]


def test_disagg_quick_alternates_setups_and_reports_both(tmp_path: Path) -> None:
    report, plot = tmp_path / "disagg.json", tmp_path / "disagg.png"
    proc = run_bench(["-m", "pdserve.bench.cluster.disagg", "--quick", "--json", str(report), "--plot", str(plot)])
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"tpot_p99_ratio=(\S+) goodput_ratio=(\S+)", lines[-1])
    assert match, lines[-1]
    assert all(math.isfinite(float(x)) and float(x) > 0 for x in match.groups())
    order = [m.group(1, 2) for m in (re.match(r"\[(\d)/2\] (\w+)", line) for line in lines) if m]
    assert order == [("1", "colocated"), ("1", "disaggregated"), ("2", "colocated"), ("2", "disaggregated")]
    assert "INCONSISTENT" not in proc.stdout
    assert re.search(r"tpot_p99_ratio \(colocated / disaggregated\): \S+ \(min \S+, max \S+, k=2\)", proc.stdout)
    data = json.loads(report.read_text())
    for name in ("colocated", "disaggregated"):
        assert len(data["runs"][name]) == 2
        for rep, run in enumerate(data["runs"][name]):
            _runs_consistent([run], len(data["runs"]["colocated"][rep]["requests"]))
    # both setups got the same requests in each repetition
    for a, b in zip(data["runs"]["colocated"], data["runs"]["disaggregated"]):
        assert [r["requested_prompt_tokens"] for r in a["requests"]] == [r["requested_prompt_tokens"] for r in b["requests"]]
    ratios = [c["summary"]["tpot"]["p99"] / d["summary"]["tpot"]["p99"]
              for c, d in zip(data["runs"]["colocated"], data["runs"]["disaggregated"])]
    assert data["tpot_p99_ratio"]["median"] == pytest.approx(statistics.median(ratios))
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_prefix_quick_reports_cache_and_routing_ratios(tmp_path: Path) -> None:
    report = tmp_path / "prefix.json"
    proc = run_bench(["-m", "pdserve.bench.cluster.prefix", "--quick", "--json", str(report)])
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"ttft_ratio=(\S+)", lines[-1])
    assert match and math.isfinite(float(match[1])) and float(match[1]) > 0, lines[-1]
    assert re.search(r"round-robin / prefix-aware \(2 prefill workers\): \S+ \(min", proc.stdout)
    data = json.loads(report.read_text())
    cfg = data["config"]
    for name, count in (("cache on", cfg["num_requests"]), ("cache off", cfg["num_requests"]),
                        ("prefix-aware", cfg["cross_requests"]), ("round-robin", cfg["cross_requests"])):
        assert len(data["runs"][name]) == cfg["repeats"] == 2
        _runs_consistent(data["runs"][name], count)
    for run in data["runs"]["cache off"]:
        assert run["summary"]["cached_tokens"] == 0
    for run in data["runs"]["cache on"]:  # all but the first request of a repetition hit the shared prompt
        shared = round(cfg["prompt_tokens"] * cfg["shared_fraction"]) // 16 * 16
        assert run["summary"]["cached_tokens"] >= (cfg["num_requests"] - 1) * shared
