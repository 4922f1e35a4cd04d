"""Quantized GEMM Triton kernels (engine/quant/triton_gemm.py) vs. their
dequantize-then-matmul references (engine/quant/formats.py).

Without CUDA the kernels run in Triton's interpreter, which must be enabled before
`triton` is first imported (tests/conftest.py sets it for the session; it is set here
too so the file runs alone). The interpreter mishandles bfloat16, so CPU runs cover
float32 and float16; tests/gpu/check_quant.py covers bfloat16 and real shapes on a GPU.
"""

from __future__ import annotations

import os

import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pdserve.engine.quant import formats as ref  # noqa: E402  (the references)
from pdserve.engine.quant import triton_gemm as tg  # noqa: E402

if not _HAS_CUDA:
    from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

    if not isinstance(tg._gemm_kernel, InterpretedFunction):
        pytest.skip("no CUDA and triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1",
                    allow_module_level=True)

DEVICE = torch.device("cuda" if _HAS_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16]
# (M, N, K, bias): decode (M=1), a few rows, more rows than one M tile (17 > 16); one
# shape that is no multiple of the tiles (N=40, K=96) exercises the masks.
SHAPES = [(1, 64, 128, True), (3, 128, 256, False), (17, 64, 64, True), (3, 40, 96, False)]


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Against the reference's float32 result rounded to x's dtype: the kernel differs in
    summation order (float32) and, for float16, in one rounding of the output and of
    the dequantized weight; errors are measured relative to the output's scale."""
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    scale = expected.float().abs().max().item() + 1e-6
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol * scale, rtol=tol)


def _inputs(m, n, k, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEVICE)
    b = (torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE)) if bias else None
    return gen, x, b


@pytest.mark.parametrize("m,n,k,bias", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_matches_reference(dtype, m, n, k, bias):
    gen, x, b = _inputs(m, n, k, bias, dtype, seed=m * 7 + k)
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(n, generator=gen) * 0.02 + 0.002).to(DEVICE)
    expected = ref.linear_reference(x, ref.dequantize_int8(weight, scale), b)
    _close(tg.int8_linear(x, weight, scale, b), expected, dtype)


