"""bench.quant.int8_kernels --quick: every kernel timed on every decode shape (the
engine's W8A16 and W8A8 among them), the int8 kernels' errors against full precision,
and the machine-readable last line."""

from __future__ import annotations

import math
import re

from bench_helpers import run_bench


def test_quick_times_every_kernel_and_prints_the_speedups():
    proc = run_bench(["-m", "pdserve.bench.quant.int8_kernels", "--quick"], timeout=300)
    assert re.match(r"ISA: \S+, torch threads 1; shapes: qkv_proj ", proc.stdout)
    rows = re.findall(r"^\s+(\d+)((?:\s+\d+ x[\d.]+){4})\s+([\d.]+)\s+([\d.]+)$", proc.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "4"]
    for _, _, w8a16, w8a8 in rows:
        assert 0 < float(w8a16) < 0.02 and 0 < float(w8a8) < 0.05  # int8 weights; 7-bit activations per token
    last = re.fullmatch(r"int8_speedup_w8a16_r1=(\S+) int8_speedup_w8a8_r1=(\S+)", proc.stdout.strip().splitlines()[-1])
    assert last and all(math.isfinite(float(v)) and float(v) > 0 for v in last.groups())
