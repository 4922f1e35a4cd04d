"""`pdserve offline`: the engine alone from the shell, quantized as a worker would be."""

from __future__ import annotations

import subprocess
import sys

from cluster_helpers import REPO, child_env


def offline(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "offline", *argv], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)


def test_offline_generates_with_quantized_weights_and_fp8_kv():
    done = offline("--quantization", "int8", "--kv-cache-dtype", "fp8", "--max-tokens", "4", "def add(a, b):")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def add(a, b):") and len(done.stdout.split("-" * 40)[0]) > len("def add(a, b):\n")
    assert "no k_scale/v_scale" in done.stderr  # the embedded model has none: 1.0, said once


def test_offline_refuses_an_unknown_scheme_by_name():
    done = offline("--quantization", "int3", "x")
    assert done.returncode == 2 and "--quantization: invalid choice: 'int3'" in done.stderr
