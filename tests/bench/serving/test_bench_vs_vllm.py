"""bench.serving.vs_vllm: what it reads from `vllm bench serve`'s report, and its refusal
without vLLM's environment (vLLM itself is not installed where the suite runs; the
side-by-side is run by hand: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from pdserve.bench.serving.metrics import Headline
from pdserve.bench.serving.vs_vllm import main, parse_result

REPORT = """============ Serving Benchmark Result ============
Successful requests:                     64
Benchmark duration (s):                  45.12
Total input tokens:                      16384
Total generated tokens:                  4096
Request throughput (req/s):              1.42
Output token throughput (tok/s):         90.78
Peak output token throughput (tok/s):    128.00
Total Token throughput (tok/s):          453.90
---------------Time to First Token----------------
Mean TTFT (ms):                          14000.10
Median TTFT (ms):                        14900.20
P99 TTFT (ms):                           30000.00
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):                          470.00
Median TPOT (ms):                        469.50
P99 TPOT (ms):                           600.00
==================================================
"""


def test_the_report_gives_throughput_and_the_medians():
    assert parse_result(REPORT) == Headline(throughput=90.78, ttft_p50_ms=14900.2, tpot_p50_ms=469.5)


def test_a_report_without_a_figure_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match="tpot_p50_ms"):
        parse_result(REPORT.replace("Median TPOT", "Mean TPOT again"))


def test_without_vllms_python_it_exits_2_saying_so(capsys):
    assert main([]) == 2
    assert "--vllm-python is required" in capsys.readouterr().err
