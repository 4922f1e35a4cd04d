"""Triton GEMMs for quantized linear layers: y = x @ W^T (+ bias), W dequantized in
registers, float32 accumulation, y in x's dtype (float16, bfloat16 or float32).

    int8_linear  weight int8 [N, K], scale [N]                 W = weight * scale[n]
                 or per group: scale [N, K/G]                  W = weight * scale[n, k // G]
    int4_linear  packed uint8 [N, K/2], scale/zero [N, K/G]    W = (c - zero) * scale
    fp4_linear   packed uint8 [N, K/2] (NVFP4: E2M1 codes),    W = e2m1(c) * bs / gs[n]
                 block_scale e4m3 [N, K/16], global_scale [N]
    fp8_linear   weight e4m3 [N, K], weight_scale [N]          W8A8: x quantized to e4m3
                 (per token, or a static input_scale)           y = (x_q @ W^T) * s_m * ws[n]

One kernel, `_gemm_kernel`, serves every scheme (a constexpr picks how a weight tile
is dequantized and which scales follow the dot). Tiling: one program per (BLOCK_M
rows of x, BLOCK_N output channels);
it walks K in BLOCK_K steps, loads the x tile [BM, BK] and the stored weight tile
[BN, BK] (row n of W is contiguous along K, as the checkpoint stores it), turns the
weight tile into x's dtype and accumulates x @ W_tile^T in float32:

              K ->                         K ->
    x   [ BM x BK | BM x BK | ... ]   W [ BN x BK | BN x BK | ... ]   acc [BM x BN]

Packed 4-bit weights (two per byte): element k of row n is the low nibble of byte
k // 2 when k is even, the high nibble when odd; the weight tile loads byte k // 2
for every k and shifts by 4 * (k % 2).

Scales that are constant along a row (int8's, fp4's global scale, fp8's) and the
activation scale are applied to the accumulator once, after the K loop; int4's,
grouped int8's and fp4's per-group scales are applied to the weight tile. An fp4 weight
times its E4M3 block scale is exact in float16 and bfloat16, so fp4 rounds nothing
before the dot; int4's (c - zero) * scale and grouped int8's q * scale are rounded to
x's dtype, like any dequantize-then-matmul.

The references these kernels are checked against live in `quant.formats` (dequantize, linear_reference).
Without CUDA, set TRITON_INTERPRET=1 before `triton` is first imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# _dot: a float32 dot in IEEE precision (TF32 would drift from the reference), else tl.dot.
from pdserve.engine.attention.triton_kernels import _dot
from pdserve.engine.quant.config import FP4_BLOCK
from pdserve.engine.quant.formats import FP8_MAX, FP8_MIN_SCALE

__all__ = ["fp4_linear", "fp8_linear", "int4_linear", "int8_linear", "quantize_fp8_activations"]

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _columns(BLOCK_N: tl.constexpr):
    """This program's output channels, int64: n * stride_n may pass 2**31 (a large
    vocabulary's LM head)."""
    return tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _x_tile(x_ptr, offs_m, k, M, K, stride_xm, stride_xk):
    """Rows offs_m, columns k of x, [BM, BK] (zeros outside)."""
    mask = (offs_m[:, None] < M) & (k[None, :] < K)
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk, mask=mask, other=0.0)


@triton.jit
def _weight_mask(offs_n, k, N, K):
    return (offs_n[:, None] < N) & (k[None, :] < K)


