"""Smoke test of `python -m pdserve.bench.transfer.draft_kv`: one row per length, the draft cheaper."""

from __future__ import annotations

import subprocess
import sys


def test_draft_kv_reports_a_row_per_length() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.transfer.draft_kv", "--lengths", "32,64", "--repeats", "2"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [32, 64]
    for row in rows:
        target_ms, draft_ms, ratio = float(row[1]), float(row[2]), float(row[3])
        assert target_ms > 0 and draft_ms > 0 and ratio > 0
