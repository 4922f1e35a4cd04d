"""Full-precision linear layers with their weights prepacked for oneDNN (CPU only).

torch's `F.linear` on a CPU reads the weights of a decode-sized GEMM (1-64 rows) at
a third to a half of the memory's bandwidth (12.6 GB/s at one row against 32 GB/s
read on this machine kind; `python -m pdserve.bench.engine.gemm`). The same GEMM through
oneDNN, with the weight reordered once into oneDNN's blocked layout, reads at 22-26
GB/s, and is faster at prefill sizes too (1.2x at 512 rows), so a prepacked layer
replaces the plain one for every step, not only for decode.

The reorder is a one-time copy; the plain weight is dropped afterwards, so a packed
model holds its weights once, except a tied LM head: the embedding table stays for
the lookup and the head gets its own packed copy (vocab x hidden more bytes).

Outputs differ from `F.linear`'s in the last bits (another summation order: ~1e-7
relative in fp32); `EngineConfig.enforce_eager` keeps the plain layers.

A compiled graph (engine/captured.py) cannot trace oneDNN's opaque tensor, so the
packed weight lives in a `PackedWeight` (a torch.library opaque object) and a compiled
graph calls `pdserve::prepacked_linear` on it: every graph shares the layer's one
packed copy, and the eager path calls oneDNN directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
from torch._opaque_base import OpaqueBase

# The row count oneDNN picks the packed layout for: layouts packed for 1 row run 1.5x
# slower at 16 rows, ones packed for a few dozen lose little at 1 row (bench.engine.gemm).
PACK_FOR_ROWS = 64
# Smaller weights stay plain: a oneDNN call costs ~17-22 us however small its GEMM,
# F.linear 3-6 us, and they break even near 256K weights (a 512 x 512 layer).
MIN_PACKED_WEIGHTS = 2**18
# oneDNN reads a packed weight ~15% faster for 4 rows than for 1 (its one-row kernel is
# another, slower one: bench.engine.gemm), so fewer rows are padded with zeros to this many
# (a decode step at batch 1: 21.5 -> 19.3 ms on bench.engine.offline's model).
MIN_ROWS = 4
# oneDNN keeps state per input shape, and memory grows without bound when the row
# count takes many values (RSS 0.2 -> 13 GB over a few thousand calls of 1-2048 rows:
# a prefill worker sees every prompt length). So every call reaches oneDNN with one of
# a few row counts: powers of two up to 64 (decode), multiples of ROW_STEP up to
# MAX_CHUNK_ROWS (prefill chunks); longer inputs go in MAX_CHUNK_ROWS-row pieces.
ROW_STEP = 32
MAX_CHUNK_ROWS = 512
DTYPES = (torch.float32, torch.bfloat16)


def bucket_rows(rows: int) -> int:
    """The row count a call of `rows` rows (1..MAX_CHUNK_ROWS) is padded to."""
    if rows <= 64:
        return max(MIN_ROWS, 1 << (rows - 1).bit_length())
    return -(-rows // ROW_STEP) * ROW_STEP


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prepacking applies: a CPU with oneDNN, fp32 weights, or bf16 weights on
    a CPU whose oneDNN has a bf16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only
    CPU refuses to pack bf16, so those engines keep plain linears)."""
    if device.type != "cpu" or dtype not in DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight(OpaqueBase):
    """A weight in oneDNN's layout, opaque to torch.compile (passed to the graph by reference)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_FOR_ROWS)


register_opaque_type(PackedWeight, typ="reference")


def _onednn_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], None)


def _define_prepacked_linear() -> torch.library.Library:
    """`pdserve::prepacked_linear(x, weight, bias, out_features)`: x [rows, in] (rows one of
    bucket_rows' counts) times a packed weight. Defined on a plain torch.library.Library,
    not with torch.library.custom_op, whose Python wrapper costs ~10 us more a call (a
    decode step makes one per layer and projection)."""
    lib = torch.library.Library("pdserve", "FRAGMENT")
    lib.define(f"prepacked_linear(Tensor x, {get_opaque_type_name(PackedWeight)} weight, Tensor? bias, "
               "SymInt out_features) -> Tensor")
    lib.impl("prepacked_linear", lambda x, weight, bias, out_features: _onednn_linear(x, weight, bias), "CPU")
    torch.library.register_fake("pdserve::prepacked_linear",
                                lambda x, weight, bias, out_features: x.new_empty(x.shape[0], out_features), lib=lib)
    return lib


# the registration lives as long as its Library object: this module's
_LIBRARY = _define_prepacked_linear()


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
        self.packed_weight = PackedWeight(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PrepackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows <= MAX_CHUNK_ROWS:
            out = self._bucketed(flat)
        else:
            out = torch.cat([self._bucketed(chunk) for chunk in flat.split(MAX_CHUNK_ROWS)])
        return out.reshape(*x.shape[:-1], self.out_features)

    def _bucketed(self, x: torch.Tensor) -> torch.Tensor:
        """One oneDNN call on `x`'s rows padded with zeros to `bucket_rows(rows)`."""
        rows = x.shape[0]
        bucket = bucket_rows(rows)
        if bucket != rows:
            x = F.pad(x, (0, 0, 0, bucket - rows))
        if torch.compiler.is_compiling():
            out = torch.ops.pdserve.prepacked_linear(x, self.packed_weight, self.bias, self.out_features)
        else:
            out = _onednn_linear(x, self.packed_weight, self.bias)
        return out[:rows] if bucket != rows else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def worth_packing(weight: torch.Tensor | None) -> bool:
    """Whether a weight is large enough for oneDNN's per-call cost (MIN_PACKED_WEIGHTS)."""
    return weight is not None and weight.numel() >= MIN_PACKED_WEIGHTS


def prepack_linears(model: nn.Module, tied_head: torch.Tensor | None = None) -> int:
    """Replace every `nn.Linear` under `model` with at least MIN_PACKED_WEIGHTS weights by
    a `PrepackedLinear` (quantized layers are left alone); with `tied_head` (the
    embedding table a tied LM head reads), give the model an `lm_head` packed from it.
    Returns how many layers were packed."""
    swaps = [(name, module) for name, module in model.named_modules()
             if type(module) is nn.Linear and worth_packing(module.weight)]
    for name, module in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PrepackedLinear.from_linear(module))
    if worth_packing(tied_head):
        model.lm_head = PrepackedLinear(tied_head, None)
        return len(swaps) + 1
    return len(swaps)


def tied_head(model: nn.Module) -> torch.Tensor | None:
    """The embedding table a tied LM head reads (None: the model has a head of its own,
    or a quantized table, which keeps its own head path)."""
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", None) is None and type(embed) is nn.Embedding:
        return embed.weight
    return None


def added_bytes(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes `prepack_linears(model, tied_head(model))` would add on `device`: the tied
    head's packed copy (every other layer trades its weight for a packed one of the same
    size). Works on a meta-device skeleton, for memory plans."""
    head = tied_head(model) if available(device, dtype) else None
    return head.numel() * head.element_size() if worth_packing(head) else 0


def packed_bytes(model: nn.Module) -> int:
    """Bytes the prepacked weights under `model` hold (they are not parameters)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, PrepackedLinear))
