"""Full-precision linear layers with their weights prepacked for oneDNN (CPU only).

torch's `F.linear` on a CPU reads the weights of a decode-sized GEMM (1-64 rows) at
a third to a half of the memory's bandwidth (12.6 GB/s at one row against 32 GB/s
read on this machine kind; `python -m pdserve.bench.gemm`). The same GEMM through
oneDNN, with the weight reordered once into oneDNN's blocked layout, reads at 22-26
GB/s, and is faster at prefill sizes too (1.2x at 512 rows), so a prepacked layer
replaces the plain one for every step, not only for decode.

The reorder is a one-time copy; the plain weight is dropped afterwards, so a packed
model holds its weights once, except a tied LM head: the embedding table stays for
the lookup and the head gets its own packed copy (vocab x hidden more bytes).

Outputs differ from `F.linear`'s in the last bits (another summation order: ~1e-7
relative in fp32); `EngineConfig.enforce_eager` keeps the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The row count oneDNN picks the packed layout for: layouts packed for 1 row run 1.5x
# slower at 16 rows, ones packed for a few dozen lose little at 1 row (bench.gemm).
PACK_FOR_ROWS = 64
# Smaller weights stay plain: a oneDNN call costs ~17-22 us however small its GEMM,
# F.linear 3-6 us, and they break even near 256K weights (a 512 x 512 layer).
MIN_PACKED_WEIGHTS = 2**18
# oneDNN reads a packed weight ~15% faster for 4 rows than for 1 (its one-row kernel is
# another, slower one: bench.gemm), so fewer rows are padded with zeros to this many
# (a decode step at batch 1: 21.5 -> 19.3 ms on bench.offline's model).
MIN_ROWS = 4
DTYPES = (torch.float32, torch.bfloat16)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prepacking applies: a CPU with oneDNN, fp32 or bf16 weights."""
    return device.type == "cpu" and dtype in DTYPES and torch.backends.mkldnn.is_available()


class PrepackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's layout; any leading dims, any row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"prepacked linear: weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # An opaque oneDNN tensor: not a parameter or buffer (it has no storage to count,
        # hash or move); `nbytes` says what it holds.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_FOR_ROWS)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PrepackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() == 2 and rows < MIN_ROWS:
            padded = F.pad(x, (0, 0, 0, MIN_ROWS - rows))
            return torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module, tied_head: torch.Tensor | None = None) -> int:
    """Replace every `nn.Linear` under `model` with at least MIN_PACKED_WEIGHTS weights by
    a `PrepackedLinear` (quantized layers are left alone); with `tied_head` (the
    embedding table a tied LM head reads), give the model an `lm_head` packed from it.
    Returns how many layers were packed."""
    swaps = [(name, module) for name, module in model.named_modules()
             if type(module) is nn.Linear and module.weight.numel() >= MIN_PACKED_WEIGHTS]
    for name, module in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PrepackedLinear.from_linear(module))
    if tied_head is not None and tied_head.numel() >= MIN_PACKED_WEIGHTS:
        model.lm_head = PrepackedLinear(tied_head, None)
        return len(swaps) + 1
    return len(swaps)


def packed_bytes(model: nn.Module) -> int:
    """Bytes the prepacked weights under `model` hold (they are not parameters)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, PrepackedLinear))
