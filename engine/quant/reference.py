"""Pure-torch references for the quantized linear layers: dequantize, then matmul.

Each `dequantize_*` turns a stored weight back into float32 `[N, K]`; the Triton
kernels in `triton_gemm` must agree with `linear_reference(x, dequantize_*(...), bias)`
(and the FP8 W8A8 kernel with `fp8_linear_reference`). Slow and simple on purpose:
these define what the formats mean.

Packed 4-bit layouts (int4 and NVFP4's E2M1) hold two weights per byte along K:

    packed[n, j] = c[n, 2j] | c[n, 2j + 1] << 4      (even k: low nibble)
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
# Smallest per-token activation scale (vLLM's): a row of zeros quantizes to zeros
# instead of dividing by zero.
FP8_MIN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)
# E2M1 magnitudes by code bits 0-2; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_BLOCK = 16


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> codes uint8 [N, K], element k from nibble k % 2 of byte k // 2."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_nibbles`: codes 0..15 [N, K] (K even) -> uint8 [N, K // 2]."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric per output channel: W = weight * scale[:, None]."""
    return weight.float() * scale.float()[:, None]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-wise with zero points: W[n, k] = (c - zero[n, k // G]) * scale[n, k // G]."""
    codes = unpack_nibbles(packed).float()
    s = scale.float().repeat_interleave(group_size, dim=1)
    z = zero.float().repeat_interleave(group_size, dim=1)
    return (codes - z) * s


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0..15 -> float32 (bit 3 sign, bits 0-2 index E2M1_VALUES)."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def dequantize_fp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4: W[n, k] = e2m1(c) * block_scale[n, k // 16] / global_scale[n]."""
    values = e2m1_to_float(unpack_nibbles(packed))
    blocks = block_scale.float().repeat_interleave(FP4_BLOCK, dim=1)
    return values * blocks / global_scale.float()[:, None]


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) in float32, returned in x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_fp8_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], s float32 [M]) with x ~ x_q * s[:, None]:
    s = max|x_m| / 448 per row (at least FP8_MIN_SCALE), or the static `input_scale`."""
    xf = x.float()
    if input_scale is None:
        s = (xf.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    else:
        s = input_scale.float().expand(x.shape[0]).contiguous()
    x_q = (xf / s[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return x_q, s


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: y = (x_q @ weight^T) * s_m * weight_scale[n] (+ bias), in x's dtype."""
    x_q, s = quantize_fp8_activations(x, input_scale)
    y = (x_q.float() @ weight.float().T) * s[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
