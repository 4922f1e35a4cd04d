"""Smoke test of the sampled workload: `python -m pdserve.bench.engine.offline --workload sampled --quick`."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster(seconds=5)

REPO = Path(__file__).resolve().parents[3]


def test_sampled_workload_reports_step_time() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.engine.offline", "--workload", "sampled", "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"sampled_step_ms=(\S+) sampler_ms=(\S+)", lines[-1])
    assert match, lines[-1]
    step_ms, sampler_ms = float(match[1]), float(match[2])
    assert math.isfinite(step_ms) and step_ms > 0 and math.isfinite(sampler_ms) and sampler_ms > 0
    assert any(line.startswith("decode step (8 seqs): median") for line in lines)
