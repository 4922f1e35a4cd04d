"""bench.serving.startup --quick: `pdserve up` with workers forked (the default) and
exec'd, each started, one worker killed and restarted, and the ratio line the docs
quote; it is also the end-to-end run of `--worker-start exec`."""

from __future__ import annotations

import math
import re

import pytest

from bench_helpers import run_bench

pytestmark = pytest.mark.cluster(seconds=20)


def test_quick_starts_and_restarts_both_sides_and_prints_the_ratios():
    proc = run_bench(["-m", "pdserve.bench.serving.startup", "--quick"], timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert re.match(r"machine: \S+, \d+ CPUs; pdserve up --mixed 1, --worker-start fork vs exec", lines[0])
    runs = re.findall(r"^\[1/1\] (fork|exec)\s+ready\s+([\d.]+) s  CPU to ready\s+([\d.]+) s  worker restart\s+"
                      r"([\d.]+) s$", proc.stdout, re.MULTILINE)
    assert [side for side, *_ in runs] == ["fork", "exec"]
    assert all(float(v) > 0 for _, *values in runs for v in values)
    last = re.fullmatch(r"startup_ready_ratio=(\S+) startup_cpu_ratio=(\S+) startup_restart_ratio=(\S+)", lines[-1])
    assert last, lines[-1]
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in last.groups())
    assert float(last.group(2)) == pytest.approx(float(runs[0][2]) / float(runs[1][2]), rel=0.02)
