"""What to quantize, and how: the names a user passes and what a checkpoint declares.

    --quantization int8|int4|fp8|fp4     quantize a full-precision checkpoint while loading
    config.json quantization_config       a pre-quantized checkpoint (compressed-tensors, GPTQ)
    --kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2

Every scheme is one `WeightScheme` record: the loader, the layers and the memory plan
read the same record, so a plan's weight bytes are the loaded model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

QUANTIZATION_METHODS = ("int8", "int4", "fp8", "fp4")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
INT4_GROUP_SIZE = 128  # the online int4 scheme's group (GPTQ's and compressed-tensors' usual one)
FP4_BLOCK = 16  # NVFP4: one FP8 scale per 16 weights


@dataclass(frozen=True)
class WeightScheme:
    """How one model's linear layers are stored.

    method:        int8 (W8A16, symmetric, per output channel or per group), int4 (W4A16,
                   group-wise, zero points), fp8 (W8A8: E4M3 weights with a scale per
                   output channel, activations per token, or per tensor when
                   `static_input_scale`), fp4 (NVFP4 weight-only: E2M1, an FP8 scale per
                   16, a global scale)
    source:        "online" (quantized while loading), "compressed-tensors", "gptq"
    group_size:    int4: weights per (scale, zero) group along the input dim; int8: weights
                   per scale group along the input dim, None = one scale per output
                   channel (the online int8 scheme's; compressed-tensors' W8A16 preset
                   has groups of 128)
    act_order:     int4 from GPTQ with desc_act: input columns are permuted into groups
    ignore:        module names (ours, after the loader's renames, e.g. "lm_head") that stay
                   in full precision
    quantize_lm_head: int8 online: the LM head (and a tied embedding table) are int8 too
    """

    method: str
    source: str = "online"
    group_size: int | None = None
    act_order: bool = False
    static_input_scale: bool = False
    ignore: tuple[str, ...] = ()
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: unknown {self.method!r}; choose one of {QUANTIZATION_METHODS}")

    @property
    def label(self) -> str:
        """A short name for logs, metrics and the pairing check: `int4/gptq/g128/act_order`."""
        parts = [self.method, self.source]
        if self.group_size:
            parts.append(f"g{self.group_size}")
        if self.act_order:
            parts.append("act_order")
        if self.static_input_scale:
            parts.append("static")
        return "/".join(parts)


def online_scheme(method: str) -> WeightScheme:
    """`--quantization METHOD` on a full-precision checkpoint."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: unknown {method!r}; choose one of {QUANTIZATION_METHODS}")
    return WeightScheme(
        method=method,
        group_size=INT4_GROUP_SIZE if method == "int4" else None,
        quantize_lm_head=method == "int8",
        ignore=() if method == "int8" else ("lm_head",),
    )


def parse_kv_cache_dtype(name: str) -> str:
    """vLLM's names -> ours: "auto" or the torch float8 dtype's name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unknown {name!r}; choose one of {KV_CACHE_DTYPES}")
    return {"auto": "auto", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[name]


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    import torch

    name = parse_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if name == "auto" else getattr(torch, name)
