"""Smoke test of the quantization benchmark: `python -m pdserve.bench.quant.schemes --quick` end
to end (about 15 s on an idle machine, 6 s of it three 1P+1D clusters of the tiny model,
one per KV dtype). Its figures are in docs/benchmarks.md; here only the form of its
report and the ratios that are exact by construction (KV blocks in the same budget,
KV bytes shipped for the same prompts, counted by the clusters' workers) are checked,
never a timing."""

from __future__ import annotations

import math
import re

import pytest
import torch

from bench_helpers import run_bench

pytestmark = pytest.mark.cluster(seconds=45)

LAST_LINE = re.compile(r"weight_bytes_ratio_int8=(?P<a>\S+) kv_blocks_ratio_fp8=(?P<b>\S+) "
                       r"transfer_bytes_ratio_fp8=(?P<c>\S+) throughput_ratio_int8=(?P<d>\S+)")


def test_quick_quant_benchmark_reports_exact_byte_ratios() -> None:
    proc = run_bench(["-m", "pdserve.bench.quant.schemes", "--quick"], timeout=300)
    lines = proc.stdout.strip().splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    # the quick budget (4 MiB) is 512 float32 blocks of the tiny model, 2048 FP8 ones;
    # FP8 pages are a quarter of float32's, block for block
    assert match["b"] == "4.000" and match["c"] == "4.000", lines[-1]
    assert float(match["a"]) > 2, lines[-1]  # int8 weights and int8 embedding table
    assert math.isfinite(float(match["d"])) and float(match["d"]) > 0, lines[-1]

    # every variant ran once per repetition, interleaved
    order = re.findall(r"^\[repeat (\d)/2\] (\S+)$", proc.stdout, re.MULTILINE)
    variants = ["base", "int8", "int4", "fp8", "fp4", "kv_fp8_e4m3", "kv_fp8_e5m2", "int8+kv_fp8"]
    assert order[: 2 * len(variants)] == [(r, v) for r in "12" for v in variants], order
    assert re.search(r"^kv_fp8_e4m3 +float32 +\d+ +1\.000 +float8_e4m3fn +128 +2048 +4\.000$", proc.stdout,
                     re.MULTILINE), proc.stdout
    # through the clusters: 2 prompts of 128 tokens (8 blocks each), 2 layers, K and V of
    # 2 KV heads x 16 dims: 512 bytes per token in float32, 128 in FP8 (C comes from these)
    for kv, total, per_token, ratio in (("auto", 131072, "512.0", "1.000"), ("fp8_e4m3", 32768, "128.0", "4.000"),
                                        ("fp8_e5m2", 32768, "128.0", "4.000")):
        assert re.search(rf"^{kv} +{total} bytes +{per_token} bytes/prompt token +\(auto / this {ratio}\)$",
                         proc.stdout, re.MULTILINE), proc.stdout
    for name in ("transfer tail", "TTFT", "prefill", "rest"):  # the workers' and the router's timings
        assert len(re.findall(rf"^ +{name} ms +\S+ \(min \S+, max \S+, k=2\)", proc.stdout, re.MULTILINE)) == 3, \
            proc.stdout
    # the engine pair: one prompt, the same bytes per token
    assert re.search(r"^fp8_e5m2 +float8_e5m2 +16384 bytes +128\.0 bytes/prompt token +\(auto / this 4\.000\)",
                     proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^int8 +throughput tok/s \S+ \(min \S+, max \S+, k=2\)$", proc.stdout, re.MULTILINE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the GPU mode would run")
def test_gpu_mode_is_refused_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.bench.quant.schemes import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err
