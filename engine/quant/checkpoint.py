"""Pre-quantized checkpoints: what config.json's quantization_config declares, and each
format's tensors mapped onto the canonical storage (engine/quant/formats.py).

A `CheckpointFormat` answers, for a tensor name (without `model.`): is it one of a
quantized module's tensors (`owns`), which module and field (`split`), does a module
have all its tensors (`complete`), and what are they in canonical form (`to_canonical`).

    quant_method           module                              formats
    compressed-tensors     engine/quant/ct_checkpoint.py       int-/naive-/pack-/float-/nvfp4-pack-quantized
    gptq                   engine/quant/gptq_checkpoint.py     4-bit, v1 and v2 zero points, act order
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pdserve.engine.quant import ct_checkpoint, gptq_checkpoint
from pdserve.engine.quant.config import WeightScheme


class CheckpointFormat(Protocol):
    scheme: WeightScheme

    def owns(self, name: str) -> bool: ...

    def split(self, name: str) -> tuple[str, str]: ...

    def complete(self, tensors: dict[str, torch.Tensor]) -> bool: ...

    def to_canonical(self, tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]: ...


def detect_format(config: dict[str, Any]) -> CheckpointFormat | None:
    """The format config.json declares; None for a full-precision checkpoint. Anything
    not supported is a ValueError naming the method and format."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config: expected an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return ct_checkpoint.parse(qc)
    if method == "gptq":
        return gptq_checkpoint.parse(qc)
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported (pdserve serves "
                     f"'compressed-tensors' and 'gptq' checkpoints, or --quantization on a full-precision one)")
