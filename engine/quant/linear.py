"""Quantized linear layers: canonical storage in, a kernel's layout after `prepare()`.

A `QuantLinear` is built empty with its scheme's canonical buffers (formats.py), filled
by the loader (from a checkpoint, or by quantizing a full-precision layer), then
`prepare()`d once for its device:

    CPU   int8  FBGEMM's int8 x int8 GEMM, activations quantized per token (W8A8:
                engine/quant/cpu_int8.py), where it measured faster at load; else
                torch._weight_int8pack_mm (decode-sized batches, bf16 activations: W8A16)
                or one GEMM of the int8 weight widened per call (larger ones): to bf16
                where the CPU computes in it natively (AMX, AVX512-BF16), else to fp32
                with the activations as they are
                per group: the weight regrouped once to [K/G, N, G] (same bytes), then
                torch._weight_int8pack_mm per group, its [M, N] sums scaled and added
                in fp32 (decode-sized batches), or W dequantized per call (bf16 or fp32,
                as above) and one GEMM (larger ones)
          int4  torch._weight_int4pack_mm_for_cpu, its own packed layout, bf16 activations
          fp8   torch._scaled_mm on E4M3 activations (per token or static) and weights
          fp4   dequantized to the activations' dtype, then one GEMM (FP4 is storage here)
    CUDA  the Triton kernels of engine/quant/triton_gemm.py, one per scheme

On a CPU the int8/int4 kernels are fast only with 16-bit activations (fp32 input takes
a scalar path, 5-25x slower: docs/benchmarks.md), so an fp32 model's activations are
rounded to bfloat16 for these GEMMs: that is what W8A16 / W4A16 mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import cpu_bf16_native
from pdserve.engine.quant import cpu_int8, formats
from pdserve.engine.quant.config import FP4_BLOCK, WeightScheme

# Rows up to this go through torch's int8 weight-only kernel; beyond, a bf16 GEMM of the
# int8 weight is faster (measured: docs/benchmarks.md, "int8 GEMM paths").
INT8PACK_MAX_ROWS = 16
CPU_ACT_DTYPE = torch.bfloat16


def layer_group_size(scheme: WeightScheme, in_features: int) -> int | None:
    """The group along the inputs: int4's (the scheme's, or the whole row when the row is
    shorter); int8's when it has groups (the same rule); else None."""
    if scheme.method == "int8" and scheme.group_size:
        group = min(scheme.group_size, in_features)
        if in_features % group:
            raise ValueError(f"quantization: int8 per group of {scheme.group_size} needs in_features divisible "
                             f"by it; a layer has {in_features}")
        return group
    if scheme.method != "int4":
        return None
    group = min(scheme.group_size or in_features, in_features)
    if in_features % group or group % 32:
        raise ValueError(f"quantization: int4 needs in_features divisible by a group of >= 32 "
                         f"(group {scheme.group_size}); a layer has {in_features}")
    return group