@pytest.mark.parametrize("group_size", [32, 64], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("m,n,k,bias", SHAPES[:3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_int8_matches_reference(dtype, m, n, k, bias, group_size):
    """compressed-tensors' W8A16 (int8 per group): each group's own scale, no zero points;
    g32 looks a group up per column, g64 with fp32's 64-wide K tile once per tile."""
    gen, x, b = _inputs(m, n, k, bias, dtype, seed=m * 5 + k + group_size)
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.002).to(DEVICE)
    expected = ref.linear_reference(x, ref.dequantize_int8(weight, scale, group_size), b)
    _close(tg.int8_linear(x, weight, scale, b, group_size=group_size), expected, dtype)


def test_grouped_int8_groups_are_not_interchangeable():
    """One group's scale zeroed: only that group's columns stop counting."""
    gen, x, _ = _inputs(3, 32, 128, False, torch.float32, seed=3)
    weight = torch.randint(-128, 128, (32, 128), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = torch.full((32, 4), 0.01, device=DEVICE)
    scale[:, 2] = 0.0
    expected = x[:, :64] @ (weight[:, :64].float() * 0.01).T + x[:, 96:] @ (weight[:, 96:].float() * 0.01).T
    _close(tg.int8_linear(x, weight, scale, group_size=32), expected, torch.float32)


@pytest.mark.parametrize("group_size", [32, 64], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("m,n,k,bias", SHAPES[:3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_matches_reference(dtype, m, n, k, bias, group_size):
    """g32: every column looks its group up (group smaller than the K tile); g64 with
    fp32's 64-wide K tile: one group per tile."""
    gen, x, b = _inputs(m, n, k, bias, dtype, seed=m * 11 + k + group_size)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(DEVICE)
    scale = (torch.rand(n, k // group_size, generator=gen) * 0.1 + 0.01).to(DEVICE)
    zero = torch.randint(0, 16, (n, k // group_size), generator=gen).float().to(DEVICE)
    expected = ref.linear_reference(x, ref.dequantize_int4(packed, scale, zero, group_size), b)
    _close(tg.int4_linear(x, packed, scale, zero, group_size, b), expected, dtype)


@pytest.mark.parametrize("m,n,k,bias", SHAPES[:3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp4_matches_reference(dtype, m, n, k, bias):
    gen, x, b = _inputs(m, n, k, bias, dtype, seed=m * 13 + k)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(DEVICE)
    block_scale = (torch.rand(n, k // 16, generator=gen) * 4 + 0.05).to(torch.float8_e4m3fn).to(DEVICE)
    global_scale = (torch.rand(n, generator=gen) * 50 + 10).to(DEVICE)
    expected = ref.linear_reference(x, ref.dequantize_fp4(packed, block_scale, global_scale), b)
    _close(tg.fp4_linear(x, packed, block_scale, global_scale, b), expected, dtype)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("m,n,k,bias", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_matches_reference(dtype, m, n, k, bias, static):
    gen, x, b = _inputs(m, n, k, bias, dtype, seed=m * 17 + k + static)
    x[0, 0] = 30.0  # an outlier: row 0's scale differs from the rest
    if m > 2:
        x[2] = 0.0  # a zero row: its scale is the floor, its output the bias
    weight = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn).to(DEVICE)
    weight_scale = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(DEVICE)
    # static: a scale too small for the outlier, which is clamped to 448 * scale
    input_scale = torch.tensor(0.02, device=DEVICE) if static else None
    expected = ref.fp8_linear_reference(x, weight, weight_scale, input_scale, b)
    _close(tg.fp8_linear(x, weight, weight_scale, input_scale, b), expected, dtype)
    if m > 2 and not static:
        assert torch.equal(tg.fp8_linear(x, weight, weight_scale)[2], torch.zeros(n, dtype=dtype, device=DEVICE))


def test_fp8_activation_quantization_matches_reference():
    """Same scales and the same e4m3 bytes as torch's cast: every e4m3 value, every
    midpoint between neighbours (ties go to even), subnormals, an all-zero row, rows
    far apart in scale, per token and static."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].sort().values
    exhaustive = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]).reshape(1, -1).to(DEVICE)
    xq, s = tg.quantize_fp8_activations(exhaustive, torch.tensor(1.0, device=DEVICE))
    xq_ref, _ = ref.quantize_fp8_activations(exhaustive, torch.tensor(1.0, device=DEVICE))
    assert torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(5, 96, generator=gen) * torch.tensor([1e-3, 1.0, 100.0, 0.0, 7.0])[:, None]).to(DEVICE)
    for input_scale in (None, torch.tensor(0.05, device=DEVICE)):
        xq, s = tg.quantize_fp8_activations(x, input_scale)
        xq_ref, s_ref = ref.quantize_fp8_activations(x, input_scale)
        assert torch.equal(s, s_ref)
        assert torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))
        if input_scale is None:
            assert s[3].item() == torch.tensor(ref.FP8_MIN_SCALE).item()  # a zero row: the floor


def test_leading_dims_and_empty_batch():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = torch.full((32,), 0.01, device=DEVICE)
    x = torch.randn(2, 3, 64, generator=gen).to(DEVICE)
    y = tg.int8_linear(x, weight, scale)
    assert y.shape == (2, 3, 32)
    _close(y.reshape(6, 32), ref.linear_reference(x.reshape(6, 64), ref.dequantize_int8(weight, scale)), torch.float32)
    assert tg.int8_linear(torch.zeros(0, 64, device=DEVICE), weight, scale).shape == (0, 32)


def test_reference_layouts():
    """The references read the layouts the issue names: even k = low nibble; E2M1 codes."""
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)
    assert ref.unpack_nibbles(packed).tolist() == [[1, 2, 8, 15]]
    assert torch.equal(ref.pack_nibbles(ref.unpack_nibbles(packed)), packed)
    codes = torch.arange(16, dtype=torch.uint8)
    assert ref.e2m1_to_float(codes).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    w = ref.dequantize_int4(packed, torch.tensor([[0.5]]), torch.tensor([[8.0]]), group_size=4)
    assert w.tolist() == [[-3.5, -3.0, 0.0, 3.5]]


def _bad_calls():
    x = torch.randn(2, 64, device=DEVICE)
    w8 = torch.zeros(32, 64, dtype=torch.int8, device=DEVICE)
    s = torch.ones(32, device=DEVICE)
    p = torch.zeros(32, 32, dtype=torch.uint8, device=DEVICE)
    g = torch.ones(32, 2, device=DEVICE)
    bs = torch.ones(32, 4, device=DEVICE).to(torch.float8_e4m3fn)
    f8 = torch.zeros(32, 64, device=DEVICE).to(torch.float8_e4m3fn)
    return [
        (lambda: tg.int8_linear(x, w8.float(), s), "weight"),
        (lambda: tg.int8_linear(x[:, :48], w8, s), "x: last dim"),
        (lambda: tg.int8_linear(x.long(), w8, s), "x: dtype"),
        (lambda: tg.int8_linear(x, w8, s[:31]), "scale: expected shape"),
        (lambda: tg.int8_linear(x, w8, s, group_size=32), "scale: expected shape"),
        (lambda: tg.int8_linear(x, w8, g, group_size=48), "group_size"),
        (lambda: tg.int8_linear(x, w8, s.double()), "scale: dtype"),
        (lambda: tg.int8_linear(x, w8, s, bias=torch.zeros(5, device=DEVICE)), "bias"),
        (lambda: tg.int4_linear(x, p, g, g, group_size=48), "group_size"),
        (lambda: tg.int4_linear(x, p[:, :16], g, g, group_size=32), "packed"),
        (lambda: tg.int4_linear(x, p, g[:, :1], g, group_size=32), "scale"),
        (lambda: tg.int4_linear(x, p, g, g[:, :1], group_size=32), "zero"),
        (lambda: tg.fp4_linear(x[:, :40], p[:, :20], bs, s), "multiple of 16"),
        (lambda: tg.fp4_linear(x, p, bs.float(), s), "block_scale"),
        (lambda: tg.fp4_linear(x, p, bs, s[:4]), "global_scale"),
        (lambda: tg.fp8_linear(x, w8, s), "weight"),
        (lambda: tg.fp8_linear(x, f8, s[:3]), "weight_scale"),
        (lambda: tg.fp8_linear(x, f8, s, input_scale=torch.ones(1, device=DEVICE)), "input_scale"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_rejects_bad_arguments(index):
    call, match = _bad_calls()[index]
    with pytest.raises(ValueError, match=match):
        call()
