"""Smoke test of the online serving benchmark: `python -m pdserve.bench.serving --quick` end to
end (it starts and stops its own small local cluster)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(r"^ttft_p50_ms=(?P<ttft>\d+\.\d{2}) tpot_p50_ms=(?P<tpot>\d+\.\d{2})$")


def test_quick_serving_benchmark_reports_positive_latencies_and_no_errors() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serving", "--quick"],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match, f"unexpected last line: {lines[-1]!r}"
    for name in ("ttft", "tpot"):
        value = float(match[name])
        assert math.isfinite(value) and value > 0, f"{name}={match[name]}"
    assert re.search(r"^failed requests:\s+0$", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^successful requests:\s+16$", proc.stdout, re.MULTILINE), proc.stdout
    assert "error x" not in proc.stdout