def canonical_shapes(scheme: WeightScheme, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The canonical buffers (formats.py) of an n x k layer: name -> (shape, dtype)."""
    m = scheme.method
    if m == "int8":
        g = layer_group_size(scheme, k)
        return {"weight": ((n, k), torch.int8), "weight_scale": ((n,) if g is None else (n, k // g), torch.float32)}
    if m == "int4":
        g = layer_group_size(scheme, k)
        assert g is not None
        shapes = {"weight_packed": ((n, k // 2), torch.uint8), "weight_scale": ((n, k // g), torch.float32),
                  "weight_zero": ((n, k // g), torch.float32)}
        if scheme.act_order:
            shapes["perm"] = ((k,), torch.int64)
        return shapes
    if m == "fp8":
        shapes = {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale": ((n,), torch.float32)}
        if scheme.static_input_scale:
            shapes["input_scale"] = ((), torch.float32)
        return shapes
    if k % FP4_BLOCK:
        raise ValueError(f"quantization: fp4 needs in_features divisible by {FP4_BLOCK}; a layer has {k}")
    return {"weight_packed": ((n, k // 2), torch.uint8), "weight_scale": ((n, k // FP4_BLOCK), torch.float8_e4m3fn),
            "weight_global_scale": ((n,), torch.float32)}


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored quantized; the bias (if any) stays full precision."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: WeightScheme,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if scheme.method in ("int4", "fp4") and in_features % 2:
            raise ValueError(f"quantization: {scheme.method} packs two inputs a byte; a layer has {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme = scheme
        self.method = scheme.method
        self.group_size = layer_group_size(scheme, in_features)
        for name, (shape, dt) in canonical_shapes(scheme, out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dt))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._kernel = "unprepared"
        self._packed: torch.ScriptObject | None = None  # FBGEMM's packed weight (W8A8: use_w8a8)

    def canonical(self) -> dict[str, torch.Tensor]:
        return {name: buf for name, buf in self.named_buffers(recurse=False) if not name.startswith("_")}

    def fill(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy canonical tensors in (shapes checked): what a quantizer or a checkpoint made."""
        own = self.canonical()
        if set(tensors) != set(own):
            raise ValueError(f"quantization: {self.method} layer needs {sorted(own)}, got {sorted(tensors)}")
        with torch.no_grad():
            for name, t in tensors.items():
                if tuple(t.shape) != tuple(own[name].shape):
                    raise ValueError(f"quantization: {name} has shape {tuple(t.shape)}, expected {tuple(own[name].shape)}")
                own[name].copy_(t.to(own[name].dtype))

    @classmethod
    def from_float(cls, linear: nn.Linear | torch.Tensor, scheme: WeightScheme, bias: torch.Tensor | None = None,
                   ) -> "QuantLinear":
        """Quantize a full-precision layer (or weight) with the scheme's own quantizer."""
        weight = linear.weight if isinstance(linear, nn.Linear) else linear
        if isinstance(linear, nn.Linear):
            bias = linear.bias
        n, k = weight.shape
        with torch.device(weight.device):
            layer = cls(k, n, bias is not None, scheme, weight.dtype)
        if weight.device.type != "meta":  # a memory plan's skeleton has shapes only
            layer.fill(formats.quantize(scheme.method, weight.detach(), layer.group_size))
        if bias is not None:
            with torch.no_grad():
                layer.bias.copy_(bias)
        return layer

    def dequantized(self) -> torch.Tensor:
        """W in fp32 (the reference the kernels are checked against)."""
        if self._packed is not None and not hasattr(self, "weight"):
            weight = torch.ops.quantized.linear_unpack(self._packed)[0].int_repr()
            return formats.dequantize(self.method, {"weight": weight, "weight_scale": self.weight_scale}, None)
        return formats.dequantize(self.method, self.canonical(), self.group_size)

    @property
    def w8a8_ready(self) -> bool:
        """Whether this layer can take FBGEMM's W8A8 kernel: int8 per channel, prepared on a CPU."""
        return (self._kernel == "cpu" and self.method == "int8" and self.group_size is None
                and hasattr(self, "weight") and self.weight.device.type == "cpu")

    def use_w8a8(self) -> None:
        """Run the W8A8 kernel from now on: the int8 weight packed for FBGEMM, the matrix
        dropped (not for a tied LM head: its matrix is the embedding table)."""
        self._packed = cpu_int8.pack(self.weight, self.weight_scale)
        self._pin = cpu_int8.pin_row(self.in_features)
        del self.weight

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed weight (not a buffer), counted as the int8 matrix it
        replaces: FBGEMM's padding and column sums (4 bytes an output) are not counted."""
        return self.in_features * self.out_features if self._packed is not None else 0

    # -- kernels -----------------------------------------------------------------------

    def prepare(self) -> None:
        """Once, after loading: move the canonical tensors into this device's kernel layout."""
        cuda = self._device().type == "cuda"
        if self.method == "int4" and not cuda:
            codes = formats.unpack_nibbles(self.weight_packed).to(torch.int32)
            # torch's layout: w = (c - 8) * scale + zero', so zero' = (8 - z) * scale
            s, z = self.weight_scale, self.weight_zero
            sz = torch.stack((s, (8.0 - z) * s), dim=-1).transpose(0, 1).contiguous().to(CPU_ACT_DTYPE)
            if self.weight_packed.device.type != "meta":
                self.weight_packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            del self.weight_scale, self.weight_zero
            self.register_buffer("_scales_zeros", sz)
        if self.method == "int8" and not cuda:
            device = self.weight.device
            if self.group_size is not None:
                self._regroup_int8()
            self.register_buffer("_ones", torch.ones(self.out_features, dtype=CPU_ACT_DTYPE, device=device))
            # beyond decode-sized batches the int8 weight is widened for one GEMM: to bfloat16
            # where the CPU computes in it natively, else to float32 (emulated bfloat16 GEMMs
            # ran 3-8x slower than float32 ones: docs/benchmarks.md, "Fast by default (issue 38)")
            self._wide_dtype = CPU_ACT_DTYPE if cpu_bf16_native() is not None else torch.float32
        self._kernel = "cuda" if cuda else "cpu"

    def _regroup_int8(self) -> None:
        """Grouped int8 on a CPU: weight [N, K] -> [K/G, N, G] and scales [N, K/G] -> [K/G, N],
        so each group's weight is one contiguous [N, G] matrix for torch's int8 kernel. The
        same bytes, and done on the meta device too: a memory plan counts what is loaded."""
        n, k, g = self.out_features, self.in_features, self.group_size
        weight = self.weight.view(n, k // g, g).transpose(0, 1).contiguous()
        scales = self.weight_scale.t().contiguous()
        del self.weight, self.weight_scale
        self.register_buffer("_weight_groups", weight)
        self.register_buffer("_group_scales", scales)

    def _device(self) -> torch.device:
        return next(iter(self.buffers())).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel == "unprepared":
            raise RuntimeError("QuantLinear: prepare() was not called after loading")
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = self._cuda(x2) if self._kernel == "cuda" else self._cpu(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        m, out_dtype = self.method, x.dtype
        if m == "int8":
            if self._packed is not None:
                return cpu_int8.linear(x, self._packed, self._pin).to(out_dtype)
            if self.group_size is not None:
                return self._int8_groups_cpu(x).to(out_dtype)
            if x.shape[0] <= INT8PACK_MAX_ROWS:
                y = torch._weight_int8pack_mm(x.to(CPU_ACT_DTYPE), self.weight, self._ones)
            else:
                y = F.linear(x.to(self._wide_dtype), self.weight.to(self._wide_dtype))
            return (y.float() * self.weight_scale).to(out_dtype)
        if m == "int4":
            xa = x.to(CPU_ACT_DTYPE)
            if self.scheme.act_order:
                xa = xa.index_select(1, self.perm)
            return torch._weight_int4pack_mm_for_cpu(xa, self.weight_packed, self.group_size,
                                                     self._scales_zeros).to(out_dtype)
        if m == "fp8":
            static = getattr(self, "input_scale", None)
            xq, xs = formats.quantize_fp8_activations(x, static)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs[:, None], scale_b=self.weight_scale[None, :],
                                 out_dtype=torch.float32)
            return y.to(out_dtype)
        w = formats.dequantize_fp4(self.weight_packed, self.weight_scale, self.weight_global_scale)
        return F.linear(x, w.to(out_dtype))

    def _int8_groups_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Grouped int8, x [M, K] -> fp32 y [M, N] = sum over groups i of
        (x_i @ W_i^T) * s_i. Decode-sized batches: torch's int8 kernel per group (it reads
        int8 only), the partial sums stacked, scaled and summed in fp32 in one step;
        larger ones: W dequantized per call (bf16 or fp32: prepare()), then one GEMM. Measured on this
        2-core CPU, G=128, 1 row: N=4096, K=768 0.16 ms per group vs 0.9-4 ms dequantized
        (the bf16 copy leaves the cache); N=768, K=4096 0.24 ms (32 kernel calls of
        ~5 us; per channel 0.1 ms, fp32 F.linear 0.23 ms); 8 rows 0.6-0.7 ms vs 0.9-4;
        by 16-32 rows the dequantized GEMM wins on smaller layers (N=2304: 0.5 vs 0.6 ms)."""
        g, n = self.group_size, self.out_features
        if x.shape[0] <= INT8PACK_MAX_ROWS:
            xa = x.to(CPU_ACT_DTYPE)
            partial = torch.stack([torch._weight_int8pack_mm(x_i, w_i, self._ones)
                                   for x_i, w_i in zip(xa.split(g, dim=1), self._weight_groups)])  # [K/G, M, N]
            return (partial.float() * self._group_scales[:, None, :]).sum(0)
        wide = self._wide_dtype
        w = self._weight_groups.to(wide) * self._group_scales.to(wide)[..., None]
        return F.linear(x.to(wide), w.transpose(0, 1).reshape(n, self.in_features)).float()

    def _cuda(self, x: torch.Tensor) -> torch.Tensor:
        from pdserve.engine.quant import triton_gemm as tg

        m = self.method
        if m == "int8":
            return tg.int8_linear(x, self.weight, self.weight_scale, group_size=self.group_size)
        if m == "int4":
            if self.scheme.act_order:
                x = x.index_select(1, self.perm)
            return tg.int4_linear(x, self.weight_packed, self.weight_scale, self.weight_zero, self.group_size)
        if m == "fp8":
            return tg.fp8_linear(x, self.weight, self.weight_scale, getattr(self, "input_scale", None))
        return tg.fp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.scheme.label}"


class QuantEmbedding(nn.Module):
    """A tied embedding table read from the int8 LM head's weight: row t is token t's
    embedding (per-row scales are the LM head's per-output-channel scales)."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if head.method != "int8" or head.group_size is not None:
            raise ValueError("quantization: only an int8 LM head with per-row scales can serve as the embedding table")
        self.head = [head]  # a list: not a submodule, so its buffers are counted once
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        rows = head.weight.index_select(0, ids).float() * head.weight_scale.index_select(0, ids)[:, None]
        return rows.to(self.dtype)
