"""The number formats' arithmetic: quantize a full-precision weight, dequantize one back.

Every scheme's canonical storage, per linear layer of N outputs and K inputs (rows are
output channels, so fused layers are their shards' rows stacked):

    int8   weight int8 [N, K]             weight_scale fp32 [N]          W = q * s
           (per group of G inputs:        weight_scale fp32 [N, K/G]     W = q * s[n, k // G])
    int4   weight_packed uint8 [N, K/2]   weight_scale fp32 [N, K/G]     W = (c - z) * s
           (code c of column k: low nibble of byte k/2 when k is even, high when odd)
                                          weight_zero fp32 [N, K/G]      (integer-valued)
    fp8    weight float8_e4m3fn [N, K]    weight_scale fp32 [N]          W = q * s
           input_scale fp32 [] (static activation scale; absent: per token, dynamic)
    fp4    weight_packed uint8 [N, K/2]   weight_scale float8_e4m3fn [N, K/16]
           (E2M1 codes, same nibble order) weight_global_scale fp32 [N]  W = e2m1(c) * s / g

These are what checkpoints hold (engine/quant/checkpoint.py maps compressed-tensors' and
GPTQ's layouts onto them) and what the online quantizer makes; the layers
(engine/quant/linear.py) turn them into a kernel's layout once loaded.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Smallest per-token activation scale (vLLM's): a row of zeros quantizes to zeros
# instead of dividing by zero.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
FP4_MAX = 6.0  # largest E2M1 magnitude
# E2M1 magnitudes by code (bits 0-2); bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> uint8 [N, K/2], column 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] codes 0..15."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> dict[str, torch.Tensor]:
    """Symmetric, one scale per output channel, or per group of `group_size` inputs."""
    w = w.float()
    n, k = w.shape
    g = w.view(n, 1 if group_size is None else k // group_size, -1)
    scale = (g.abs().amax(dim=-1) / 127.0).clamp_(min=1e-12)
    q = torch.round(g / scale[..., None]).clamp_(-128, 127).to(torch.int8).view(n, k)
    return {"weight": q, "weight_scale": scale.view(n) if group_size is None else scale}


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Symmetric per output channel, W = weight * scale[:, None]; or per group of
    `group_size` inputs (scale [N, K/G]), W[n, k] = weight[n, k] * scale[n, k // G]."""
    if group_size is None:
        return weight.float() * scale.float()[:, None]
    return weight.float() * scale.float().repeat_interleave(group_size, dim=1)


def quantize_int4(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Asymmetric round-to-nearest per group of `group_size` inputs (min/max), GPTQ's
    storage: 4-bit codes, a scale and an integer zero point per group."""
    w = w.float()
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp_(min=1e-12)
    zero = torch.round(-lo / scale).clamp_(0, 15)
    codes = torch.round(g / scale[..., None] + zero[..., None]).clamp_(0, 15).view(n, k)
    return {"weight_packed": pack_nibbles(codes), "weight_scale": scale, "weight_zero": zero}


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    perm: torch.Tensor | None = None) -> torch.Tensor:
    """Group-wise with zero points: W[n, k] = (c - zero[n, k // G]) * scale[n, k // G]."""
    codes = unpack_nibbles(packed).float()
    s = scale.float().repeat_interleave(group_size, dim=1)
    z = zero.float().repeat_interleave(group_size, dim=1)
    w = (codes - z) * s
    if perm is not None:  # act order: stored column j is input column perm[j]
        out = torch.empty_like(w)
        out[:, perm] = w
        return out
    return w


def quantize_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """E4M3, one scale per output channel, clamped to the format's range before the cast."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=1e-12)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}


def quantize_fp8_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8_e4m3fn [M, K], s float32 [M]) with x ~ x_q * s[:, None]:
    s = max|x_m| / 448 per row (at least FP8_MIN_SCALE), or the static `input_scale`."""
    xf = x.float()
    if input_scale is None:
        s = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    else:
        s = input_scale.float().reshape(1).expand(x.shape[0]).contiguous()
    return (xf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def _e2m1_table(device: torch.device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, device=device)
    return torch.cat((mags, -mags))


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0..15 -> float32 (bit 3 sign, bits 0-2 index E2M1_VALUES)."""
    return _e2m1_table(codes.device)[codes.long()]


def quantize_fp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4: E2M1 values, an E4M3 scale per 16 inputs, one fp32 global scale.

    global = 448 * 6 / amax(|W|) maps the largest block scale onto E4M3's top; a block's
    scale is amax(block) / 6 * global, rounded to E4M3; values are W * global / scale
    rounded to the nearest E2M1 value (ties away from the larger magnitude's code order
    do not matter: the grid is exact).
    """
    w = w.float()
    n, k = w.shape
    amax = w.abs().amax().clamp(min=1e-12)
    global_scale = (FP8_MAX * FP4_MAX / amax).reshape(1)
    blocks = w.view(n, k // 16, 16)
    block_scale = (blocks.abs().amax(dim=-1) / FP4_MAX * global_scale).clamp_(max=FP8_MAX).to(torch.float8_e4m3fn)
    bs = block_scale.float().clamp(min=1e-12)
    scaled = (blocks * global_scale / bs[..., None]).clamp_(-FP4_MAX, FP4_MAX).view(n, k)
    table = _e2m1_table(w.device)
    codes = (scaled[..., None] - table).abs().argmin(dim=-1)  # index into [+mags, -mags]
    return {
        "weight_packed": pack_nibbles(codes),
        "weight_scale": block_scale,
        "weight_global_scale": global_scale.expand(n).contiguous(),
    }


def dequantize_fp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4: W[n, k] = e2m1(c) * block_scale[n, k // 16] / global_scale[n]."""
    values = e2m1_to_float(unpack_nibbles(packed))
    blocks = block_scale.float().repeat_interleave(16, dim=1)
    return values * blocks / global_scale.float()[:, None]


def quantize(method: str, w: torch.Tensor, group_size: int | None = None) -> dict[str, torch.Tensor]:
    if method == "int8":
        return quantize_int8(w, group_size)
    if method == "int4":
        assert group_size is not None  # set by the layer, not by a user
        return quantize_int4(w, group_size)
    if method == "fp8":
        return quantize_fp8(w)
    return quantize_fp4(w)


def dequantize(method: str, t: dict[str, torch.Tensor], group_size: int | None = None) -> torch.Tensor:
    """A layer's canonical tensors (by their names above) -> W in float32 [N, K]."""
    if method == "int8":
        return dequantize_int8(t["weight"], t["weight_scale"], group_size)
    if method == "fp8":
        return dequantize_int8(t["weight"], t["weight_scale"])  # the same arithmetic for E4M3 values
    if method == "int4":
        assert group_size is not None
        return dequantize_int4(t["weight_packed"], t["weight_scale"], t["weight_zero"], group_size, t.get("perm"))
    return dequantize_fp4(t["weight_packed"], t["weight_scale"], t["weight_global_scale"])


# -- references the kernels are checked against (slow and simple on purpose) ----------


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) in float32, returned in x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: y = (x_q @ weight^T) * s_m * weight_scale[n] (+ bias), in x's dtype."""
    x_q, s = quantize_fp8_activations(x, input_scale)
    y = (x_q.float() @ weight.float().T) * s[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
