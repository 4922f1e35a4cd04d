"""tests/gpu/check_engine.py, the parts a CPU can run: its helpers, and the whole
script on the CPU (`--device cpu`, tiny shapes; the Triton kernel in the interpreter)."""

from __future__ import annotations


import pytest
import torch

from gpu_checks import loaded_check


@pytest.fixture(scope="module")
def script():
    with loaded_check("engine") as module:
        yield module


def test_peak_bandwidth_by_device_name(script):
    assert script.peak_hbm("NVIDIA H200") == 4.8e12
    assert script.peak_hbm("NVIDIA H100 PCIe") == 2.0e12
    assert script.peak_hbm("NVIDIA H100 80GB HBM3") == 3.35e12
    assert script.peak_hbm("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert script.peak_hbm("NVIDIA L4") == 0.3e12
    assert script.peak_hbm("Some Future GPU") is None


def test_divergence_and_ties(script):
    assert script.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert script.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert script.first_divergence([1, 2], [1, 2, 3]) == 2
    assert script.is_tie(torch.tensor([0.1, 3.0, 2.9995]), 1e-3)
    assert not script.is_tie(torch.tensor([0.1, 3.0, 2.9]), 1e-3)


def test_whole_script_on_cpu(script, capsys):
    assert script.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in ("greedy", "prefix", "parallel", "beam", "float16", "bfloat16", "quant int8", "quant int4",
                 "quant fp8", "quant fp4", "quant kv fp8"):
        assert f"PASS {name}" in out
    assert "FAIL" not in out
    assert "tok/s" in out and "kernel" in out and "all checks passed" in out


def test_no_cuda_exits_2(script):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert script.main(["--device", "cuda"]) == 2
