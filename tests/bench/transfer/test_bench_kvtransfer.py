"""Quick mode of the KV transfer benchmark (bench.transfer.kvtransfer): two processes, our
transports against raw ZeroMQ, each ratio a median over paired repetitions with its range.
Its figures are in docs/benchmarks.md; here only the report's form is checked."""

from __future__ import annotations

import math
import re

import pytest

from bench_helpers import run_bench

pytestmark = pytest.mark.cluster(seconds=10)


def test_kvtransfer_quick_reports_paired_ratios() -> None:
    proc = run_bench(["-m", "pdserve.bench.transfer.kvtransfer", "--quick"])
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"ratio_vs_raw_zmq=(\S+) curve_vs_plain=(\S+)", lines[-1])
    assert match, lines[-1]
    for ratio in match.groups():
        assert math.isfinite(float(ratio)) and float(ratio) > 0, lines[-1]
    assert re.search(r"zmq_tcp / raw_tcp GB/s per repetition: \S+ \(min \S+, max \S+, k=10\)", proc.stdout)
