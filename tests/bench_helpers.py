"""Running a benchmark's entry point as a child process, as a user runs it, for the
tests under tests/bench/: the repository as the package `pdserve`, no `PDSERVE_*`
settings inherited from the environment (every flag reads one), stdin closed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO.parent), str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def run_bench(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """`python ARGS...` from the repository root; its output, asserting exit status 0."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=bench_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
