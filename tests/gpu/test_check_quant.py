"""tests/gpu/check_quant.py, the parts a CPU can run: its argument checks, and the
whole script on the CPU (`--device cpu`, tiny shapes, the kernels in the interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_checks import loaded_check

TINY = ["--m", "1", "17", "--n", "40", "--k", "128", "--kv-seqs", "3", "--context", "21", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16", "--block-size", "8", "--warmup", "0", "--iters", "1"]


@pytest.fixture(scope="module")
def script():
    with loaded_check("quant") as module:
        yield module


def test_arguments(script):
    args = script.parse_args([])
    assert args.m == [1, 16, 128] and args.n == args.k == 4096 and args.dtypes == ["bf16", "fp16"]
    assert set(args.schemes) == {"int8", "int8-g128", "int4", "fp4", "fp8", "fp8-static"}
    with pytest.raises(SystemExit):
        script.parse_args(["--k", "100"])  # not a multiple of the int4 group
    with pytest.raises(SystemExit):
        script.parse_args(["--heads", "6", "--kv-heads", "4"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_whole_script_on_cpu(script, capsys):
    assert script.main(["--device", "cpu", "--dtypes", "fp16", "fp32", *TINY]) == 0
    lines = capsys.readouterr().out.splitlines()
    for scheme in ("int8", "int8-g128", "int4", "fp4", "fp8", "fp8-static"):
        assert sum(line.startswith(f"gemm {scheme} ") for line in lines) == 4, scheme
    assert sum(line.startswith("kv   fp8_") for line in lines) == 4
    assert all(line.endswith("PASS") for line in lines if line.startswith(("gemm", "kv")))
    assert "torch_bf16=" in lines[1] and "kernel=" in lines[1]
    assert lines[-1] == "gpu_check_quant ok"


def test_no_cuda_exits_2(script, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert script.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
