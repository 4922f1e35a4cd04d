"""The GPU checks on CUDA (collected only where a CUDA device is present: conftest.py):
each script's own pass/fail, at its quick or default shapes. Their CPU smoke modes are
in test_check_engine.py and test_check_quant.py."""

from __future__ import annotations

import pytest
import torch

from gpu_checks import loaded_check


@pytest.fixture(autouse=True)
def _gpu_only() -> None:
    if not torch.cuda.is_available():  # never collected without CUDA; kept for a direct run
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("name, argv", [
    ("engine", ["--quick"]),
    ("quant", ["--m", "1", "16", "--dtypes", "bf16"]),
    ("triton", ["--dtypes", "bf16", "fp16"]),
])
def test_check_passes_on_cuda(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with loaded_check(name) as check:
        code = check.main(argv)
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "FAIL" not in out
