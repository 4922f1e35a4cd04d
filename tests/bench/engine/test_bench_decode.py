"""The decode workload (`bench.engine.offline --workload decode`) and the GEMM micro-benchmark
(`bench.engine.gemm`): their parts, and the decode workload end to end on the quick model."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.engine import decode, gemm
from pdserve.bench.common.random_model import ModelSpec

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("op, part", [
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("mkldnn::_linear_pointwise", "gemm"),
    ("aten::_weight_int8pack_mm", "gemm"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::index_select", "attention"), ("aten::index_copy_", "kv write"), ("aten::argmax", "sampling"),
    ("aten::_log_softmax", "sampling"), ("aten::rms_norm", "small ops"), ("aten::mul", "small ops"),
    ("aten::silu", "small ops"), ("aten::embedding", "small ops"),
])
def test_profiled_operators_fall_in_their_part(op, part):
    assert decode.part_of(op) == part


def test_the_floor_counts_every_linear_layer_and_the_head_once():
    spec = ModelSpec()
    # bench.engine.offline's model: 75.5M linear weights + a 24.6M LM head (tied) + norms, fp32
    assert decode.weight_bytes_read(spec) == 4 * (spec.non_embedding_linear_params + 32000 * 768 + 25 * 768)
    assert 399e6 < decode.weight_bytes_read(spec) < 401e6


def test_gemm_measures_both_kernels_on_every_row_count():
    got = gemm.measure(512, 512, rows=[1, 4], footprint=4 << 20, repeats=1)
    assert sorted(got) == [1, 4]
    for plain, packed in got.values():
        assert math.isfinite(plain) and plain > 0 and math.isfinite(packed) and packed > 0
    assert [name for name, _, _ in gemm.decode_shapes(ModelSpec())] == [
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    assert gemm.decode_shapes(ModelSpec())[0][1:] == (768, 768 + 2 * 256)


def test_quick_decode_workload_prints_the_fraction_and_the_speedup():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine.offline", "--workload", "decode", "--quick", "--profile", "--batches", "1,16"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"decode_bw_fraction_b1=(\S+) decode_speedup_b16=(\S+)", last)
    assert match, last
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in match.groups())
    # the three paths at both batch sizes, each split into the profile's parts
    rows = re.findall(r"^\s+(\d+)\s+(eager|fast|captured)((?:\s+\d+\.\d+){7})$", proc.stdout, re.MULTILINE)
    assert [(b, m) for b, m, _ in rows] == [(b, m) for b in ("1", "16") for m in ("eager", "fast", "captured")]
    assert "bandwidth floor" in proc.stdout and "speedup" in proc.stdout
