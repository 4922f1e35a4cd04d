"""Smoke test of the offline benchmark: `python -m pdserve.bench.engine.offline --quick` end to end."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster(seconds=10)

REPO = Path(__file__).resolve().parents[3]
LAST_LINE = re.compile(
    r"^ratio_vs_hf_generate=(?P<x>\S+) ratio_vs_hf_generate_batch=(?P<y>\S+) roofline_fraction=(?P<z>\S+)$"
)


def test_quick_benchmark_prints_positive_ratios() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.offline", "--quick"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match, f"unexpected last line: {lines[-1]!r}"
    for name in ("x", "y", "z"):
        value = float(match[name])
        assert math.isfinite(value) and value > 0, f"{name}={match[name]}"
    assert re.search(r"correctness \(last repetition\): ours == HF generate \(unpadded, greedy\) for \d+/\d+",
                     proc.stdout)
    # the systems ran interleaved, twice, and each ratio is a median with its range
    order = re.findall(r"^\[repeat (\d)/2\] (\w+)$", proc.stdout, re.MULTILINE)
    assert order == [(r, s) for r in "12" for s in ("ours", "hf_generate", "hf_batch")], order
    assert re.search(r"^throughput ratio ours / HF generate: \S+ \(min \S+, max \S+, k=2\)$", proc.stdout, re.MULTILINE)


def test_parallel_workload_reports_block_saving() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.offline", "--workload", "parallel", "--quick"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.fullmatch(r"block_saving=(\S+)", proc.stdout.strip().splitlines()[-1])
    assert match, proc.stdout[-500:]
    # 2 prompts x 13 blocks shared by 8 samples vs 8 x 13 each: sharing must save a lot
    assert float(match[1]) > 3.0
