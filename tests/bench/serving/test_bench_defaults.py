"""bench.serving.defaults --quick: `pdserve up` with default flags against the same
launch with `--torch-threads 1`, one run each through `pdserve bench`, and the ratio
line the docs quote."""

from __future__ import annotations

import math
import re

import pytest

from bench_helpers import run_bench

pytestmark = pytest.mark.cluster(seconds=30)


def test_quick_runs_both_sides_and_prints_the_ratios():
    proc = run_bench(["-m", "pdserve.bench.serving.defaults", "--quick"], timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert re.match(r"machine: \S+, \d+ CPUs; default: pdserve up \(no flags\); other: --torch-threads 1$", lines[0])
    runs = re.findall(r"^\[1/1\] (default|other)\s+output\s+([\d.]+) tok/s", proc.stdout, re.MULTILINE)
    assert [side for side, _ in runs] == ["default", "other"] and all(float(t) > 0 for _, t in runs)
    last = re.fullmatch(r"defaults_throughput_ratio=(\S+) defaults_tpot_p50_ratio=(\S+) defaults_ttft_p50_ratio=(\S+)",
                        lines[-1])
    assert last, lines[-1]
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in last.groups())
    throughput = float(runs[0][1]) / float(runs[1][1])
    assert float(last.group(1)) == pytest.approx(throughput, rel=2e-3)