@triton.jit
def _nibbles(packed_ptr, offs_n, k, N, K, stride_pn, stride_pk):
    """Codes 0..15 of columns k of rows offs_n, [BN, BK] int32: byte k // 2, low nibble
    for even k, high for odd."""
    byte = tl.load(packed_ptr + offs_n[:, None] * stride_pn + (k // 2)[None, :] * stride_pk,
                   mask=_weight_mask(offs_n, k, N, K), other=0).to(tl.int32)
    return (byte >> ((k % 2) * 4)[None, :]) & 0xF


@triton.jit
def _e2m1(c):
    """E2M1 code -> float32: bits 1-2 exponent e, bit 0 mantissa m, bit 3 sign;
    e = 0: m * 0.5 (0, 0.5), else 2^(e-1) * (1 + m/2) (1, 1.5, 2, 3, 4, 6)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    normal = tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m)
    magnitude = tl.where(e == 0, 0.5 * m, normal)
    return tl.where((c & 8) != 0, -magnitude, magnitude)


@triton.jit
def _store(acc, y_ptr, bias_ptr, offs_m, offs_n, M, N, stride_ym, stride_yn, HAS_BIAS: tl.constexpr):
    """y tile = acc (+ bias[n]), rounded to y's dtype."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) -> the nearest E4M3 value (ties to even), as float32.

    Done by hand because the Triton interpreter's float32 -> float8 cast rounds wrongly
    (a mantissa carry is dropped: 124 becomes 64); the cast of a value already on the
    E4M3 grid is exact everywhere. E4M3 keeps 3 mantissa bits, so v's grid step is
    2^(e - 3), e = v's exponent, at least -6 (below it the step is fixed: subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    t = tl.abs(v) * ((127 - e + 3) << 23).to(tl.float32, bitcast=True)  # |v| / step, exact
    whole = tl.floor(t)
    frac = t - whole
    odd = (whole.to(tl.int32) & 1) == 1
    q = tl.where((frac > 0.5) | ((frac == 0.5) & odd), whole + 1.0, whole) * step
    return tl.where(bits < 0, -q, q)


@triton.jit
def _fp8_quantize_rows_kernel(
    x_ptr, xq_ptr, s_ptr, input_scale_ptr,
    K,
    stride_xm, stride_xk, stride_qm, stride_qk,
    STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program per row m: s = max|x_m| / FP8_MAX (at least MIN_SCALE), or the
    # static scale; x_q = clamp(x / s) in e4m3. Divisions round to nearest, as torch's.
    m = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + m * stride_xm
    if STATIC:
        s = tl.load(input_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX))
        tl.store(xq_ptr + m * stride_qm + k * stride_qk, q.to(xq_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + m, s)


@triton.jit
def _group_values(ptr, offs_n, k, k0, N, K, GROUP, stride_n, stride_g, GROUP_PER_TILE: tl.constexpr):
    """Per-group values (scale, zero) of columns k: [BN, 1] when the tile's columns share
    one group (GROUP a multiple of BLOCK_K), else each column's own, [BN, BK]."""
    if GROUP_PER_TILE:
        out = tl.load(ptr + offs_n * stride_n + (k0 // GROUP) * stride_g, mask=offs_n < N, other=0.0)[:, None]
    else:
        out = tl.load(ptr + offs_n[:, None] * stride_n + (k // GROUP)[None, :] * stride_g,
                      mask=_weight_mask(offs_n, k, N, K), other=0.0)
    return out.to(tl.float32)


@triton.jit
def _weight_tile(w_ptr, a_ptr, b_ptr, offs_n, k, k0, N, K, GROUP,
                 stride_wn, stride_wk, stride_an, stride_ak, stride_bn, stride_bk,
                 SCHEME: tl.constexpr, GROUP_PER_TILE: tl.constexpr):
    """Rows offs_n, columns k of the stored weight, [BN, BK], as far as it is dequantized
    before the dot: int8 / fp8 as stored, int8_group q * scale, int4 (c - zero) * scale,
    fp4 e2m1(c) * block scale (row-constant scales come after the dot, in _scaled)."""
    if SCHEME == "int8_group":
        q = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :] * stride_wk,
                    mask=_weight_mask(offs_n, k, N, K), other=0)
        w = q.to(tl.float32) * _group_values(a_ptr, offs_n, k, k0, N, K, GROUP, stride_an, stride_ak, GROUP_PER_TILE)
    elif SCHEME == "int4":
        c = _nibbles(w_ptr, offs_n, k, N, K, stride_wn, stride_wk)
        scale = _group_values(a_ptr, offs_n, k, k0, N, K, GROUP, stride_an, stride_ak, GROUP_PER_TILE)
        zero = _group_values(b_ptr, offs_n, k, k0, N, K, GROUP, stride_bn, stride_bk, GROUP_PER_TILE)
        w = (c.to(tl.float32) - zero) * scale
    elif SCHEME == "fp4":
        c = _nibbles(w_ptr, offs_n, k, N, K, stride_wn, stride_wk)
        w = _e2m1(c) * _group_values(a_ptr, offs_n, k, k0, N, K, GROUP, stride_an, stride_ak, GROUP_PER_TILE)
    else:  # int8, fp8: as stored
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :] * stride_wk,
                    mask=_weight_mask(offs_n, k, N, K), other=0.0)
    return w


@triton.jit
def _scaled(acc, a_ptr, b_ptr, offs_m, offs_n, M, N, SCHEME: tl.constexpr):
    """The accumulator times the scales constant along K: int8 scale[n], fp4
    1 / global_scale[n], fp8 x_scale[m] * weight_scale[n]."""
    if SCHEME == "int8":
        acc = acc * tl.load(a_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    elif SCHEME == "fp4":
        acc = acc / tl.load(b_ptr + offs_n, mask=offs_n < N, other=1.0)[None, :]
    elif SCHEME == "fp8":
        x_scale = tl.load(b_ptr + offs_m, mask=offs_m < M, other=0.0)
        acc = acc * x_scale[:, None] * tl.load(a_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    return acc


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, a_ptr, b_ptr, bias_ptr, y_ptr,
    M, N, K, GROUP,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_an, stride_ak, stride_bn, stride_bk,
    stride_ym, stride_yn,
    SCHEME: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_F32: tl.constexpr, FP8_DOT: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = x @ W^T (+ bias) for one (BLOCK_M, BLOCK_N) tile. SCHEME names the format
    of w and of the operands a and b:

        int8  w int8 [N, K]           a scale [N]                  (b unused)
        int8_group  w int8 [N, K]     a scale [N, K/G]             (b unused)
        int4  w uint8 [N, K/2]        a scale [N, K/G]             b zero [N, K/G]
        fp4   w uint8 [N, K/2]        a block_scale e4m3 [N, K/16] b global_scale [N]
        fp8   w e4m3 [N, K]           a weight_scale [N]           b x_scale [M]
              (x is already quantized to e4m3)

    fp8 dot: FP8_DOT = e4m3 tensor cores (sm_89+), else both sides widened to float16,
    which holds every e4m3 value exactly. Hopper's fp8 tensor cores accumulate with a
    short mantissa and Triton's default there never promotes, so each K tile's partial
    sum is promoted to the float32 accumulator (max_num_imprecise_acc=BLOCK_K)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = _columns(BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, offs_m, k, M, K, stride_xm, stride_xk)
        w = _weight_tile(w_ptr, a_ptr, b_ptr, offs_n, k, k0, N, K, GROUP,
                         stride_wn, stride_wk, stride_an, stride_ak, stride_bn, stride_bk, SCHEME, GROUP_PER_TILE)
        if SCHEME == "fp8":
            if FP8_DOT:
                acc += tl.dot(x, tl.trans(w), max_num_imprecise_acc=BLOCK_K)
            else:
                acc += tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
        else:
            acc += _dot(x, tl.trans(w.to(x.dtype)), IEEE_F32)
    acc = _scaled(acc, a_ptr, b_ptr, offs_m, offs_n, M, N, SCHEME)
    _store(acc, y_ptr, bias_ptr, offs_m, offs_n, M, N, stride_ym, stride_yn, HAS_BIAS)


# --------------------------------------------------------------------------- wrappers


def _tiles(m: int, x_dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): tl.dot needs >= 16 everywhere. Decode (few rows)
    gets the smallest M tile and narrow N tiles, so that a 4096-wide layer still spreads
    over ~128 programs; float32 halves K to bound registers."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 16 else 64
    block_k = 64 if x_dtype == torch.float32 else 128
    return block_m, block_n, block_k


def _as_2d(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x: dtype must be one of {_X_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: last dim must be the weight's K={k}, got shape {tuple(x.shape)}")
    return x.reshape(-1, k)


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, x on {device}")


def _check_bias(bias: torch.Tensor | None, n: int, device) -> None:
    if bias is not None:
        _check("bias", bias, (n,), _X_DTYPES, device)


def _weight_2d(name: str, w: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    if w.dim() != 2 or w.dtype != dtype:
        raise ValueError(f"{name}: expected a 2-D {dtype} tensor, got {w.dtype} of shape {tuple(w.shape)}")
    return w.shape[0], w.shape[1]


def _launch(scheme: str, x2: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            bias: torch.Tensor | None, group: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Run _gemm_kernel over the (M, N) tile grid on x2 [M, K] and the weight `w` [N, *]
    with its scheme's operands `a`, `b` ([N] or [N, groups]); returns y [M, N] (x2's
    dtype unless `out_dtype`)."""
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, block_k = _tiles(m, x2.dtype)
    _gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2, w, a, b, bias if bias is not None else y, y,
        m, n, k, group,
        *x2.stride(), *w.stride(), *_strides_2d(a), *_strides_2d(b), *y.stride(),
        SCHEME=scheme, HAS_BIAS=bias is not None, IEEE_F32=x2.dtype == torch.float32,
        FP8_DOT=scheme == "fp8" and _fp8_dot_supported(x2.device), GROUP_PER_TILE=group % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def _strides_2d(t: torch.Tensor) -> tuple[int, int]:
    return (t.stride(0), t.stride(1)) if t.dim() == 2 else (t.stride(0), 0)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:
    """W8A16: y = x @ (weight * scale[:, None])^T (+ bias); with `group_size` G, one scale
    per group of G inputs: W[n, k] = weight[n, k] * scale[n, k // G].

    x [..., K] float16/bfloat16/float32; weight int8 [N, K]; scale float32 [N], or
    [N, K // G] with groups (G divides K); bias [N] or None. Returns [..., N] in x's dtype."""
    n, k = _weight_2d("weight", weight, torch.int8)
    if group_size is not None and (group_size <= 0 or k % group_size):
        raise ValueError(f"group_size: must be a positive divisor of K={k}, got {group_size}")
    x2 = _as_2d(x, k)
    _check("weight", weight, (n, k), (torch.int8,), x.device)
    _check("scale", scale, (n,) if group_size is None else (n, k // group_size), (torch.float32,), x.device)
    _check_bias(bias, n, x.device)
    if group_size is None:
        y = _launch("int8", x2, weight, scale, scale, bias)
    else:
        y = _launch("int8_group", x2, weight, scale, scale, bias, group=group_size)
    return y.reshape(*x.shape[:-1], n)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W4A16, group-wise with zero points: W[n, k] = (c - zero[n, k // G]) * scale[n, k // G],
    c the k-th nibble of row n (low nibble of packed[n, k // 2] for even k, high for odd).

    x [..., K]; packed uint8 [N, K // 2]; scale, zero float32 [N, K // G] (zero holds
    integer values); group_size G divides K. Act-order permutations are the caller's."""
    n, half_k = _weight_2d("packed", packed, torch.uint8)
    k = x.shape[-1] if x.dim() else 0
    if k != 2 * half_k:
        raise ValueError(f"packed: expected [N, K // 2] = [{n}, {k // 2}] for x's K={k}, got {tuple(packed.shape)}")
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: must be a positive divisor of K={k}, got {group_size}")
    x2 = _as_2d(x, k)
    _check("packed", packed, (n, half_k), (torch.uint8,), x.device)
    _check("scale", scale, (n, k // group_size), (torch.float32,), x.device)
    _check("zero", zero, (n, k // group_size), (torch.float32,), x.device)
    _check_bias(bias, n, x.device)
    y = _launch("int4", x2, packed, scale, zero, bias, group=group_size)
    return y.reshape(*x.shape[:-1], n)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 weight-only: W[n, k] = e2m1(c) * block_scale[n, k // 16] / global_scale[n],
    c the k-th nibble of row n (as in int4_linear), an E2M1 code (bit 3 sign).

    x [..., K] with K a multiple of 16; packed uint8 [N, K // 2]; block_scale
    float8_e4m3fn [N, K // 16]; global_scale float32 [N]."""
    n, half_k = _weight_2d("packed", packed, torch.uint8)
    k = x.shape[-1] if x.dim() else 0
    if k % FP4_BLOCK:
        raise ValueError(f"x: K={k} must be a multiple of {FP4_BLOCK} (one block scale per {FP4_BLOCK} weights)")
    if k != 2 * half_k:
        raise ValueError(f"packed: expected [N, K // 2] = [{n}, {k // 2}] for x's K={k}, got {tuple(packed.shape)}")
    x2 = _as_2d(x, k)
    _check("packed", packed, (n, half_k), (torch.uint8,), x.device)
    _check("block_scale", block_scale, (n, k // FP4_BLOCK), (torch.float8_e4m3fn,), x.device)
    _check("global_scale", global_scale, (n,), (torch.float32,), x.device)
    _check_bias(bias, n, x.device)
    y = _launch("fp4", x2, packed, block_scale, global_scale, bias, group=FP4_BLOCK)
    return y.reshape(*x.shape[:-1], n)


def quantize_fp8_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], s float32 [M]): s = max|x_m| / 448 per row
    (at least FP8_MIN_SCALE: a zero row stays zero), or the static 0-dim `input_scale`;
    x_q = clamp(x / s, -448, 448)."""
    if input_scale is not None:
        _check("input_scale", input_scale, (), (torch.float32,), x.device)
    m, k = x.shape
    x_q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _fp8_quantize_rows_kernel[(m,)](
            x, x_q, s, input_scale if input_scale is not None else s,
            k, *x.stride(), *x_q.stride(),
            STATIC=input_scale is not None, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
            BLOCK_K=min(1024, triton.next_power_of_2(max(k, 16))),
        )
    return x_q, s


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 FP8: x quantized to E4M3 per token (or with the static `input_scale`), then
    y = (x_q @ weight^T) * s_m * weight_scale[n] (+ bias), in x's dtype.

    x [..., K]; weight float8_e4m3fn [N, K]; weight_scale float32 [N]; input_scale a
    float32 0-dim tensor or None."""
    n, k = _weight_2d("weight", weight, torch.float8_e4m3fn)
    x2 = _as_2d(x, k)
    _check("weight", weight, (n, k), (torch.float8_e4m3fn,), x.device)
    _check("weight_scale", weight_scale, (n,), (torch.float32,), x.device)
    _check_bias(bias, n, x.device)
    x_q, x_scale = quantize_fp8_activations(x2, input_scale)
    y = _launch("fp8", x_q, weight, weight_scale, x_scale, bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], n)


def _fp8_dot_supported(device: torch.device) -> bool:
    """E4M3 tensor-core dots exist from sm_89 (Ada, Hopper); the interpreter has them."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)
